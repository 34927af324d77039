"""Triton attention kernels over a paged KV pool.

Two entry points:

* :func:`extend_attention` -- prefill/extend: each row has ``prefix_lens[i]`` cached tokens (read from the
  pool through ``prefix_kv_indices``) followed by new tokens (read from the contiguous ``k_new``/``v_new``).
  One program computes a ``BLOCK_M`` x ``head_dim`` output tile for one query head with an online softmax.
  Few short query blocks over long prefixes (a question after a cached few-shot prefix) split each prefix
  into chunks computed in parallel, merged as in decode.
* :func:`decode_attention` -- one query token per row, split-KV (flash-decoding). Stage 1 computes a
  normalized partial output and a log2-sum-exp per (row, query-head, split); all query heads that share a KV
  head are handled by the same program, so each K/V tile is read once per KV head. A merge kernel combines
  the splits.

Pool layout: ``k_cache``/``v_cache`` are ``[num_slots, num_kv_heads, head_dim]``; a row's keys live at
arbitrary slots given in position order. All softmax math is fp32, in base 2 (``log2(e)`` is folded into
the scale). Sliding windows follow Hugging Face semantics: query position ``p`` sees key position ``k``
iff ``k <= p`` and ``p - k < window``. Soft-capping (Gemma 2) is ``softcap * tanh(scores / softcap)``,
applied after scaling and before masking.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from transformers.utils import logging
from triton.runtime.errors import OutOfResources

from . import interpreting

__all__ = ["extend_attention", "decode_attention", "pick_num_kv_splits", "kernel_configs"]

logger = logging.get_logger(__name__)

_LOG2E = 1.4426950408889634
PACK_GQA_MAX_NEW = 128  # extends of at most this many new tokens per row pack grouped query heads

# Optional launch-config overrides (tests / benchmarks): keys BLOCK_M, BLOCK_N, num_warps, num_stages.
_EXTEND_CFG_OVERRIDE: dict[str, int] | None = None
_DECODE_CFG_OVERRIDE: dict[str, int] | None = None


# --------------------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _scores(q, kt, qk_scale, cap_scale, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scores in log2 units: ``(q @ kt) * scale * log2(e)``, optionally soft-capped."""
    s = tl.dot(q, kt, input_precision=DOT_PREC)
    if SOFTCAP:
        # qk_scale = scaling / softcap, cap_scale = softcap * log2(e); tanh(x) = 1 - 2 / (exp(2x) + 1)
        x = s * qk_scale
        s = (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)) * cap_scale
    else:
        s = s * qk_scale
    return s


@triton.jit
def _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Loads a K and a V tile; rows outside ``n_mask`` (if MASKED) and columns outside ``d_mask`` read 0."""
    if MASKED:
        if EVEN_D:
            k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _load_paged_kv(K_cache, V_cache, kv_idx_ptr, pos, n_mask, kvh, stride_kct, stride_kch, stride_vct,
                   stride_vch, offs_d, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Loads the K and V tiles of context positions ``pos`` through the slot array (the page table)."""
    if MASKED:
        slots = tl.load(kv_idx_ptr + pos, mask=n_mask, other=0).to(tl.int64)
    else:
        slots = tl.load(kv_idx_ptr + pos).to(tl.int64)
    k_ptrs = K_cache + slots[:, None] * stride_kct + kvh * stride_kch + offs_d[None, :]
    v_ptrs = V_cache + slots[:, None] * stride_vct + kvh * stride_vch + offs_d[None, :]
    return _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, MASKED, EVEN_D)


@triton.jit
def _softmax_update(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr):
    """One online-softmax step; ``s`` holds log2-domain scores (-inf where masked)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


# --------------------------------------------------------------------------------------------------------
# Extend (prefill with cached prefix)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _extend_prefix_loop(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, prefix_len, q_pos,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
    offs_n, offs_d, d_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over cached prefix positions [lo, hi) (gathered through the slot array)."""
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < prefix_len
        k, v = _load_paged_kv(K_cache, V_cache, kv_idx_ptr, pos, n_mask, kvh, stride_kct, stride_kch,
                              stride_vct, stride_vch, offs_d, d_mask, MASKED, EVEN_D)
        s = _scores(q, tl.trans(k), qk_scale, cap_scale, SOFTCAP, DOT_PREC)
        if MASKED:
            keep = n_mask[None, :]
            if USE_WINDOW:
                keep = keep & ((q_pos[:, None] - pos[None, :]) < window)
            s = tl.where(keep, s, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _extend_new_loop(
    acc, l_i, m_i, q, K_new, V_new, tok0, lo, hi, new_len, q_rel,
    kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
    offs_n, offs_d, d_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over the row's new tokens [lo, hi) (relative indices, contiguous in k_new/v_new)."""
    for start_n in range(lo, hi, BLOCK_N):
        rel = start_n + offs_n
        tok = (tok0 + rel).to(tl.int64)
        k_ptrs = K_new + tok[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :]
        v_ptrs = V_new + tok[:, None] * stride_vnt + kvh * stride_vnh + offs_d[None, :]
        n_mask = rel < new_len
        k, v = _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, MASKED, EVEN_D)
        s = _scores(q, tl.trans(k), qk_scale, cap_scale, SOFTCAP, DOT_PREC)
        if MASKED:
            keep = n_mask[None, :] & (rel[None, :] <= q_rel[:, None])
            if USE_WINDOW:
                keep = keep & ((q_rel[:, None] - rel[None, :]) < window)
            s = tl.where(keep, s, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _extend_new_tokens(
    acc, l_i, m_i, q, K_new, V_new, tok0, first_tok, last_tok, new_len, q_rel,
    kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
    offs_n, offs_d, d_mask,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend (causally) over the row's new tokens, read from the contiguous k_new / v_new.

    The block's queries are the new tokens ``first_tok..last_tok``; with ``ALIGNED`` (``first_tok`` a
    multiple of BLOCK_N) the blocks strictly below the diagonal skip masking.
    """
    diag_hi = tl.minimum(last_tok + 1, new_len)
    lo = first_tok * 0
    if USE_WINDOW:
        lo = tl.maximum(first_tok - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    elif ALIGNED:
        acc, l_i, m_i = _extend_new_loop(
            acc, l_i, m_i, q, K_new, V_new, tok0, 0, first_tok, new_len, q_rel,
            kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
            offs_n, offs_d, d_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
        lo = first_tok
    acc, l_i, m_i = _extend_new_loop(
        acc, l_i, m_i, q, K_new, V_new, tok0, lo, diag_hi, new_len, q_rel,
        kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
        offs_n, offs_d, d_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, K_cache, V_cache, Out, Mid_o, Mid_lse,
    qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
    qk_scale, cap_scale, window, num_splits,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK_GQA: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Grid (heads, rows, m_blocks * num_splits). A program computes BLOCK_M query rows: BLOCK_M new tokens
    # of one query head, or with PACK_GQA (few new tokens) BLOCK_M (token, head) pairs of the query heads
    # that share one KV head, so each K/V tile is loaded once for all of them. Heads sharing K/V run back
    # to back (L2 reuse); the last (heaviest, causal) query blocks of every row are scheduled first. With
    # num_splits > 1 each program covers one chunk of the cached prefix (the last one also the new tokens)
    # and writes a partial result that the merge kernel combines.
    row = tl.program_id(1)
    split = tl.program_id(2) % num_splits
    mblk = tl.num_programs(2) // num_splits - 1 - tl.program_id(2) // num_splits
    m_start = mblk * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kvh = tl.program_id(0)
        tok = offs_m // GROUP
        heads = kvh * GROUP + offs_m % GROUP
        first_tok = m_start // GROUP
        last_tok = (m_start + BLOCK_M - 1) // GROUP
    else:
        kvh = tl.program_id(0) // GROUP
        tok = offs_m
        heads = tl.program_id(0) + offs_m * 0
        first_tok = m_start
        last_tok = m_start + BLOCK_M - 1

    tok0 = tl.load(qo_indptr + row)
    new_len = tl.load(qo_indptr + row + 1) - tok0
    if first_tok >= new_len:
        return
    prefix_len = tl.load(prefix_lens + row)
    kv_base = tl.load(prefix_kv_indptr + row)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = tok < new_len
    d_mask = offs_d < HEAD_DIM

    q_tok = (tok0 + tok).to(tl.int64)
    q_ptrs = Q + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Finite start value so fully masked rows/blocks never produce (-inf) - (-inf).
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # ---- this split's chunk of the cached prefix, gathered through the slot array ----
    kv_idx_ptr = prefix_kv_indices + kv_base
    q_pos = prefix_len + tok
    lo = prefix_len * 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + first_tok - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(prefix_len - lo, num_splits), BLOCK_N) * BLOCK_N
    lo = lo + split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    if USE_WINDOW:
        acc, l_i, m_i = _extend_prefix_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, prefix_len, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, d_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    else:
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _extend_prefix_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, full, prefix_len, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, d_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
        acc, l_i, m_i = _extend_prefix_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, hi, prefix_len, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, d_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    if split == num_splits - 1:
        acc, l_i, m_i = _extend_new_tokens(
            acc, l_i, m_i, q, K_new, V_new, tok0, first_tok, last_tok, new_len, tok,
            kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
            offs_n, offs_d, d_mask, USE_WINDOW, SOFTCAP, EVEN_D, not PACK_GQA, BLOCK_N, DOT_PREC)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    st_mask = m_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o_ptrs = Out + q_tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        m_ptrs = (Mid_o + q_tok[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_ms
                  + offs_d[None, :])
        tl.store(m_ptrs, out, mask=st_mask)
        tl.store(Mid_lse + q_tok * stride_lt + heads * stride_lh + split, lse, mask=m_mask)


# --------------------------------------------------------------------------------------------------------
# Decode (split-KV, grouped query heads)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_loop(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
    offs_n, offs_d, d_mask,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over context positions [lo, hi); every position in range is visible."""
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < hi
        k, v = _load_paged_kv(K_cache, V_cache, kv_idx_ptr, pos, n_mask, kvh, stride_kct, stride_kch,
                              stride_vct, stride_vch, offs_d, d_mask, MASKED, EVEN_D)
        s = _scores(q, tl.trans(k), qk_scale, cap_scale, SOFTCAP, DOT_PREC)
        if MASKED:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _decode_stage1_kernel(
    Q, K_cache, V_cache, kv_indices, kv_indptr, Mid_o, Mid_lse, Out,
    qk_scale, cap_scale, window, num_splits,
    stride_qb, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    row = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hb // HEAD_BLOCKS
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    kv_start = tl.load(kv_indptr + row)
    seq_len = tl.load(kv_indptr + row + 1) - kv_start
    kv_lo = seq_len * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    # Split the visible range into num_splits chunks, each a multiple of BLOCK_N long.
    span = seq_len - kv_lo
    split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    offs_h = (hb % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM

    q_ptrs = Q + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
    kv_idx_ptr = kv_indices + kv_start
    acc, l_i, m_i = _decode_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, full_hi,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
        offs_n, offs_d, d_mask, False, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    acc, l_i, m_i = _decode_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full_hi, hi,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
        offs_n, offs_d, d_mask, True, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    st_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o_ptrs = Out + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        m_ptrs = (Mid_o + row.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms
                  + offs_d[None, :])
        tl.store(m_ptrs, out, mask=st_mask)
        tl.store(Mid_lse + row.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _merge_splits_kernel(
    Mid_o, Mid_lse, Out, num_splits,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Mid_lse + row.to(tl.int64) * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o_ptrs = (Mid_o + row.to(tl.int64) * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms
              + offs_d[None, :])
    parts = tl.load(o_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=d_mask)


# --------------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # H200 default for CPU / interpreter runs


def _scales(scaling: float, softcap: float | None) -> tuple[float, float, bool]:
    if softcap is not None and softcap > 0.0:
        return float(scaling) / float(softcap), float(softcap) * _LOG2E, True
    return float(scaling) * _LOG2E, 1.0, False


def _window(sliding_window: int | None) -> tuple[int, bool]:
    if sliding_window is None or sliding_window <= 0:
        return 0, False
    return int(sliding_window), True


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    if _EXTEND_CFG_OVERRIDE is not None:
        return dict(_EXTEND_CFG_OVERRIDE)
    if device.type != "cuda" or interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if block_d <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if block_d <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


# Used when the tuned config does not fit the device (e.g. less shared memory than an H100/H200).
_EXTEND_SAFE_CFG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
_DECODE_SAFE_CFG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
_too_big: set[tuple[str, int, str]] = set()  # (kernel, head_dim, dtype) whose tuned config did not fit


def _launch(kind: str, kernel: Any, grid: Any, cfg: dict[str, int], safe: dict[str, int],
            head_dim: int, dtype: torch.dtype, args: tuple, kwargs: dict[str, Any]) -> None:
    """Launch with ``cfg``; on OutOfResources (shared memory / threads) retry once with ``safe``."""
    key = (kind, head_dim, str(dtype))
    if key not in _too_big:
        try:
            kernel[grid](*args, **kwargs, **cfg)
            return
        except OutOfResources as exc:
            logger.warning("%s kernel config %s does not fit this device (%s); using %s", kind, cfg, exc,
                           safe)
            _too_big.add(key)
    kernel[grid](*args, **kwargs, **safe)


def _decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    if _DECODE_CFG_OVERRIDE is not None:
        return dict(_DECODE_CFG_OVERRIDE)
    if device.type != "cuda" or interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if block_d <= 128:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError("q, k_cache, v_cache must be 3-D ([tokens|slots, heads, head_dim])")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[1:] != v_cache.shape[1:] or k_cache.shape[2] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"num query heads ({hq}) must be a multiple of num kv heads ({hkv})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in head_dim")
    return hq, hkv, d


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_new_len: int | None = None,
    max_prefix_len: int | None = None,
    num_splits: int | None = None,
    pack_gqa: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over (cached prefix ++ new tokens) per row.

    q ``[T, Hq, D]``; k_new/v_new ``[T, Hkv, D]``; qo_indptr ``[B+1]``; prefix_lens ``[B]``;
    prefix_kv_indices/prefix_kv_indptr: CSR slot lists of each row's cached prefix. Returns ``[T, Hq, D]``.
    Pass ``max_new_len`` (max over rows of new tokens) to avoid a device->host sync. A bound on the
    prefix length (``max_prefix_len``) lets few, short query blocks over long prefixes split each prefix
    into ``num_splits`` chunks run in parallel (default: enough to fill the GPU; without a bound, one).
    ``pack_gqa`` computes the query heads sharing a KV head together (default: for at most
    ``PACK_GQA_MAX_NEW`` new tokens per row, when heads are grouped).
    """
    hq, hkv, d = _check_common(q, k_cache, v_cache)
    t = q.shape[0]
    if k_new.shape != (t, hkv, d) or v_new.shape != (t, hkv, d):
        raise ValueError(
            f"k_new/v_new must be [{t}, {hkv}, {d}], got {tuple(k_new.shape)}, {tuple(v_new.shape)}"
        )
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise ValueError("k_new / v_new must have q's dtype")
    batch = prefix_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1 or prefix_kv_indptr.shape[0] != batch + 1:
        raise ValueError("qo_indptr and prefix_kv_indptr must have B+1 entries (B = len(prefix_lens))")
    q, k_new, v_new = _last_dim_contig(q), _last_dim_contig(k_new), _last_dim_contig(v_new)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype and be contiguous in head_dim")
    if t == 0 or batch == 0:
        return out
    if max_new_len is None:
        max_new_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())
    if max_new_len <= 0:
        return out

    cfg = _extend_config(d, q.dtype, q.device)
    if cfg["BLOCK_M"] % cfg["BLOCK_N"] != 0:
        raise ValueError("BLOCK_M must be a multiple of BLOCK_N")
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    window, use_window = _window(sliding_window)
    group = hq // hkv
    pack = pack_gqa if pack_gqa is not None else group > 1 and max_new_len <= PACK_GQA_MAX_NEW
    heads = hkv if pack else hq
    m_blocks = triton.cdiv(max_new_len * (group if pack else 1), cfg["BLOCK_M"])
    if num_splits is None:
        num_splits = 1
        if max_prefix_len is not None:
            span = min(max_prefix_len, window + max_new_len) if use_window else max_prefix_len
            # One wave: an extend's partial results (a tile per split) cost more than decode's.
            num_splits = pick_num_kv_splits(batch * m_blocks, heads, span, _sm_count(q.device),
                                            min_split_tokens=512, waves=1)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    if direct:
        mid_o, mid_lse, mstrides = out, out, (0, 0, 0, 0, 0)  # unused placeholders
    else:
        mid_o = torch.empty((t, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (heads, batch, triton.cdiv(max_new_len * (group if pack else 1), meta["BLOCK_M"]) * num_splits)

    args = (
        q, k_new, v_new, k_cache, v_cache, out, mid_o, mid_lse,
        qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
        qk_scale, cap_scale, window, num_splits,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), *mstrides,
    )
    kwargs = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PACK_GQA=pack,
                  USE_WINDOW=use_window, SOFTCAP=use_cap, DIRECT=direct, DOT_PREC=_dot_prec(q.dtype))
    _launch("extend", _extend_kernel, grid, cfg, _EXTEND_SAFE_CFG, d, q.dtype, args, kwargs)
    if not direct:
        _merge_splits(mid_o, mid_lse, out, num_splits)
    return out


def pick_num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int = 132,
                       min_split_tokens: int = 256, max_splits: int = 64, waves: int = 2) -> int:
    """Number of KV splits so that ``batch * kv_heads * splits`` programs fill about ``waves`` waves of
    SMs, keeping each split at least ``min_split_tokens`` long."""
    progs = max(1, batch * num_kv_heads)
    want = triton.cdiv(waves * num_sms, progs)
    by_len = max(1, triton.cdiv(max(max_kv_len, 1), min_split_tokens))
    return int(max(1, min(want, by_len, max_splits)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_kv_splits: int | None = None,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-token decode attention over each row's full context (which includes the new token).

    q ``[B, Hq, D]``; kv_indices/kv_indptr: CSR slot lists of each row's context. Returns ``[B, Hq, D]``.
    ``num_kv_splits`` defaults to :func:`pick_num_kv_splits`; pass it (or ``max_kv_len``) to avoid a
    device->host sync.
    """
    hq, hkv, d = _check_common(q, k_cache, v_cache)
    batch = q.shape[0]
    if kv_indptr.shape[0] != batch + 1:
        raise ValueError("kv_indptr must have B+1 entries")
    q = _last_dim_contig(q)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype and be contiguous in head_dim")
    if batch == 0:
        return out

    group = hq // hkv
    block_h = max(16, triton.next_power_of_2(min(group, 64)))
    head_blocks = triton.cdiv(group, block_h)
    window, use_window = _window(sliding_window)
    if num_kv_splits is None:
        if max_kv_len is None:
            max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max().item())
        eff_len = min(max_kv_len, window) if use_window else max_kv_len
        num_kv_splits = pick_num_kv_splits(batch, hkv * head_blocks, eff_len, _sm_count(q.device))
    num_kv_splits = max(1, int(num_kv_splits))

    cfg = _decode_config(d, q.dtype, q.device)
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    block_d = triton.next_power_of_2(d)
    direct = num_kv_splits == 1
    if direct:
        mid_o = out  # unused placeholders
        mid_lse = out
        mstrides = (0, 0, 0, 0, 0)
    else:
        mid_o = torch.empty((batch, hq, num_kv_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, hq, num_kv_splits), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    grid = (batch, hkv * head_blocks, num_kv_splits)
    args = (
        q, k_cache, v_cache, kv_indices, kv_indptr, mid_o, mid_lse, out,
        qk_scale, cap_scale, window, num_kv_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *mstrides, out.stride(0), out.stride(1),
    )
    kwargs = dict(GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h,
                  USE_WINDOW=use_window, SOFTCAP=use_cap, DIRECT=direct, DOT_PREC=_dot_prec(q.dtype))
    _launch("decode", _decode_stage1_kernel, grid, cfg, _DECODE_SAFE_CFG, d, q.dtype, args, kwargs)
    if not direct:
        _merge_splits(mid_o, mid_lse, out, num_kv_splits)
    return out


def _merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Combines per-split partial outputs ``[N, Hq, S, D]`` (and their log2-sum-exps) into ``out``."""
    n, hq, _, d = mid_o.shape
    block_d = triton.next_power_of_2(d)
    _merge_splits_kernel[(n, hq)](
        mid_o, mid_lse, out, num_splits, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4 if block_d >= 128 else 2,
    )


def kernel_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Launch configs that would be used (for logging / benchmarks)."""
    return {
        "extend": _extend_config(head_dim, dtype, device),
        "decode": _decode_config(head_dim, dtype, device),
    }
