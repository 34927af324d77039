"""Triton kernels for the RMSNorm and rotary embedding of Llama-style HF models, one launch each.

HF computes these with 8 (RMSNorm) and 10 (rotary embedding of q and k) elementwise kernels; in a captured
short forward at 8B that is about 800 small launches. These kernels compute the same thing, rounding
where HF's separate kernels round: the rotary embedding is bit-identical to HF's, the RMSNorm differs
only by the order of its sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    # HF: weight * (x * rsqrt(variance + eps)).to(input dtype), the product in the promoted dtype
    normed = (x * tl.math.rsqrt(variance + eps)).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_out + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)` over the last dim (unit stride), fp32 inside."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.numel():
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out.view(-1, n), rows.stride(0), n, n, eps, BLOCK=block,
            num_warps=max(1, min(16, block // 256)), enable_fp_fusion=FP_FUSION,
        )
    return out


@triton.jit
def _rotate_heads(X, Out, sx_h, so_h, n_heads, cos_lo, cos_hi, sin_lo, sin_hi,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's heads: `x * cos + rotate_half(x) * sin`, each product rounded like HF's own kernels."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < n_heads
    dtype = Out.dtype.element_ty
    lo = tl.load(X + heads * sx_h + dims, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(X + heads * sx_h + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    out_lo = (lo * cos_lo).to(dtype).to(tl.float32) + (-hi * sin_lo).to(dtype).to(tl.float32)
    out_hi = (hi * cos_hi).to(dtype).to(tl.float32) + (lo * sin_hi).to(dtype).to(tl.float32)
    tl.store(Out + heads * so_h + dims, out_lo.to(dtype), mask=mask)
    tl.store(Out + heads * so_h + HALF + dims, out_hi.to(dtype), mask=mask)


# not specialized on the token count (a compile per new length); the strides keep their alignment facts
@triton.jit(do_not_specialize=["seq_len"])
def _rope_kernel(Q, K, Cos, Sin, Q_out, K_out, seq_len, n_q, n_k,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t, sqo_b, sqo_h, sqo_t, sko_b, sko_h, sko_t,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    pid = tl.program_id(0)
    b, t = (pid // seq_len).to(tl.int64), (pid % seq_len).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cs = Cos + b * sc_b + t * sc_t
    sn = Sin + b * sc_b + t * sc_t
    cos_lo, cos_hi = tl.load(cs + dims).to(tl.float32), tl.load(cs + HALF + dims).to(tl.float32)
    sin_lo, sin_hi = tl.load(sn + dims).to(tl.float32), tl.load(sn + HALF + dims).to(tl.float32)
    _rotate_heads(Q + b * sq_b + t * sq_t, Q_out + b * sqo_b + t * sqo_t, sq_h, sqo_h, n_q,
                  cos_lo, cos_hi, sin_lo, sin_hi, HALF, BLOCK_HQ)
    _rotate_heads(K + b * sk_b + t * sk_t, K_out + b * sko_b + t * sko_t, sk_h, sko_h, n_k,
                  cos_lo, cos_hi, sin_lo, sin_hi, HALF, BLOCK_HK)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `apply_rotary_pos_emb(q, k, cos, sin)` for `q, k: [B, heads, T, D]`, `cos, sin: [B or 1, T, D]`.

    All four in one dtype, unit stride in the last dim, D a power of two; the outputs keep q's and k's
    memory layout.
    """
    batch, n_q, seq_len, dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() and k.numel():
        cs = cos.stride()
        cos_b = 0 if cos.shape[0] == 1 else cs[0]
        _rope_kernel[(batch * seq_len,)](
            q, k, cos, sin, q_out, k_out, seq_len, n_q, k.shape[1],
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos_b, cs[1],
            q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1),
            k_out.stride(2),
            HALF=dim // 2, BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            num_warps=4, enable_fp_fusion=False,
        )
    return q_out, k_out
