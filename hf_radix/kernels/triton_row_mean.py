"""The mean over the last dim, one program per row in a fixed order: each row's value whatever the row count.

Torch's reduction kernels pick how to split a reduction by the tensor's shape, so a row's mean can round
differently in a batch of 3 rows than in one of 300; this kernel sums every row in the same blocks, in the
same order (deterministic mode: RMSNorm's `pow(2).mean(-1)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION

BLOCK = 1024


@triton.jit
def _row_mean_kernel(X, Out, stride_x, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        acc += tl.load(X + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row, (tl.sum(acc, axis=0) / n_cols).to(Out.dtype.element_ty))


def row_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`x.mean(-1, keepdim)` for a floating `x`, summed in fp32, batch-invariant."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        _row_mean_kernel[(rows.shape[0],)](rows, out, rows.stride(0), n, BLOCK=BLOCK, num_warps=4,
                                           enable_fp_fusion=FP_FUSION)
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.view(shape)
