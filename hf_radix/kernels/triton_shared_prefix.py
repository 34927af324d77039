"""Shared-prefix (cascade) attention over the paged KV pool, for decode and extend.

Rows whose cached prefix is the same tree node read that prefix once per *tile of queries* instead of
once per row. A batch is described by two tile tables built on the host (:mod:`hf_radix.prefix_groups`):

* **prefix tiles** -- one per (group, chunk of up to ``prefix_tile_q`` of the group's query tokens): the
  group's shared prefix K/V are loaded once per (tile, KV head, split) and attended by every query of the
  tile and every query head of that KV head, packed into the M dimension of ``tl.dot``. Each query gets a
  normalized partial output and its log2-sum-exp per split ("part").
* **suffix tiles** -- one per (row, chunk of up to ``suffix_tile_q`` of its new tokens): the row's own
  context after the shared prefix (its private cached tokens and its new tokens), split-KV like today's
  per-row kernels. With one suffix split the suffix program folds the prefix parts (and the attention
  sink) into its own result and writes the final output; with several, every part goes to the split-KV
  merge kernel shared with the per-row kernels (parts of queries without a shared prefix are emptied).

A tile row of the table is ``(kv_start, kv_pos0, kv_len, q_start, q_len)``: keys ``j < kv_len`` live at
slots ``slots[kv_start + j]`` and have absolute positions ``kv_pos0 + j``; the queries are the token
indices ``queries[q_start : q_start + q_len]`` (rows of ``q``), at absolute positions ``query_pos[token]``.
Masks are by absolute position (causal, and Hugging Face sliding windows: ``p`` sees ``k`` iff ``k <= p``
and ``p - k < window``), so a window shorter than the prefix reads only the window. Tables are padded with
``q_len == 0`` rows (no work), so a batch of any shape up to the buffers' capacity runs in one static grid
inside a CUDA graph; every size the launch needs is a python int known to the caller (no host sync).

Attention sinks (gpt-oss ``s_aux``: one logit per query head added to the softmax denominator only) are
added exactly once, where the parts are combined. K and V may have different head sizes (MLA). All
softmax math is fp32 in base 2, as in :mod:`hf_radix.kernels.triton_attention`, whose device helpers
(``triton_attention_common``) these kernels share.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..prefix_groups import TILE_FIELDS, SharedPrefixBuffers
from . import interpreting
from .triton_attention_common import (
    _check_common,
    _check_out,
    _dot_prec,
    _finish_rows,
    _last_dim_contig,
    _launch,
    _merge_splits,
    _paged_kv_loop,
    _partial_rows,
    _scales,
    _sinks_log2,
    _window,
)
from .triton_decode import _decode_config

__all__ = ["shared_prefix_attention", "tile_config"]

_SAFE_CFG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# Optional launch-config overrides (tests / benchmarks) by BLOCK_M: keys BLOCK_N, num_warps, num_stages.
_CFG_OVERRIDE: dict[int, dict[str, int]] = {}


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


# split counts, part offsets and the partial-result strides vary with the batch: not specialized on
@triton.jit(do_not_specialize=["window", "part0", "num_prev", "stride_lt", "stride_lh"])
def _shared_prefix_tile_kernel(
    Q, K_cache, V_cache, Slots, Tiles, Queries, QPos, QShared, PrefixSplits, Sinks, Out, Mid_o, Mid_lse,
    qk_scale, cap_scale, window, part0, num_prev,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FINAL: tl.constexpr,
    IS_PREFIX: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Grid (tiles, kv_heads, splits). M rows are (query, head) pairs: query m // GROUP of the tile, query
    # head kvh * GROUP + m % GROUP, so each K/V tile is loaded once for all of them. Tiles of one group are
    # consecutive in the table and in launch order, so a group's further tiles find its prefix in L2.
    # A prefix launch (IS_PREFIX; part0 == num_prev == 0) splits each prefix into the tables' split count
    # (read on the device, at most the grid's: one captured graph serves every count); its programs past
    # the count do nothing. Parts [0, num_prev) of each query are the prefix launch's slots, the first
    # `prefix_parts` of them its results (valid where QShared != 0): FINAL folds those in and writes the
    # output; otherwise split 0 of a suffix launch empties the others, so the merge kernel takes every part.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    prefix_parts = tl.minimum(tl.load(PrefixSplits), num_prev)
    if IS_PREFIX:
        num_splits = tl.minimum(tl.load(PrefixSplits), num_splits)
        if split >= num_splits:
            return
    meta = Tiles + tile * 5
    q_len = tl.load(meta + 4)
    if q_len == 0:
        return
    kv_start = tl.load(meta).to(tl.int64)
    pos0 = tl.load(meta + 1)
    kv_len = tl.load(meta + 2)
    q_start = tl.load(meta + 3)
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP
    m_mask = (qi < q_len) & (qi < TILE_Q)
    heads = kvh * GROUP + offs_m % GROUP
    tok = tl.load(Queries + q_start + qi, mask=m_mask, other=0).to(tl.int64)
    q_pos = tl.load(QPos + tok, mask=m_mask, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V

    # Keys any query of the tile sees: [lo, hi); keys every query sees (no mask needed): [lo, safe_hi).
    # Queries at or past the range's end (all of a prefix tile's) see up to its end, and a window's start
    # within it from the end's position: so a prefix tile's range, and its split into chunks, do not
    # depend on which rows share it.
    max_pos = tl.max(tl.where(m_mask, q_pos, -1), 0)
    min_pos = tl.min(tl.where(m_mask, q_pos, 2147483647), 0)
    hi = tl.minimum(kv_len, max_pos - pos0 + 1)
    if USE_WINDOW:
        lo = tl.maximum(tl.minimum(min_pos, pos0 + kv_len) - window + 1 - pos0, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        safe_hi = lo
    else:
        lo = kv_len * 0
        safe_hi = tl.minimum(kv_len, min_pos - pos0 + 1)
    span = tl.maximum(hi - lo, 0)
    split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    c_lo = lo + split * split_len
    c_hi = tl.minimum(c_lo + split_len, hi)
    full = c_lo + tl.maximum(tl.minimum(c_hi, safe_hi) - c_lo, 0) // BLOCK_N * BLOCK_N

    q_ptrs = Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: no (-inf) - (-inf)
    kv_idx_ptr = Slots + kv_start
    acc, l_i, m_i = _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, c_lo, full, pos0, q_pos,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, False, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    acc, l_i, m_i = _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, c_hi, pos0, q_pos,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, True, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    st_mask = m_mask[:, None] & dv_mask[None, :]
    mid_lse = Mid_lse + tok * stride_lt + heads * stride_lh
    mid_o = Mid_o + tok[:, None] * stride_mt + heads[:, None] * stride_mh + offs_dv[None, :]
    shared = tl.load(QShared + tok, mask=m_mask, other=0)
    if FINAL:
        prev = m_mask & (shared != 0)
        for part in range(0, prefix_parts):
            lse_p = tl.load(mid_lse + part, mask=prev, other=float("-inf"))
            o_p = tl.load(mid_o + part * stride_ms, mask=prev[:, None] & dv_mask[None, :], other=0.0)
            m_new = tl.maximum(m_i, lse_p)
            alpha = tl.exp2(m_i - m_new)
            w = tl.exp2(lse_p - m_new)
            acc = acc * alpha[:, None] + o_p * w[:, None]
            l_i = l_i * alpha + w
            m_i = m_new
        out = _finish_rows(acc, l_i, m_i, Sinks, heads, m_mask, HAS_SINKS)
        o_ptrs = Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        out, lse = _partial_rows(acc, l_i, m_i)
        tl.store(mid_o + (part0 + split) * stride_ms, out, mask=st_mask)
        tl.store(mid_lse + part0 + split, lse, mask=m_mask)
        if split == 0:
            alone = m_mask & (shared == 0)
            for part in range(0, num_prev):
                empty = alone | (m_mask & ((shared * 0 + part) >= prefix_parts))
                tl.store(mid_o + part * stride_ms, tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32),
                         mask=empty[:, None] & dv_mask[None, :])
                tl.store(mid_lse + part, tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf"), mask=empty)


# --------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------


def _block_m(tile_q: int, group: int) -> int:
    return max(16, triton.next_power_of_2(tile_q * group))


def tile_config(block_m: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Launch config of the tile kernel for ``block_m`` (query, head) rows per program.

    Narrow tiles (one row's query heads: decode suffix tiles, ``block_m`` 16) are bandwidth-bound like the
    per-row decode kernel's programs, of the same shape, and take its config (``_decode_config``; on sm_90
    BLOCK_N 64, 4 warps, 3 stages: 98% of HBM bandwidth in its sweep), as off CUDA. Wide tiles (a group's
    queries, 128 rows) are tensor-core tiles like the extend kernel's BLOCK_M 128 tiles: BLOCK_N 64 with 8
    warps (a 128x128 fp32 accumulator is 64 registers a thread) and 3 stages (64 KB of shared memory at
    head_dim 128 in bf16; at head_dim 256, 2 stages and 128 KB, as the extend kernel's tuned d256 config).
    """
    if block_m in _CFG_OVERRIDE:
        return dict(_CFG_OVERRIDE[block_m])
    if block_m < 128 or device.type != "cuda" or interpreting():
        return _decode_config(head_dim, dtype, device)
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if triton.next_power_of_2(head_dim) <= 128:
        return {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def _check_tiles(tiles: SharedPrefixBuffers, num_tokens: int) -> None:
    for name in ("prefix_tiles", "suffix_tiles"):
        t = getattr(tiles, name)
        if t.dim() != 2 or t.shape[1] != TILE_FIELDS or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 [N, {TILE_FIELDS}] tensor")
    for name in ("prefix_queries", "suffix_queries", "query_pos", "query_shared"):
        if getattr(tiles, name).dtype != torch.int32:
            raise ValueError(f"{name} must be int32")
    if tiles.query_pos.shape[0] < num_tokens or tiles.query_shared.shape[0] < num_tokens:
        raise ValueError(f"query_pos / query_shared must cover the {num_tokens} query tokens")


def shared_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    tiles: SharedPrefixBuffers,
    scaling: float,
    *,
    num_prefix_splits: int = 1,
    num_suffix_splits: int = 1,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the query tokens ``q`` ``[T, Hq, D]`` over the pool, shared prefixes read once per tile.

    ``k_cache`` ``[slots, Hkv, D]``, ``v_cache`` ``[slots, Hkv, Dv]``; ``slots`` is the flat slot array the
    tiles index (e.g. a batch's ``kv_indices``, or the flattened request-to-slot table); the K/V of the new
    tokens must already be in the pool. ``tiles`` is the batch's
    :class:`~hf_radix.prefix_groups.SharedPrefixBuffers`. ``sinks`` ``[Hq]`` are attention-sink logits
    (natural log units), counted once in each softmax denominator. Split counts are python ints chosen by
    the caller (:func:`~hf_radix.kernels.triton_attention.pick_num_kv_splits` over tiles and longest range);
    prefixes are split into the smaller of ``num_prefix_splits`` and the count the tables hold on the device
    (``tiles.prefix_splits``, set by their ``load``), so a captured graph launched with the largest count
    replays batches of any.
    Returns ``[T, Hq, Dv]`` in ``q``'s dtype; rows of tokens outside every suffix tile are undefined.
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    num_tokens = q.shape[0]
    _check_tiles(tiles, num_tokens)
    if num_prefix_splits < 1 or num_suffix_splits < 1:
        raise ValueError("split counts must be >= 1")
    q = _last_dim_contig(q)
    out = _check_out(out, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
    if num_tokens == 0 or tiles.suffix_tiles.shape[0] == 0:
        return out

    group = hq // hkv
    prefix_parts = num_prefix_splits if tiles.prefix_tiles.shape[0] > 0 else 0
    final = num_suffix_splits == 1
    num_parts = prefix_parts + (0 if final else num_suffix_splits)
    if num_parts:
        mid_o = torch.empty((num_tokens, hq, num_parts, dv), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_tokens, hq, num_parts), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    else:
        mid_o, mid_lse, mstrides = out, out, (0, 0, 0, 0, 0)  # unused placeholders
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    window, use_window = _window(sliding_window)

    def launch(table: torch.Tensor, queries: torch.Tensor, tile_q: int, splits: int, part0: int,
               num_prev: int, is_final: bool, is_prefix: bool) -> None:
        block_m = _block_m(tile_q, group)
        args = (
            q, k_cache, v_cache, slots, table, queries, tiles.query_pos, tiles.query_shared,
            tiles.prefix_splits, sinks, out,
            mid_o, mid_lse, qk_scale, cap_scale, window, part0, num_prev,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), out.stride(0), out.stride(1), *mstrides,
        )
        kwargs: dict[str, Any] = dict(
            GROUP=group, TILE_Q=tile_q, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
            BLOCK_DV=triton.next_power_of_2(dv), BLOCK_M=block_m, USE_WINDOW=use_window, SOFTCAP=use_cap,
            HAS_SINKS=has_sinks, FINAL=is_final, IS_PREFIX=is_prefix, DOT_PREC=_dot_prec(q.dtype),
        )
        cfg = tile_config(block_m, max(d, dv), q.dtype, q.device)
        _launch(f"shared_prefix_m{block_m}", _shared_prefix_tile_kernel, (table.shape[0], hkv, splits), cfg,
                _SAFE_CFG, d, q.dtype, args, kwargs)

    if prefix_parts:
        launch(tiles.prefix_tiles, tiles.prefix_queries, tiles.prefix_tile_q, num_prefix_splits, 0, 0, False,
               True)
    launch(tiles.suffix_tiles, tiles.suffix_queries, tiles.suffix_tile_q, num_suffix_splits, prefix_parts,
           prefix_parts, final, False)
    if not final:
        _merge_splits(mid_o, mid_lse, out, num_parts, sinks, has_sinks)
    return out
