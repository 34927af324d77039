"""Batch-invariant decode attention that reads a shared prefix once per tile of rows (deterministic mode).

A program computes one tile of decode rows (one new token each) for one KV head: up to
``BLOCK_M // GROUP`` rows, their (row, query head) pairs packed in the M dimension. The tile's rows share
their first ``BLOCK_N * blocks`` context positions (the same slots: a radix-tree node's). Those key blocks
are read once, from the first row's slot list, and update every row's online softmax; then each row's own
blocks (the boundary block included) are read from its own slot list, every other row of the tile masked.

Each (row, head) entry thus goes through the key blocks, masks and launch config of
:func:`~.triton_invariant_attention.invariant_attention` in the same order; the blocks it does not see are
exact no-ops (``p = 0``, ``alpha = 1``), and its place in the tile is invisible to a matrix instruction.
Its result is therefore bit-identical to the per-row kernel's, grouped or alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION
from .triton_attention_common import (
    _check_common,
    _check_out,
    _dot_prec,
    _last_dim_contig,
    _paged_kv_loop,
    _scales,
    _sinks_log2,
    _store_rows,
    _window,
)
from .triton_invariant_attention import invariant_config

__all__ = ["grouped_decode_attention", "tile_shape"]


@triton.jit
def _window_start(q_pos, window, BLOCK_N: tl.constexpr):
    """The first key block a query at ``q_pos`` sees through the window (as the per-row kernel starts)."""
    return tl.maximum(q_pos - window + 1, 0) // BLOCK_N * BLOCK_N


@triton.jit(do_not_specialize=["window", "num_rows"])
def _grouped_decode_kernel(
    Q, K_cache, V_cache, Out, Sinks, kv_indices, kv_indptr, tile_rows, tile_blocks,
    qk_scale, cap_scale, window, num_rows,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Grid (tiles, KV heads). A decode row is its token: row r's query is Q[r], its context kv_indptr[r:r+2].
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    table = tile_rows + tile * ROWS
    first = tl.load(table)
    if (first < 0) | (first >= num_rows):
        return
    offs_m = tl.arange(0, BLOCK_M)
    place = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    rows = tl.load(table + place, mask=place < ROWS, other=-1)
    m_mask = (rows >= 0) & (rows < num_rows)
    rows = tl.where(m_mask, rows, first)
    kv_start = tl.load(kv_indptr + rows)
    q_pos = tl.load(kv_indptr + rows + 1) - kv_start - 1
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

    q_tok = rows.to(tl.int64)
    q = tl.load(Q + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # the shared blocks, once for every row (those before a row's window start are no-ops for it)
    shared_end = tl.load(tile_blocks + tile) * BLOCK_N
    lo = shared_end * 0
    if USE_WINDOW:
        lo = tl.min(tl.where(m_mask, _window_start(q_pos, window, BLOCK_N), shared_end), 0)
    acc, l_i, m_i = _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_indices + tl.load(kv_indptr + first), lo, shared_end, 0, q_pos,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, True, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    # then each row's own blocks; a query position of -1 masks the other rows' entries whole
    for p in range(0, ROWS):
        row = tl.load(table + p)
        own = (row >= 0) & (row < num_rows)
        row = tl.where(own, row, first)
        start = tl.load(kv_indptr + row)
        hi = tl.where(own, tl.load(kv_indptr + row + 1) - start, 0)
        lo = shared_end
        if USE_WINDOW:
            lo = tl.maximum(lo, _window_start(hi - 1, window, BLOCK_N))
        mine = tl.where(place == p, q_pos, -1)
        acc, l_i, m_i = _paged_kv_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_indices + start, lo, hi, 0, mine,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, True, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N,
            DOT_PREC)
    _store_rows(acc, l_i, m_i, Out, Out, Out, Sinks, q_tok[:, None], q_tok, heads, m_mask, offs_dv, dv_mask,
                0, stride_ot, stride_oh, 0, 0, 0, 0, 0, True, HAS_SINKS)


def tile_shape(num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(rows a tile holds, keys a block holds) of the kernel at this attention shape: ``BLOCK_M // GROUP``
    rows (below 2, grouping reads nothing less than the per-row kernel) and ``BLOCK_N``."""
    cfg = invariant_config(head_dim, device)
    return cfg["BLOCK_M"] // (num_q_heads // num_kv_heads), cfg["BLOCK_N"]


def grouped_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    tile_rows: torch.Tensor,
    tile_blocks: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention (row ``i``'s one query is ``q[i]``) over tiles of rows; each row's result is
    bit-identical to :func:`~.triton_invariant_attention.invariant_attention`'s for it.

    ``kv_indices``/``kv_indptr``: CSR slot lists of each row's whole context (the new token included).
    ``tile_rows`` ``[tiles, BLOCK_M // GROUP]`` int32: each tile's rows, then -1 (a tile whose first row is
    -1 or past the batch does nothing: a graph launches more tiles than a plan fills); ``tile_blocks``
    ``[tiles]`` int32: the ``BLOCK_N`` key blocks from position 0 every row of the tile holds in the same
    slots, at most its cached prefix. Every row must be in one tile. Returns ``[B, Hq, Dv]``.
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    batch = q.shape[0]
    if kv_indptr.shape[0] < batch + 1:
        raise ValueError("kv_indptr must have an entry per row and one more")
    cfg = dict(config) if config is not None else invariant_config(d, q.device)
    group = hq // hkv
    rows_per_tile = cfg["BLOCK_M"] // group
    tables_ok = tile_rows.dim() == 2 and tile_rows.shape[1] == rows_per_tile
    if not (tables_ok and tile_blocks.shape == tile_rows.shape[:1]):
        raise ValueError(f"tile_rows must be [tiles, {rows_per_tile}] and tile_blocks [tiles]")
    q = _last_dim_contig(q)
    out = _check_out(None, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
    if batch == 0 or tile_rows.shape[0] == 0:
        return out
    window, use_window = _window(sliding_window)
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    _grouped_decode_kernel[(tile_rows.shape[0], hkv)](
        q, k_cache, v_cache, out, sinks, kv_indices, kv_indptr, tile_rows, tile_blocks,
        qk_scale, cap_scale, window, batch,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, ROWS=rows_per_tile, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
        BLOCK_DV=triton.next_power_of_2(dv), USE_WINDOW=use_window, SOFTCAP=use_cap, HAS_SINKS=has_sinks,
        DOT_PREC=_dot_prec(q.dtype), enable_fp_fusion=FP_FUSION, **cfg,
    )
    return out
