"""Triton decode attention over a paged KV pool: one query token per row, split-KV (flash-decoding).

Stage 1 computes a normalized partial output and a log2-sum-exp per (row, query-head, split); all query
heads that share a KV head are handled by the same program, so each K/V tile is read once per KV head. The
merge kernel (shared with extend) combines the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .triton_attention_common import (
    _check_common,
    _check_out,
    _dot_prec,
    _last_dim_contig,
    _launch,
    _paged_kv_visible,
    _scales,
    _sinks_log2,
    _sm_count,
    _store_rows,
    _window,
)
from .triton_split_merge import _merge_splits, _split_buffers, pick_num_kv_splits

__all__ = ["decode_attention"]

_DECODE_SAFE_CFG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# --------------------------------------------------------------------------------------------------------
# Decode (split-KV, grouped query heads)
# --------------------------------------------------------------------------------------------------------


# values that vary with the batch or the layer are not specialized on: no recompiles
@triton.jit(do_not_specialize=["window", "num_splits", "stride_lb", "stride_lh"])
def _decode_stage1_kernel(
    Q, K_cache, V_cache, kv_indices, kv_indptr, Mid_o, Mid_lse, Out, Sinks,
    qk_scale, cap_scale, window, num_splits,
    stride_qb, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    row = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    kvh = hb // HEAD_BLOCKS
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

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

    offs_h = (hb % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V

    q_ptrs = Q + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
    kv_idx_ptr = kv_indices + kv_start
    # every position of [kv_lo, seq_len) is visible to the row's one query: no causal or window mask
    acc, l_i, m_i = _paged_kv_visible(
        acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi,
        kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    row64 = row.to(tl.int64)
    _store_rows(acc, l_i, m_i, Out, Mid_o, Mid_lse, Sinks, row64, row64, heads, h_mask, offs_dv, dv_mask,
                split, stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                DIRECT, HAS_SINKS)


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    if device.type != "cuda" or interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if block_d <= 128:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


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
    sinks: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Single-token decode attention over each row's full context (which includes the new token).

    q ``[B, Hq, D]``; k_cache ``[slots, Hkv, D]``; v_cache ``[slots, Hkv, Dv]``; kv_indices/kv_indptr: CSR
    slot lists of each row's context. Returns ``[B, Hq, Dv]``. ``sinks`` ``[Hq]``: attention-sink logits.
    ``num_kv_splits`` defaults to :func:`pick_num_kv_splits`; pass it (or ``max_kv_len``) to avoid a
    device->host sync. ``config`` (keys BLOCK_N, num_warps, num_stages) replaces the tuned launch config.
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    batch = q.shape[0]
    if kv_indptr.shape[0] != batch + 1:
        raise ValueError("kv_indptr must have B+1 entries")
    q = _last_dim_contig(q)
    out = _check_out(out, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
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

    cfg = dict(config) if config is not None else decode_config(d, q.dtype, q.device)
    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    block_d = triton.next_power_of_2(d)
    direct = num_kv_splits == 1
    mid_o, mid_lse, mstrides = _split_buffers(out, num_kv_splits)
    grid = (batch, hkv * head_blocks, num_kv_splits)
    args = (
        q, k_cache, v_cache, kv_indices, kv_indptr, mid_o, mid_lse, out, sinks,
        qk_scale, cap_scale, window, num_kv_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *mstrides, out.stride(0), out.stride(1),
    )
    kwargs = dict(GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=d, BLOCK_D=block_d, HEAD_DIM_V=dv,
                  BLOCK_DV=triton.next_power_of_2(dv), BLOCK_H=block_h, USE_WINDOW=use_window,
                  SOFTCAP=use_cap, DIRECT=direct, HAS_SINKS=has_sinks, DOT_PREC=_dot_prec(q.dtype))
    _launch("decode", _decode_stage1_kernel, grid, cfg, _DECODE_SAFE_CFG, d, q.dtype, args, kwargs)
    if not direct:
        _merge_splits(mid_o, mid_lse, out, num_kv_splits, sinks, has_sinks)
    return out

