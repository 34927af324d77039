"""Batch-invariant matrix products and means for the duration of a deterministic radix forward.

A GEMM library picks its kernel (tile shape, split along K) by the problem's shape, so a row's product can
round differently when the step holds 3 rows than when it holds 300. While `invariant_ops()` is active in a
thread, the model's `F.linear` calls (every `nn.Linear`: projections, MLP, LM head) run in chunks of exactly
`LINEAR_ROWS` rows (the last one zero-padded): every row goes through a product of one shape, hence one
kernel, whatever the number of rows, and a row's result depends on that row alone. Means over the last dim
(RMSNorm's `pow(2).mean(-1)`) run as a per-row Triton kernel (`kernels.triton_row_mean`).

The override is a `TorchFunctionMode`: it is local to the thread that entered it, so other threads' work
(a plain forward of the same model, say) is untouched, and it is removed when the block exits, however it
exits. Captured CUDA graphs record the chunked launches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels import triton_runs_on

LINEAR_ROWS = 256  # rows of every product: decode batches up to this size read the weights once
_ALIGN = 256  # bytes: every product's input starts as aligned as a fresh allocation's chunks


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in products (`mm`, `addmm`) of exactly `LINEAR_ROWS` rows each;
    without autograd (radix forwards run under inference mode or no_grad)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded = -(-n // LINEAR_ROWS) * LINEAR_ROWS
    if padded != n or n == 0:
        rows = torch.cat([rows, rows.new_zeros(max(padded, LINEAR_ROWS) - n, rows.shape[1])])
    elif not rows.is_contiguous() or rows.data_ptr() % _ALIGN:  # a GEMM's pick may follow the alignment
        rows = rows.contiguous() if not rows.is_contiguous() else rows.clone()
    out = rows.new_empty(rows.shape[0], weight.shape[0])  # each product writes its rows in place
    weight_t = weight.t()
    for i in range(0, rows.shape[0], LINEAR_ROWS):
        part = slice(i, i + LINEAR_ROWS)
        if bias is None:
            torch.mm(rows[part], weight_t, out=out[part])
        else:
            torch.addmm(bias, rows[part], weight_t, out=out[part])
    return out[:n].view(*x.shape[:-1], weight.shape[0])


def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


class _InvariantMode(TorchFunctionMode):
    """Routes `F.linear` and last-dim means of floating tensors to their batch-invariant versions."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func in (torch.mean, torch.Tensor.mean):
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if (
                isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1
                and _last_dim(dim, x.dim()) and kwargs.get("dtype") is None and triton_runs_on(x)
            ):
                from ..kernels.triton_row_mean import row_mean

                return row_mean(x, bool(keepdim))
        return func(*args, **kwargs)


@contextlib.contextmanager
def invariant_ops() -> Iterator[None]:
    """Within the block, in this thread: batch-invariant `F.linear` and last-dim means (see the module)."""
    with _InvariantMode():
        yield


def refuse_deterministic(hybrid: bool, single_device: bool, latent: bool) -> None:
    """Raises ValueError where deterministic mode cannot hold: what this engine does not make invariant."""
    reasons = [
        reason for refused, reason in (
            (hybrid, "hybrid models (their state layers' scans are not made batch-invariant)"),
            (not single_device, "several devices or tensor parallel (cross-device reductions)"),
            (latent, "MLA latent pools (their attention is not made batch-invariant)"),
        ) if refused
    ]
    if reasons:
        raise ValueError(f"deterministic=True is not supported with {'; '.join(reasons)}")
