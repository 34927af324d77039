"""Batch-invariant matrix products and means for the duration of a deterministic radix forward.

While `invariant_ops()` is active in a thread, the model's `F.linear` calls (every `nn.Linear`: projections,
MLP, LM head) run through a fixed-tile Triton product whose launch config follows the weight's shape alone
(`kernels.triton_invariant_matmul`), so a row's result depends on that row alone, whatever the number of rows;
means over the last dim (RMSNorm's `pow(2).mean(-1)`) run as a per-row Triton kernel
(`kernels.triton_row_mean`). Tensors Triton cannot take (a CPU model's) keep torch's own operators.

The override is a `TorchFunctionMode`: it is local to the thread that entered it, so other threads' work
(a plain forward of the same model, say) is untouched, and it is removed when the block exits, however it
exits. Captured CUDA graphs record the kernels' launches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels import triton_runs_on
from .fused_ops import fused_norm_and_rope


def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


_PRODUCTS = {
    f for f in (
        torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
        torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
        torch.Tensor.baddbmm, torch.einsum, F.bilinear, F.scaled_dot_product_attention,
        getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None),
    ) if f is not None
}


def _reduced(func, args: tuple) -> int:
    """How many products a call of `func` (one of `_PRODUCTS`) sums into each output element (1: none)."""
    if func is torch.einsum:
        equation = args[0].replace(" ", "")
        inputs, _, output = equation.partition("->")
        return 2 if set(inputs.replace(",", "")) - set(output) - {"."} else 1
    if func is torch.Tensor.__rmatmul__:
        args = args[::-1]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if func in (torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm):
        tensors = tensors[1:]
    if func is F.scaled_dot_product_attention or not tensors:
        return 2
    return tensors[0].shape[-1] if tensors[0].dim() else 1


def _same_dtype(x: torch.Tensor, *others) -> bool:
    return all(t is None or (isinstance(t, torch.Tensor) and t.dtype == x.dtype) for t in others)


class _InvariantMode(TorchFunctionMode):
    """Routes `F.linear` and last-dim means of floating tensors to their batch-invariant versions."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS and _reduced(func, args) > 1:
            raise ValueError(
                f"deterministic=True: the model computes {getattr(func, '__name__', func)} over a reduced "
                "dimension outside its nn.Linear layers; the mode makes only those products (and last-dim "
                "means, norms, rotary embeddings, attention) batch-invariant: it cannot hold for this model"
            )
        x = args[0] if args else None
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and triton_runs_on(x)):
            return func(*args, **kwargs)
        if func is F.linear and _same_dtype(x, *args[1:], *kwargs.values()):
            from ..kernels.triton_invariant_matmul import invariant_matmul

            return invariant_matmul(*args, **kwargs)
        if func in (torch.mean, torch.Tensor.mean):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if x.dim() >= 1 and _last_dim(dim, x.dim()) and kwargs.get("dtype") is None:
                from ..kernels.triton_row_mean import row_mean

                return row_mean(x, bool(keepdim))
        return func(*args, **kwargs)


@contextlib.contextmanager
def invariant_ops(fused_model: torch.nn.Module | None = None) -> Iterator[None]:
    """Within the block, in this thread: batch-invariant `F.linear` and last-dim means (see the module);
    with `fused_model`, its Llama-style norms and rotary embeddings as fused kernels too (one program per
    row or token, hence batch-invariant: `forward.fused_ops`)."""
    fused = fused_norm_and_rope(fused_model) if fused_model is not None else contextlib.nullcontext()
    with _InvariantMode(), fused:
        yield


def invariant_piece(head_dim: int, device: torch.device) -> int:
    """The keys a piece of deterministic attention holds at this head size on this device."""
    from ..kernels.triton_invariant_attention import invariant_config

    return invariant_config(head_dim, device)["PIECE"]


def refuse_deterministic(model: torch.nn.Module, hybrid: bool, single_device: bool, latent: bool) -> None:
    """Raises ValueError where deterministic mode cannot hold: what this engine does not make invariant."""
    quantized = getattr(model, "hf_quantizer", None) is not None or (
        getattr(getattr(model, "config", None), "quantization_config", None) is not None
    )
    reasons = [
        reason for refused, reason in (
            (quantized, "quantized models (their layers' products do not go through F.linear)"),
            (hybrid, "hybrid models (their state layers' scans are not made batch-invariant)"),
            (not single_device, "several devices or tensor parallel (cross-device reductions)"),
            (latent, "MLA latent pools (their attention is not made batch-invariant)"),
        ) if refused
    ]
    if reasons:
        raise ValueError(f"deterministic=True is not supported with {'; '.join(reasons)}")
