"""The Triton kernels of shared-prefix (cascade) attention: one tile program (a prefix or a suffix tile of
the tables, one KV head, one split), launched per tile kind or both kinds in one grid.

The tables, launch orders and masks are described in :mod:`hf_radix.kernels.triton_shared_prefix`, which
launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_attention_common import _finish_rows, _paged_kv_loop, _partial_rows

# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_program(
    tile, kvh, split, num_splits,
    Q, K_cache, V_cache, Slots, Tiles, Queries, QPos, QShared, PrefixSplits, Sinks, Out, Mid_o, Mid_lse,
    qk_scale, cap_scale, window, part0, num_prev,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FINAL: tl.constexpr,
    IS_PREFIX: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # One program: split `split` of `num_splits` of tile `tile` of the table, KV head `kvh`. M rows are
    # (query, head) pairs: query m // GROUP of the tile, query head kvh * GROUP + m % GROUP, so each K/V
    # tile is loaded once for all of them. A prefix program (IS_PREFIX; part0 == num_prev == 0) splits each
    # prefix into the tables' split count (read on the device, at most the grid's: one captured graph
    # serves every count); programs past the count do nothing. Parts [0, num_prev) of each query are the
    # prefix programs' slots, the first `prefix_parts` of them their results (valid where QShared != 0):
    # FINAL folds those in and writes the output; otherwise split 0 of a suffix tile marks the others
    # empty (log-sum-exp -inf: the merge kernel skips their values), so the merge kernel takes every part.
    prefix_parts = tl.minimum(tl.load(PrefixSplits), num_prev)
    if IS_PREFIX:
        num_splits = tl.minimum(tl.load(PrefixSplits), num_splits)
    meta = Tiles + tile * 5
    q_len = tl.load(meta + 4)
    if (q_len > 0) & (split < num_splits):
        kv_start = tl.load(meta).to(tl.int64)
        pos0 = tl.load(meta + 1)
        kv_len = tl.load(meta + 2)
        q_start = tl.load(meta + 3)
        EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)
        # One query a tile (decode): the range's end bounds its keys, no causal mask needed.
        CAUSAL: tl.constexpr = TILE_Q > 1

        offs_m = tl.arange(0, BLOCK_M)
        qi = offs_m // GROUP
        m_mask = (qi < q_len) & (qi < TILE_Q)
        heads = kvh * GROUP + offs_m % GROUP
        if CAUSAL:
            if IS_PREFIX:
                tok = tl.load(Queries + q_start + qi, mask=m_mask, other=0).to(tl.int64)
            else:  # a suffix tile's queries are consecutive tokens
                tok = (q_start + qi).to(tl.int64)
            q_pos = tl.load(QPos + tok, mask=m_mask, other=0)
            shared = tl.load(QShared + tok, mask=m_mask, other=0)
            row = tok[:, None]  # the M rows' token, to index 2-D tiles by
            rows_pos = q_pos
        else:  # the M rows' token and position are scalars, as in the per-row decode kernel
            tok = tl.load(Queries + q_start).to(tl.int64) if IS_PREFIX else q_start.to(tl.int64)
            q_pos = tl.load(QPos + tok)
            shared = tl.zeros([BLOCK_M], dtype=tl.int32) + tl.load(QShared + tok)
            row = tok
            rows_pos = tl.where(m_mask, q_pos, 0)  # for the window mask
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_n = tl.arange(0, BLOCK_N)
        d_mask = offs_d < HEAD_DIM
        dv_mask = offs_dv < HEAD_DIM_V

        # Keys any query of the tile sees: [lo, hi); keys every query sees (no mask needed): [lo, safe_hi).
        # Queries at or past the range's end (all of a prefix tile's) see up to its end, and a window's
        # start within it from the end's position: so a prefix tile's range, and its split into chunks, do
        # not depend on which rows share it.
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

        q_ptrs = Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: no (-inf) - (-inf)
        if FINAL:  # the prefix parts first: fewer registers live than after the loops
            mid_lse = Mid_lse + tok * stride_lt + heads * stride_lh
            mid_o = Mid_o + row * stride_mt + heads[:, None] * stride_mh + offs_dv[None, :]
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
        kv_idx_ptr = Slots + kv_start
        acc, l_i, m_i = _paged_kv_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, c_lo, full, pos0, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, False, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N,
            DOT_PREC)
        acc, l_i, m_i = _paged_kv_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, c_hi, pos0, rows_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, True, CAUSAL, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N,
            DOT_PREC)

        st_mask = m_mask[:, None] & dv_mask[None, :]
        if FINAL:
            out = _finish_rows(acc, l_i, m_i, Sinks, heads, m_mask, HAS_SINKS)
            o_ptrs = Out + row * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
        else:
            mid_lse = Mid_lse + tok * stride_lt + heads * stride_lh
            mid_o = Mid_o + row * stride_mt + heads[:, None] * stride_mh + offs_dv[None, :]
            out, lse = _partial_rows(acc, l_i, m_i)
            tl.store(mid_o + (part0 + split) * stride_ms, out, mask=st_mask)
            tl.store(mid_lse + part0 + split, lse, mask=m_mask)
            if split == 0:
                alone = m_mask & (shared == 0)
                for part in range(0, num_prev):
                    empty = alone | (m_mask & ((shared * 0 + part) >= prefix_parts))
                    tl.store(mid_lse + part, tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf"),
                             mask=empty)


# split counts, part offsets, tile counts and the partial-result strides vary with the batch: not
# specialized on (no recompiles)
_VARYING = ["window", "part0", "num_prev", "stride_lt", "stride_lh"]


@triton.jit(do_not_specialize=_VARYING)
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
    # Grid (tiles, kv_heads, splits). Tiles of one group are consecutive in the table and in launch order,
    # so a group's further tiles find its prefix in L2.
    _tile_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2),
        Q, K_cache, V_cache, Slots, Tiles, Queries, QPos, QShared, PrefixSplits, Sinks, Out, Mid_o, Mid_lse,
        qk_scale, cap_scale, window, part0, num_prev,
        stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
        stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
        GROUP, TILE_Q, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, USE_WINDOW, SOFTCAP,
        HAS_SINKS, FINAL, IS_PREFIX, DOT_PREC)


@triton.jit(do_not_specialize=[*_VARYING, "num_prefix_tiles", "num_suffix_tiles", "prefix_splits",
                               "suffix_splits"])
def _shared_prefix_fused_kernel(
    Q, K_cache, V_cache, Slots, PrefixTiles, PrefixQueries, SuffixTiles, QPos, QShared,
    PrefixSplits, Sinks, Out, Mid_o, Mid_lse,
    qk_scale, cap_scale, window, part0, num_prev, num_prefix_tiles, num_suffix_tiles, prefix_splits,
    suffix_splits,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PREFIX_TILE_Q: tl.constexpr,
    SUFFIX_TILE_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, PREFIX_BLOCK_M: tl.constexpr, SUFFIX_BLOCK_M: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr, SUFFIX_BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # One 1-D grid: the prefix launch's programs (in its (tiles, kv_heads, splits) order) first, then the
    # suffix launch's (writing partial results, part0 == num_prev), so both run at once, the long prefix
    # programs dispatched first; the merge kernel combines the parts afterwards.
    pid = tl.program_id(0)
    prefix_programs = num_prefix_tiles * NUM_KV_HEADS * prefix_splits
    if pid < prefix_programs:
        rest = pid // num_prefix_tiles
        _tile_program(
            pid % num_prefix_tiles, rest % NUM_KV_HEADS, rest // NUM_KV_HEADS, prefix_splits,
            Q, K_cache, V_cache, Slots, PrefixTiles, PrefixQueries, QPos, QShared, PrefixSplits, Sinks, Out,
            Mid_o, Mid_lse, qk_scale, cap_scale, window, 0, 0,
            stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
            stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
            GROUP, PREFIX_TILE_Q, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, PREFIX_BLOCK_M, PREFIX_BLOCK_N,
            USE_WINDOW, SOFTCAP, HAS_SINKS, False, True, DOT_PREC)
    else:
        pid -= prefix_programs
        rest = pid // num_suffix_tiles
        _tile_program(
            pid % num_suffix_tiles, rest % NUM_KV_HEADS, rest // NUM_KV_HEADS, suffix_splits,
            Q, K_cache, V_cache, Slots, SuffixTiles, PrefixQueries, QPos, QShared, PrefixSplits, Sinks, Out,
            Mid_o, Mid_lse, qk_scale, cap_scale, window, part0, num_prev,
            stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
            stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
            GROUP, SUFFIX_TILE_Q, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, SUFFIX_BLOCK_M, SUFFIX_BLOCK_N,
            USE_WINDOW, SOFTCAP, HAS_SINKS, False, False, DOT_PREC)
