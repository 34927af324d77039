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
  sink) into its own result and writes the final output; with several, every part goes to the merge kernel.

A tile row of the table is ``(kv_start, kv_pos0, kv_len, q_start, q_len)``: keys ``j < kv_len`` live at
slots ``slots[kv_start + j]`` and have absolute positions ``kv_pos0 + j``; the queries are the token
indices ``queries[q_start : q_start + q_len]`` (rows of ``q``), at absolute positions ``query_pos[token]``.
Masks are by absolute position (causal, and Hugging Face sliding windows: ``p`` sees ``k`` iff ``k <= p``
and ``p - k < window``), so a window shorter than the prefix reads only the window. Tables are padded with
``q_len == 0`` rows (no work), so a batch of any shape up to the buffers' capacity runs in one static grid
inside a CUDA graph; every size the launch needs is a python int known to the caller (no host sync).

Attention sinks (gpt-oss ``s_aux``: one logit per query head added to the softmax denominator only) are
added exactly once, where the parts are combined. All softmax math is fp32 in base 2, as in
:mod:`hf_radix.kernels.triton_attention`, whose device helpers (``triton_attention_common``) these
kernels share.
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
    _dot_prec,
    _last_dim_contig,
    _launch,
    _load_paged_kv,
    _scales,
    _scores,
    _softmax_update,
    _window,
)

__all__ = ["shared_prefix_attention", "tile_config"]

LOG2E = tl.constexpr(1.4426950408889634)  # sinks are natural-log logits; the kernels work in base 2
_SAFE_CFG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# Optional launch-config overrides (tests / benchmarks) by BLOCK_M: keys BLOCK_N, num_warps, num_stages.
_CFG_OVERRIDE: dict[int, dict[str, int]] = {}


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_loop(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, pos0, q_pos,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
    offs_n, offs_d, d_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over keys [lo, hi) of the tile's range; MASKED applies the bound, causal and window masks."""
    for start_n in range(lo, hi, BLOCK_N):
        j = start_n + offs_n
        n_mask = j < hi
        k, v = _load_paged_kv(K_cache, V_cache, kv_idx_ptr, j, n_mask, kvh, stride_kct, stride_kch,
                              stride_vct, stride_vch, offs_d, d_mask, MASKED, EVEN_D)
        s = _scores(q, tl.trans(k), qk_scale, cap_scale, SOFTCAP, DOT_PREC)
        if MASKED:
            k_pos = pos0 + j
            keep = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                keep = keep & ((q_pos[:, None] - k_pos[None, :]) < window)
            s = tl.where(keep, s, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fold_part(acc, l_i, m_i, o_part, lse_part):
    """Adds a normalized partial result (``o_part``, log2-sum-exp ``lse_part``; -inf: empty) to the state."""
    m_new = tl.maximum(m_i, lse_part)
    alpha = tl.exp2(m_i - m_new)
    w = tl.exp2(lse_part - m_new)
    return acc * alpha[:, None] + o_part * w[:, None], l_i * alpha + w, m_new


@triton.jit
def _shared_prefix_tile_kernel(
    Q, K_cache, V_cache, Slots, Tiles, Queries, QPos, QShared, Sinks, Out, Mid_o, Mid_lse,
    qk_scale, cap_scale, window, part0, num_prev,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, FINAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Grid (tiles, kv_heads, splits). M rows are (query, head) pairs: query m // GROUP of the tile, query
    # head kvh * GROUP + m % GROUP, so each K/V tile is loaded once for all of them. Tiles of one group are
    # consecutive in the table and in launch order, so a group's further tiles find its prefix in L2.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    meta = Tiles + tile * 5
    q_len = tl.load(meta + 4)
    if q_len == 0:
        return
    kv_start = tl.load(meta).to(tl.int64)
    pos0 = tl.load(meta + 1)
    kv_len = tl.load(meta + 2)
    q_start = tl.load(meta + 3)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP
    m_mask = (qi < q_len) & (qi < TILE_Q)
    heads = kvh * GROUP + offs_m % GROUP
    tok = tl.load(Queries + q_start + qi, mask=m_mask, other=0).to(tl.int64)
    q_pos = tl.load(QPos + tok, mask=m_mask, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM

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
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: no (-inf) - (-inf)
    kv_idx_ptr = Slots + kv_start
    acc, l_i, m_i = _tile_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, c_lo, full, pos0, q_pos,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
        offs_n, offs_d, d_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    acc, l_i, m_i = _tile_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, c_hi, pos0, q_pos,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
        offs_n, offs_d, d_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    st_mask = m_mask[:, None] & d_mask[None, :]
    mid_lse = Mid_lse + tok * stride_lt + heads * stride_lh
    mid_o = Mid_o + tok[:, None] * stride_mt + heads[:, None] * stride_mh + offs_d[None, :]
    if FINAL:
        # Fold in the query's earlier parts (its shared prefix, if it has one), then the sink.
        prev = m_mask & (tl.load(QShared + tok, mask=m_mask, other=0) != 0)
        for part in range(0, num_prev):
            lse_p = tl.load(mid_lse + part, mask=prev, other=float("-inf"))
            o_p = tl.load(mid_o + part * stride_ms, mask=prev[:, None] & d_mask[None, :], other=0.0)
            acc, l_i, m_i = _fold_part(acc, l_i, m_i, o_p, lse_p)
        if HAS_SINKS:
            sink = tl.load(Sinks + heads, mask=m_mask, other=float("-inf")).to(tl.float32) * LOG2E
            acc, l_i, m_i = _fold_part(acc, l_i, m_i, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), sink)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        part = part0 + split
        tl.store(mid_o + part * stride_ms, out, mask=st_mask)
        tl.store(mid_lse + part, lse, mask=m_mask)


@triton.jit
def _shared_prefix_merge_kernel(
    Mid_o, Mid_lse, QShared, Sinks, Out, num_prefix_parts, num_parts,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # One program per (query token, query head): parts [0, num_prefix_parts) count only for tokens that
    # have a shared prefix; the sink is one more term of the denominator.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first = tl.where(tl.load(QShared + tok) != 0, 0, num_prefix_parts)
    s_mask = (offs_s >= first) & (offs_s < num_parts)
    lse = tl.load(Mid_lse + tok * stride_lt + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    o_ptrs = Mid_o + tok * stride_mt + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :]
    parts = tl.load(o_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


# --------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------


def _block_m(tile_q: int, group: int) -> int:
    return max(16, triton.next_power_of_2(tile_q * group))


def tile_config(block_m: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Launch config of the tile kernel for ``block_m`` (query, head) rows per program.

    Decode suffix tiles (one row's query heads, ``block_m`` 16) are bandwidth-bound like the per-row decode
    kernel and use its sm_90 config (BLOCK_N 64, 4 warps, 3 stages: 98% of HBM bandwidth in its sweep).
    Wide tiles (a group's queries, 128 rows) are tensor-core tiles like the extend kernel's BLOCK_M 128
    tiles: BLOCK_N 64 with 8 warps (a 128x128 fp32 accumulator is 64 registers a thread) and 3 stages
    (Q 32 KB + 3 x 32 KB of K/V in shared memory at head_dim 128 in bf16; 2 stages at head_dim 256).
    """
    if block_m in _CFG_OVERRIDE:
        return dict(_CFG_OVERRIDE[block_m])
    if device.type != "cuda" or interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_d = triton.next_power_of_2(head_dim)
    warps = 8 if block_m >= 128 else 4
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": warps, "num_stages": 2}
    if block_d <= 128:
        return {"BLOCK_N": 64, "num_warps": warps, "num_stages": 3}
    return {"BLOCK_N": 32 if block_m >= 128 else 64, "num_warps": warps, "num_stages": 2}


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

    ``slots`` is the flat slot array the tiles index (e.g. a batch's ``kv_indices``, or the flattened
    request-to-slot table); the K/V of the new tokens must already be in the pool. ``tiles`` is the
    batch's :class:`~hf_radix.prefix_groups.SharedPrefixBuffers`. ``sinks`` ``[Hq]`` are per-head logits
    (natural log units) counted once in each softmax denominator. Split counts are python ints chosen by
    the caller (:func:`~hf_radix.kernels.triton_attention.pick_num_kv_splits` over tiles and longest range).
    Returns ``[T, Hq, D]`` in ``q``'s dtype; tokens outside every suffix tile are left unwritten.
    """
    hq, hkv, d = _check_common(q, k_cache, v_cache)
    num_tokens = q.shape[0]
    _check_tiles(tiles, num_tokens)
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != hq):
        raise ValueError(f"sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")
    if num_prefix_splits < 1 or num_suffix_splits < 1:
        raise ValueError("split counts must be >= 1")
    q = _last_dim_contig(q)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype and be contiguous in head_dim")
    if num_tokens == 0 or tiles.suffix_tiles.shape[0] == 0:
        return out

    group = hq // hkv
    has_prefix = tiles.prefix_tiles.shape[0] > 0
    prefix_parts = num_prefix_splits if has_prefix else 0
    final = num_suffix_splits == 1
    num_parts = prefix_parts + (0 if final else num_suffix_splits)
    if num_parts:
        mid_o = torch.empty((num_tokens, hq, num_parts, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_tokens, hq, num_parts), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    else:
        mid_o, mid_lse, mstrides = out, out, (0, 0, 0, 0, 0)  # unused placeholders
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    window, use_window = _window(sliding_window)
    sink_arg = sinks if sinks is not None else out

    def launch(table: torch.Tensor, queries: torch.Tensor, tile_q: int, splits: int, part0: int,
               is_final: bool) -> None:
        block_m = _block_m(tile_q, group)
        args = (
            q, k_cache, v_cache, slots, table, queries, tiles.query_pos, tiles.query_shared, sink_arg, out,
            mid_o, mid_lse, qk_scale, cap_scale, window, part0, prefix_parts,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), out.stride(0), out.stride(1), *mstrides,
        )
        kwargs: dict[str, Any] = dict(
            GROUP=group, TILE_Q=tile_q, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_M=block_m,
            USE_WINDOW=use_window, SOFTCAP=use_cap, HAS_SINKS=sinks is not None, FINAL=is_final,
            DOT_PREC=_dot_prec(q.dtype),
        )
        cfg = tile_config(block_m, d, q.dtype, q.device)
        _launch(f"shared_prefix_m{block_m}", _shared_prefix_tile_kernel, (table.shape[0], hkv, splits), cfg,
                _SAFE_CFG, d, q.dtype, args, kwargs)

    if has_prefix:
        launch(tiles.prefix_tiles, tiles.prefix_queries, tiles.prefix_tile_q, num_prefix_splits, 0, False)
    launch(tiles.suffix_tiles, tiles.suffix_queries, tiles.suffix_tile_q, num_suffix_splits, prefix_parts,
           final)
    if not final:
        block_d = triton.next_power_of_2(d)
        _shared_prefix_merge_kernel[(num_tokens, hq)](
            mid_o, mid_lse, tiles.query_shared, sink_arg, out, prefix_parts, num_parts, *mstrides,
            out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_parts), HAS_SINKS=sinks is not None,
            num_warps=4 if block_d >= 128 else 2,
        )
    return out

