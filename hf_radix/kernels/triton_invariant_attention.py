"""Batch-invariant paged attention of extend and mixed batches (deterministic mode).

Every query (token, head) is computed by the same program shape over its context read from the pool, cut
into pieces at fixed absolute positions (``[0, PIECE)``, ``[PIECE, 2 PIECE)``, ...): each piece an
online-softmax pass from fresh accumulators over key blocks aligned to absolute positions, every block
masked the same way, the pieces merged in order by ``_merge_piece``. Decode batches compute the same pieces
in programs of their own and merge them with the same helper (:mod:`.triton_split_decode`). A query's
result therefore depends on its own query vector and its context's K/V alone: not on the other rows of the
batch, on how many of its context's tokens were cached or computed in this step, on the chunk it is in, nor
on whether the step decodes. Blocks (and pieces) that a tile visits but a query does not see are exact
no-ops for it (``p = 0``, ``alpha = 1``).

One program computes ``BLOCK_M`` (token, head) pairs of the query heads that share one KV head, as the
extend kernel does, walking its pieces in turn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION, interpreting
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
    _store_rows,
    _window,
)
from .triton_extend import _tile_row

__all__ = ["PIECE", "invariant_attention", "invariant_config"]

# Keys a piece holds on the GPU: a multiple of both BLOCK_Ns; a lone 32K-token row splits into 32 programs a
# KV head; fp32 partials of 16 bytes a context token a row (Dv 128, GQA 4) where decode stores them.
PIECE = 1024


@triton.jit(do_not_specialize=["window", "num_rows"])
def _invariant_kernel(
    Q, K_cache, V_cache, Out, Sinks, qo_indptr, kv_indices, kv_indptr,
    qk_scale, cap_scale, window, num_rows,
    stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PIECE: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Grid (tiles, KV heads): tile -> (row, block of the row's (token, head) pairs), see `_tile_row`.
    kvh = tl.program_id(1)
    row, mblk = _tile_row(qo_indptr, num_rows, tl.program_id(0), GROUP, BLOCK_M, 256)
    tok0 = tl.load(qo_indptr + row)
    new_len = tl.load(qo_indptr + row + 1) - tok0
    m_start = mblk * BLOCK_M
    if m_start >= new_len * GROUP:
        return
    kv_start = tl.load(kv_indptr + row)
    prefix_len = tl.load(kv_indptr + row + 1) - kv_start - new_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    m_mask = tok < new_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

    q_tok = (tok0 + tok).to(tl.int64)
    q = tl.load(Q + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    acc, l_i, m_i = _no_keys(BLOCK_M, BLOCK_DV)

    q_pos = prefix_len + tok
    hi = prefix_len + tl.minimum((m_start + BLOCK_M - 1) // GROUP + 1, new_len)
    lo = hi * 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + m_start // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
    # the context in pieces at multiples of PIECE, each from fresh accumulators, merged in order (as decode)
    for start in range(lo // PIECE * PIECE, hi, PIECE):
        p_acc, p_l, p_m = _piece(
            q, K_cache, V_cache, kv_indices + kv_start, tl.maximum(lo, start), tl.minimum(start + PIECE, hi),
            q_pos, kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_M, BLOCK_N, BLOCK_DV,
            DOT_PREC)
        acc, l_i, m_i = _merge_piece(acc, l_i, m_i, p_acc, p_l, p_m)
    _store_rows(acc, l_i, m_i, Out, Out, Out, Sinks, q_tok[:, None], q_tok, heads, m_mask, offs_dv, dv_mask,
                0, stride_ot, stride_oh, 0, 0, 0, 0, 0, True, HAS_SINKS)


def invariant_config(head_dim: int, device: torch.device) -> dict[str, int]:
    """The one launch config of a head size on a device (every call of the mode uses it); ``PIECE``, the
    keys a piece of a context holds, is a multiple of ``BLOCK_N``."""
    if device.type != "cuda" or interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "PIECE": 32, "num_warps": 4, "num_stages": 1}
    if triton.next_power_of_2(head_dim) <= 128:
        # three stages: the same arithmetic as two, 1.4x faster on gsp's shapes (invariant_attention_bench)
        return {"BLOCK_M": 64, "BLOCK_N": 64, "PIECE": PIECE, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "PIECE": PIECE, "num_warps": 4, "num_stages": 2}


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal attention of each row's new tokens over its whole context, batch-invariant.

    q ``[T, Hq, D]`` (rows' new tokens concatenated, ``qo_indptr`` ``[B+1]``); k_cache ``[slots, Hkv, D]``,
    v_cache ``[slots, Hkv, Dv]`` already hold the new tokens' K/V; ``kv_indices``/``kv_indptr``: CSR slot
    lists of each row's whole context (cached prefix + new tokens). Returns ``[T, Hq, Dv]``.
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    batch = qo_indptr.shape[0] - 1
    if kv_indptr.shape[0] != batch + 1:
        raise ValueError("kv_indptr and qo_indptr must have B+1 entries")
    q = _last_dim_contig(q)
    out = _check_out(None, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
    if batch == 0 or q.shape[0] == 0:
        return out
    group = hq // hkv
    cfg = dict(config) if config is not None else invariant_config(d, q.device)
    window, use_window = _window(sliding_window)
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    tiles = q.shape[0] * group // cfg["BLOCK_M"] + batch
    _invariant_kernel[(tiles, hkv)](
        q, k_cache, v_cache, out, sinks, qo_indptr, kv_indices, kv_indptr,
        qk_scale, cap_scale, window, batch,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
        BLOCK_DV=triton.next_power_of_2(dv), USE_WINDOW=use_window, SOFTCAP=use_cap, HAS_SINKS=has_sinks,
        DOT_PREC=_dot_prec(q.dtype), enable_fp_fusion=FP_FUSION, **cfg,
    )
    return out
