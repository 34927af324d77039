"""Pieces shared by the Triton attention kernels (see :mod:`hf_radix.kernels.triton_attention`).

Device helpers (scores, K/V tile loads through the slot array, the online-softmax step, pieces and their
merge, writing rows) and host helpers (launch with a fallback config, scale/window arguments, argument
checks); merging split-KV partials is :mod:`.triton_split_merge`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from transformers.utils import logging
from triton.runtime.errors import OutOfResources

from . import FP_FUSION

logger = logging.get_logger(__name__)

_LOG2E = 1.4426950408889634

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
def _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, dv_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Loads a K and a V tile; rows outside ``n_mask`` (if MASKED) and columns outside ``d_mask`` (K) /
    ``dv_mask`` (V) read 0. EVEN_D: both head sizes are their block sizes."""
    if MASKED:
        if EVEN_D:
            k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _load_paged_kv(K_cache, V_cache, kv_idx_ptr, pos, n_mask, kvh, stride_kct, stride_kch, stride_vct,
                   stride_vch, offs_d, offs_dv, d_mask, dv_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Loads the K and V tiles of context positions ``pos`` through the slot array (the page table)."""
    if MASKED:
        slots = tl.load(kv_idx_ptr + pos, mask=n_mask, other=0).to(tl.int64)
    else:
        slots = tl.load(kv_idx_ptr + pos).to(tl.int64)
    k_ptrs = K_cache + slots[:, None] * stride_kct + kvh * stride_kch + offs_d[None, :]
    v_ptrs = V_cache + slots[:, None] * stride_vct + kvh * stride_vch + offs_dv[None, :]
    return _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, dv_mask, MASKED, EVEN_D)


@triton.jit
def _softmax_update(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr):
    """One online-softmax step; ``s`` holds log2-domain scores (-inf where masked)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, k, v, n_mask, j, pos0, q_pos, qk_scale, cap_scale, window,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """The online-softmax step of one K/V tile, keys ``j`` of a range. MASKED drops the keys outside
    ``n_mask`` and, for queries at positions ``q_pos`` (key ``j`` sits at position ``pos0 + j``), with CAUSAL
    the keys after a query and with USE_WINDOW those ``window`` or more before it; without MASKED,
    ``n_mask``, ``j``, ``pos0`` and ``q_pos`` are unused."""
    s = _scores(q, tl.trans(k), qk_scale, cap_scale, SOFTCAP, DOT_PREC)
    if MASKED:
        keep = n_mask[None, :]
        k_pos = pos0 + j
        if CAUSAL:
            keep = keep & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            keep = keep & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(keep, s, float("-inf"))
    return _softmax_update(acc, l_i, m_i, s, v, DOT_PREC)


@triton.jit
def _paged_kv_loop(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, pos0, q_pos,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online softmax over keys [lo, hi) of a range read through the slot array. MASKED applies the bound
    ``hi`` and, for queries at positions ``q_pos`` (key ``j`` of the range sits at position ``pos0 + j``),
    the causal mask with CAUSAL and the window mask with USE_WINDOW; without either, ``pos0``, ``q_pos`` and
    ``window`` are unused."""
    for start_n in range(lo, hi, BLOCK_N):
        j = start_n + offs_n
        n_mask = j < hi
        k, v = _load_paged_kv(K_cache, V_cache, kv_idx_ptr, j, n_mask, kvh, stride_kct, stride_kch,
                              stride_vct, stride_vch, offs_d, offs_dv, d_mask, dv_mask, MASKED, EVEN_D)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, n_mask, j, pos0, q_pos, qk_scale, cap_scale,
                                     window, MASKED, CAUSAL, USE_WINDOW, SOFTCAP, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _paged_kv_visible(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online softmax over keys [lo, hi) of a range that every query sees whole (no causal or window
    mask): its whole tiles unmasked, then the partial last one masked to ``hi``."""
    full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, full, 0, 0,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, 0,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, False, False, False, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    return _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, hi, 0, 0,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, 0,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, True, False, False, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)


@triton.jit
def _no_keys(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Online-softmax accumulators (acc, l, m) that have seen no key."""
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    return tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32), m_i


@triton.jit
def _piece(
    q, K_cache, V_cache, kv_idx_ptr, lo, hi, q_pos, kvh, stride_kct, stride_kch, stride_vct, stride_vch,
    qk_scale, cap_scale, window, offs_n, offs_d, offs_dv, d_mask, dv_mask,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One piece of deterministic attention: keys [lo, hi) of a context from fresh accumulators (acc, l,
    m), every block masked. The extend and the decode kernels compute a piece through this one function,
    so a row's piece is the same arithmetic in either."""
    acc, l_i, m_i = _no_keys(BLOCK_M, BLOCK_DV)
    return _paged_kv_loop(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, 0, q_pos, kvh, stride_kct, stride_kch,
        stride_vct, stride_vch, qk_scale, cap_scale, window, offs_n, offs_d, offs_dv, d_mask, dv_mask,
        True, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)


@triton.jit
def _merge_piece(acc, l_i, m_i, p_acc, p_l, p_m):
    """Running online-softmax totals with one more piece's (fresh accumulators over its keys) merged in.
    A piece that saw no key (``p_m = -1e30``, ``p_l = 0``, ``p_acc = 0``) leaves the totals as they are."""
    m_new = tl.maximum(m_i, p_m)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(p_m - m_new)
    return acc * alpha[:, None] + p_acc * beta[:, None], l_i * alpha + p_l * beta, m_new


@triton.jit
def _partial_rows(acc, l_i, m_i):
    """A split's normalized partial output rows and their log2-sum-exp (-inf where it saw no key)."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _finish_rows(acc, l_i, m_i, Sinks, heads, h_mask, HAS_SINKS: tl.constexpr):
    """Normalized output rows; with sinks (log2 units, one per query head) each row's softmax denominator
    also holds ``exp(sink)``, a key that contributes no value."""
    if HAS_SINKS:
        sink = tl.load(Sinks + heads, mask=h_mask, other=float("-inf"))
        m = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m)
        return acc * (alpha / (l_i * alpha + tl.exp2(sink - m)))[:, None]
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _store_rows(
    acc, l_i, m_i, Out, Mid_o, Mid_lse, Sinks, tok, tok_lse, heads, row_mask, offs_dv, dv_mask, split,
    stride_ot, stride_oh, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Writes a program's output rows (query heads ``heads`` of tokens ``tok``; ``tok_lse``: the same tokens
    shaped like ``heads``): with DIRECT (one split) normalized into ``Out``, else the split's partial output
    into ``Mid_o`` and its log2-sum-exp into ``Mid_lse``, for the merge kernel."""
    st_mask = row_mask[:, None] & dv_mask[None, :]
    if DIRECT:
        out = _finish_rows(acc, l_i, m_i, Sinks, heads, row_mask, HAS_SINKS)
        o_ptrs = Out + tok * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        out, lse = _partial_rows(acc, l_i, m_i)
        m_ptrs = Mid_o + tok * stride_mt + heads[:, None] * stride_mh + split * stride_ms + offs_dv[None, :]
        tl.store(m_ptrs, out, mask=st_mask)
        tl.store(Mid_lse + tok_lse * stride_lt + heads * stride_lh + split, lse, mask=row_mask)


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


_too_big: set[tuple[str, int, str]] = set()  # (kernel, head_dim, dtype) whose tuned config did not fit


def _launch(kind: str, kernel: Any, grid: Any, cfg: dict[str, int], safe: dict[str, int],
            head_dim: int, dtype: torch.dtype, args: tuple, kwargs: dict[str, Any]) -> None:
    """Launch with ``cfg``; on OutOfResources (shared memory / threads) retry once with ``safe``."""
    key = (kind, head_dim, str(dtype))
    if key not in _too_big:
        try:
            kernel[grid](*args, **kwargs, **{"enable_fp_fusion": FP_FUSION, **cfg})
            return
        except OutOfResources as exc:
            logger.warning("%s kernel config %s does not fit this device (%s); using %s", kind, cfg, exc,
                           safe)
            _too_big.add(key)
    kernel[grid](*args, **kwargs, **{"enable_fp_fusion": FP_FUSION, **safe})


def _check_common(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(query heads, KV heads, K head size, V head size); K may be wider than V (MLA)."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError("q, k_cache, v_cache must be 3-D ([tokens|slots, heads, head_dim])")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[:2] != v_cache.shape[:2] or k_cache.shape[2] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"num query heads ({hq}) must be a multiple of num kv heads ({hkv})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in head_dim")
    return hq, hkv, d, v_cache.shape[2]


def _sinks_log2(sinks: torch.Tensor | None, hq: int, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Attention-sink logits (one per query head) in log2 units as fp32, or a placeholder."""
    if sinks is None:
        return like, False
    if sinks.shape != (hq,):
        raise ValueError(f"sinks must have one logit per query head ({hq}), got {tuple(sinks.shape)}")
    return (sinks.float() * _LOG2E).contiguous(), True


def _check_out(out: torch.Tensor | None, q: torch.Tensor, dv: int) -> torch.Tensor:
    shape = (*q.shape[:2], dv)
    if out is None:
        return q.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(shape)} of q's dtype and contiguous in head_dim")
    return out
