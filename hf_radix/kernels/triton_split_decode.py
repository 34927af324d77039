"""Batch-invariant decode attention split at fixed absolute key positions (deterministic mode).

Every decode row's context is cut into the pieces the extend kernel cuts it into
(:mod:`.triton_invariant_attention`: ``[p PIECE, (p + 1) PIECE)``), each computed from fresh accumulators
over the same key blocks with the same masks. The pieces run as programs of their own:

* a tile of rows sharing a tree node (``BLOCK_M // GROUP`` rows, their (row, query head) pairs packed in M)
  computes each piece wholly inside the shared prefix once for every row: its K/V read once, from the first
  row's slot list;
* every other piece of a row (the one holding the end of the shared prefix, the row's own keys; every
  piece of a row in no tile) is a program of the row's query heads.

Each writes its unnormalized partial (acc, l, m) per (row, head, piece); a merge program per (row, KV head)
then merges the row's pieces in order with ``_merge_piece`` and finishes (sinks) as the extend kernel does.
A piece's partial depends on the row's query and the piece's keys alone, and the merge is the extend
kernel's, so each row's result is bit-identical to its extend result, whatever program computed a piece:
the programs a row or tile gets (lanes, each taking every ``lanes``-th piece) follow the launch size only.
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
    _merge_piece,
    _no_keys,
    _piece,
    _scales,
    _sinks_log2,
    _sm_count,
    _store_rows,
    _window,
)
from .triton_invariant_attention import invariant_config

__all__ = ["split_decode_attention", "tile_shape"]

TILE_LANES = 4  # the fewest programs a tile's shared pieces get (a graph's tiles are few among its slots)


@triton.jit
def _window_block(q_pos, window, BLOCK_N: tl.constexpr):
    """The first key block a query at ``q_pos`` sees through the window."""
    return tl.maximum(q_pos - window + 1, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _store_piece(acc, l_i, m_i, Part_acc, Part_l, Part_m, rows, heads, piece, m_mask, offs_dv,
                 stride_pr, stride_ph, stride_pp, stride_lr, stride_lh):
    """Writes a piece's unnormalized partial of (row, head) entries: acc to ``Part_acc``, l and m."""
    rows = rows.to(tl.int64)
    rh = rows * stride_lr + heads * stride_lh + piece
    tl.store(Part_l + rh, l_i, mask=m_mask)
    tl.store(Part_m + rh, m_i, mask=m_mask)
    a_ptrs = Part_acc + rows[:, None] * stride_pr + heads[:, None] * stride_ph + piece * stride_pp
    tl.store(a_ptrs + offs_dv[None, :], acc, mask=m_mask[:, None])


@triton.jit(do_not_specialize=["window", "num_rows", "lanes"])
def _tile_pieces_kernel(
    Q, K_cache, V_cache, Part_acc, Part_l, Part_m, kv_indices, kv_indptr, tile_rows, tile_pieces,
    qk_scale, cap_scale, window, num_rows, lanes,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch,
    stride_pr, stride_ph, stride_pp, stride_lr, stride_lh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PIECE: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Grid (tiles * lanes, KV heads): lane c of a tile computes its shared pieces c, c + lanes, ...
    tile = tl.program_id(0) // lanes
    lane = tl.program_id(0) % lanes
    kvh = tl.program_id(1)
    table = tile_rows + tile * ROWS
    first = tl.load(table)
    pieces = tl.load(tile_pieces + tile)
    if (first < 0) | (first >= num_rows) | (lane >= pieces):
        return
    offs_m = tl.arange(0, BLOCK_M)
    place = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    rows = tl.load(table + place, mask=place < ROWS, other=-1)
    m_mask = (rows >= 0) & (rows < num_rows)
    rows = tl.where(m_mask, rows, first)
    q_pos = tl.load(kv_indptr + rows + 1) - tl.load(kv_indptr + rows) - 1
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)
    q = tl.load(Q + rows.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    slots = kv_indices + tl.load(kv_indptr + first)
    lo = pieces * 0
    if USE_WINDOW:  # blocks before every row's window are no-ops: not read
        lo = tl.min(tl.where(m_mask, _window_block(q_pos, window, BLOCK_N), pieces * PIECE), 0)
    for piece in range(lane, pieces, lanes):
        start = piece * PIECE
        acc, l_i, m_i = _piece(
            q, K_cache, V_cache, slots, tl.maximum(lo, start), start + PIECE, q_pos, kvh, stride_kct,
            stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window, offs_n, offs_d, offs_dv, d_mask,
            dv_mask, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_DV, DOT_PREC)
        _store_piece(acc, l_i, m_i, Part_acc, Part_l, Part_m, rows, heads, piece, m_mask, offs_dv,
                     stride_pr, stride_ph, stride_pp, stride_lr, stride_lh)


@triton.jit
def _first_piece(Row_pieces, row, q_pos, window, HAS_TILES: tl.constexpr, USE_WINDOW: tl.constexpr,
                 PIECE: tl.constexpr):
    """The first piece of a row a merge reads (USE_WINDOW) or its own programs compute (HAS_TILES: past
    the pieces its tile computes)."""
    first = q_pos * 0
    if HAS_TILES:
        first = tl.load(Row_pieces + row)
    if USE_WINDOW:
        first = tl.maximum(first, tl.maximum(q_pos - window + 1, 0) // PIECE)
    return first


@triton.jit(do_not_specialize=["window", "lanes"])
def _row_pieces_kernel(
    Q, K_cache, V_cache, Part_acc, Part_l, Part_m, kv_indices, kv_indptr, Row_pieces,
    qk_scale, cap_scale, window, lanes,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch,
    stride_pr, stride_ph, stride_pp, stride_lr, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PIECE: tl.constexpr, HAS_TILES: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Grid (rows * lanes, KV heads): lane c of a row computes its pieces first + c, first + c + lanes, ...
    row = tl.program_id(0) // lanes
    lane = tl.program_id(0) % lanes
    kvh = tl.program_id(1)
    kv_start = tl.load(kv_indptr + row)
    kv_len = tl.load(kv_indptr + row + 1) - kv_start
    first = _first_piece(Row_pieces, row, kv_len - 1, window, HAS_TILES, USE_WINDOW, PIECE)
    if (first + lane) * PIECE >= kv_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    heads = kvh * GROUP + offs_m % GROUP
    rows = row + offs_m * 0
    q_pos = kv_len - 1 + offs_m * 0
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)
    q = tl.load(Q + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    lo = kv_len * 0
    if USE_WINDOW:
        lo = _window_block(kv_len - 1, window, BLOCK_N)
    for piece in range(first + lane, tl.cdiv(kv_len, PIECE), lanes):
        start = piece * PIECE
        acc, l_i, m_i = _piece(
            q, K_cache, V_cache, kv_indices + kv_start, tl.maximum(lo, start),
            tl.minimum(start + PIECE, kv_len), q_pos, kvh, stride_kct, stride_kch, stride_vct, stride_vch,
            qk_scale, cap_scale, window, offs_n, offs_d, offs_dv, d_mask, dv_mask, USE_WINDOW, SOFTCAP,
            EVEN_D, BLOCK_M, BLOCK_N, BLOCK_DV, DOT_PREC)
        _store_piece(acc, l_i, m_i, Part_acc, Part_l, Part_m, rows, heads, piece, m_mask, offs_dv,
                     stride_pr, stride_ph, stride_pp, stride_lr, stride_lh)


@triton.jit(do_not_specialize=["window"])
def _merge_pieces_kernel(
    Part_acc, Part_l, Part_m, Out, Sinks, kv_indptr, window,
    stride_pr, stride_ph, stride_pp, stride_lr, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PIECE: tl.constexpr, USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # Grid (rows, KV heads): the row's pieces merged in order, then finished as the extend kernel does.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_len = tl.load(kv_indptr + row + 1) - tl.load(kv_indptr + row)
    offs_g = tl.arange(0, BLOCK_G)
    h_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DIM_V
    tok = row.to(tl.int64) + offs_g * 0
    rh = tok * stride_lr + heads * stride_lh
    a_ptrs = Part_acc + tok[:, None] * stride_pr + heads[:, None] * stride_ph + offs_dv[None, :]
    acc, l_i, m_i = _no_keys(BLOCK_G, BLOCK_DV)
    first = _first_piece(kv_indptr, row, kv_len - 1, window, False, USE_WINDOW, PIECE)
    for piece in range(first, tl.cdiv(kv_len, PIECE)):
        p_l = tl.load(Part_l + rh + piece, mask=h_mask, other=0.0)
        p_m = tl.load(Part_m + rh + piece, mask=h_mask, other=-1.0e30)
        p_acc = tl.load(a_ptrs + piece * stride_pp, mask=h_mask[:, None], other=0.0)
        acc, l_i, m_i = _merge_piece(acc, l_i, m_i, p_acc, p_l, p_m)
    _store_rows(acc, l_i, m_i, Out, Out, Out, Sinks, tok[:, None], tok, heads, h_mask, offs_dv, dv_mask,
                0, stride_ot, stride_oh, 0, 0, 0, 0, 0, True, HAS_SINKS)


def tile_shape(num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(rows a tile holds, keys a piece holds) at this attention shape: ``BLOCK_M // GROUP`` rows (below 2,
    grouping reads nothing less than rows alone) and ``PIECE``."""
    cfg = invariant_config(head_dim, device)
    return cfg["BLOCK_M"] // (num_q_heads // num_kv_heads), cfg["PIECE"]


def _lanes(programs: int, num_kv_heads: int, most: int, least: int, device: torch.device) -> int:
    """Programs each of ``programs`` rows or tiles gets a KV head: enough for two a multiprocessor, at least
    ``least``, at most ``most`` (its most pieces). A launch size: no result depends on it."""
    want = -(-2 * _sm_count(device) // max(1, programs * num_kv_heads))
    return max(1, min(most, max(least, want)))


def split_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    scaling: float,
    max_kv_len: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention (row ``i``'s one query is ``q[i]``), each row's result bit-identical to
    :func:`~.triton_invariant_attention.invariant_attention`'s for it.

    ``kv_indices``/``kv_indptr``: CSR slot lists of each row's whole context (the new token included), none
    longer than ``max_kv_len`` (read from ``kv_indptr`` when None: a sync). ``tiles``: (rows ``[tiles,
    BLOCK_M // GROUP]`` int32, each tile's rows then -1, a tile whose first row is -1 or past the batch
    doing nothing; pieces ``[tiles]`` int32, the leading pieces every row of the tile holds in the same
    slots; row pieces ``[>= B]`` int32, each row's tile's pieces, 0 for a row in none). Returns
    ``[B, Hq, Dv]``.
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    batch = q.shape[0]
    if kv_indptr.shape[0] < batch + 1:
        raise ValueError("kv_indptr must have an entry per row and one more")
    cfg = dict(config) if config is not None else invariant_config(d, q.device)
    group = hq // hkv
    if tiles is not None:
        tile_rows, tile_pieces, row_pieces = tiles
        rows_per_tile = cfg["BLOCK_M"] // group
        if not (tile_rows.dim() == 2 and tile_rows.shape[1] == rows_per_tile
                and tile_pieces.shape == tile_rows.shape[:1] and row_pieces.shape[0] >= batch):
            raise ValueError(f"tiles must be rows [tiles, {rows_per_tile}], pieces [tiles], row pieces [B+]")
    q = _last_dim_contig(q)
    out = _check_out(None, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
    if batch == 0:
        return out
    if max_kv_len is None:
        max_kv_len = int((kv_indptr[1 : batch + 1] - kv_indptr[:batch]).max())
    pieces = triton.cdiv(max(max_kv_len, 1), cfg["PIECE"])
    block_dv = triton.next_power_of_2(dv)
    part_acc = torch.empty((batch, hq, pieces, block_dv), dtype=torch.float32, device=q.device)
    part_lm = torch.empty((2, batch, hq, pieces), dtype=torch.float32, device=q.device)
    window, use_window = _window(sliding_window)
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
               v_cache.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
               part_lm.stride(1), part_lm.stride(2))
    shape = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
                 BLOCK_DV=block_dv, USE_WINDOW=use_window, SOFTCAP=use_cap, DOT_PREC=_dot_prec(q.dtype),
                 enable_fp_fusion=FP_FUSION, **cfg)
    parts = (part_acc, part_lm[0], part_lm[1])
    if tiles is not None and tile_rows.shape[0]:
        lanes = _lanes(tile_rows.shape[0], hkv, pieces, TILE_LANES, q.device)
        _tile_pieces_kernel[(tile_rows.shape[0] * lanes, hkv)](
            q, k_cache, v_cache, *parts, kv_indices, kv_indptr, tile_rows, tile_pieces,
            qk_scale, cap_scale, window, batch, lanes, *strides, ROWS=tile_rows.shape[1], **shape)
    lanes = _lanes(batch, hkv, pieces, 1, q.device)
    _row_pieces_kernel[(batch * lanes, hkv)](
        q, k_cache, v_cache, *parts, kv_indices, kv_indptr, kv_indptr if tiles is None else row_pieces,
        qk_scale, cap_scale, window, lanes, *strides, HAS_TILES=tiles is not None, **shape)
    _merge_pieces_kernel[(batch, hkv)](
        *parts, out, sinks, kv_indptr, window, *strides[6:], out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(2, triton.next_power_of_2(group)), HEAD_DIM_V=dv, BLOCK_DV=block_dv,
        PIECE=cfg["PIECE"], USE_WINDOW=use_window, HAS_SINKS=has_sinks, num_warps=4,
        enable_fp_fusion=FP_FUSION)
    return out
