"""Triton extend (prefill with a cached prefix) attention over a paged KV pool.

Each row has ``prefix_lens[i]`` cached tokens (read from the pool through ``prefix_kv_indices``) followed
by new tokens (read from the contiguous ``k_new``/``v_new``). One program computes a ``BLOCK_M`` x
``head_dim`` output tile for one query head with an online softmax. Few short query blocks over long
prefixes (a question after a cached few-shot prefix) split each prefix into chunks computed in parallel,
merged as in decode.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import interpreting
from .triton_attention_common import (
    _check_common,
    _check_out,
    _dot_prec,
    _finish_rows,
    _last_dim_contig,
    _launch,
    _load_kv,
    _load_paged_kv,
    _merge_splits,
    _scales,
    _scores,
    _sinks_log2,
    _sm_count,
    _softmax_update,
    _window,
    pick_num_kv_splits,
)

__all__ = ["extend_attention", "PACK_GQA_MAX_NEW"]

PACK_GQA_MAX_NEW = 128  # extends of at most this many new tokens per row pack grouped query heads

# Optional launch-config override (tests / benchmarks): keys BLOCK_M, BLOCK_N, num_warps, num_stages.
_EXTEND_CFG_OVERRIDE: dict[str, int] | None = None
# Used when the tuned config does not fit the device (e.g. less shared memory than an H100/H200).
_EXTEND_SAFE_CFG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# --------------------------------------------------------------------------------------------------------
# Extend (prefill with cached prefix)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _extend_prefix_loop(
    acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, prefix_len, q_pos,
    kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over cached prefix positions [lo, hi) (gathered through the slot array)."""
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < prefix_len
        k, v = _load_paged_kv(K_cache, V_cache, kv_idx_ptr, pos, n_mask, kvh, stride_kct, stride_kch,
                              stride_vct, stride_vch, offs_d, offs_dv, d_mask, dv_mask, MASKED, EVEN_D)
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
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over the row's new tokens [lo, hi) (relative indices, contiguous in k_new/v_new)."""
    for start_n in range(lo, hi, BLOCK_N):
        rel = start_n + offs_n
        tok = (tok0 + rel).to(tl.int64)
        k_ptrs = K_new + tok[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :]
        v_ptrs = V_new + tok[:, None] * stride_vnt + kvh * stride_vnh + offs_dv[None, :]
        n_mask = rel < new_len
        k, v = _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, dv_mask, MASKED, EVEN_D)
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
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
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
            offs_n, offs_d, offs_dv, d_mask, dv_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
        lo = first_tok
    acc, l_i, m_i = _extend_new_loop(
        acc, l_i, m_i, q, K_new, V_new, tok0, lo, diag_hi, new_len, q_rel,
        kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, K_cache, V_cache, Out, Mid_o, Mid_lse, Sinks,
    qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
    qk_scale, cap_scale, window, num_splits,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK_GQA: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
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
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = tok < new_len
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V

    q_tok = (tok0 + tok).to(tl.int64)
    q_ptrs = Q + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
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
            offs_n, offs_d, offs_dv, d_mask, dv_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    else:
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _extend_prefix_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, full, prefix_len, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
        acc, l_i, m_i = _extend_prefix_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, full, hi, prefix_len, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    if split == num_splits - 1:
        acc, l_i, m_i = _extend_new_tokens(
            acc, l_i, m_i, q, K_new, V_new, tok0, first_tok, last_tok, new_len, tok,
            kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, USE_WINDOW, SOFTCAP, EVEN_D, not PACK_GQA, BLOCK_N,
            DOT_PREC)

    st_mask = m_mask[:, None] & dv_mask[None, :]
    if DIRECT:
        out = _finish_rows(acc, l_i, m_i, Sinks, heads, m_mask, HAS_SINKS)
        o_ptrs = Out + q_tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=st_mask)
    else:
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        m_ptrs = (Mid_o + q_tok[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_ms
                  + offs_dv[None, :])
        tl.store(m_ptrs, out, mask=st_mask)
        tl.store(Mid_lse + q_tok * stride_lt + heads * stride_lh + split, lse, mask=m_mask)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over (cached prefix ++ new tokens) per row.

    q ``[T, Hq, D]``; k_new ``[T, Hkv, D]``; v_new ``[T, Hkv, Dv]`` (V may be narrower than K, as in MLA);
    qo_indptr ``[B+1]``; prefix_lens ``[B]``; prefix_kv_indices/prefix_kv_indptr: CSR slot lists of each
    row's cached prefix. Returns ``[T, Hq, Dv]``. ``sinks`` ``[Hq]``: attention-sink logits (gpt-oss), one
    extra key per head that takes softmax mass and contributes no value.
    Pass ``max_new_len`` (max over rows of new tokens) to avoid a device->host sync. A bound on the
    prefix length (``max_prefix_len``) lets few, short query blocks over long prefixes split each prefix
    into ``num_splits`` chunks run in parallel (default: enough to fill the GPU; without a bound, one).
    ``pack_gqa`` computes the query heads sharing a KV head together (default: for at most
    ``PACK_GQA_MAX_NEW`` new tokens per row, when heads are grouped).
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    t = q.shape[0]
    if k_new.shape != (t, hkv, d) or v_new.shape != (t, hkv, dv):
        raise ValueError(
            f"k_new/v_new must be [{t}, {hkv}, {d}] / [{t}, {hkv}, {dv}], got {tuple(k_new.shape)}, "
            f"{tuple(v_new.shape)}"
        )
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise ValueError("k_new / v_new must have q's dtype")
    batch = prefix_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1 or prefix_kv_indptr.shape[0] != batch + 1:
        raise ValueError("qo_indptr and prefix_kv_indptr must have B+1 entries (B = len(prefix_lens))")
    q, k_new, v_new = _last_dim_contig(q), _last_dim_contig(k_new), _last_dim_contig(v_new)
    out = _check_out(out, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
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
        mid_o = torch.empty((t, hq, num_splits, dv), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((t, hq, num_splits), dtype=torch.float32, device=q.device)
        mstrides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (heads, batch, triton.cdiv(max_new_len * (group if pack else 1), meta["BLOCK_M"]) * num_splits)

    args = (
        q, k_new, v_new, k_cache, v_cache, out, mid_o, mid_lse, sinks,
        qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
        qk_scale, cap_scale, window, num_splits,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), *mstrides,
    )
    kwargs = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
                  BLOCK_DV=triton.next_power_of_2(dv), PACK_GQA=pack, USE_WINDOW=use_window, SOFTCAP=use_cap,
                  DIRECT=direct, HAS_SINKS=has_sinks, DOT_PREC=_dot_prec(q.dtype))
    _launch("extend", _extend_kernel, grid, cfg, _EXTEND_SAFE_CFG, d, q.dtype, args, kwargs)
    if not direct:
        _merge_splits(mid_o, mid_lse, out, num_splits, sinks, has_sinks)
    return out

