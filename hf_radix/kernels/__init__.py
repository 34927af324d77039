"""Custom kernels: Triton paged attention (extend / decode), RMSNorm and rotary embedding, the CUDA KV store.

Submodules are imported lazily so that ``import hf_radix.kernels`` does not pull in triton.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch

_EXPORTS = {
    "extend_attention": "triton_attention",
    "decode_attention": "triton_attention",
    "pick_num_kv_splits": "triton_attention",
    "rms_norm": "triton_norm_rope",
    "rotary_embedding": "triton_norm_rope",
    "store_kv": "store",
    "cuda_store_available": "store",
    "build_store_kernel": "store",
}

__all__ = [*_EXPORTS, "FP_FUSION", "interpreting", "triton_runs_on"]

# Every Triton launch passes `enable_fp_fusion` (Triton 3.9 warns when it is unset; 3.10 changes its default):
# fused multiply-adds on, as the kernels were validated, except in kernels that must round as torch does
# (sampling's Gumbel-max, the rotary embedding), which pass False.
FP_FUSION = True


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `tensor`: a CUDA tensor with triton importable, or any under the
    Triton interpreter (a CPU model, in another thread say, takes the torch path)."""
    return (tensor.is_cuda or interpreting()) and _triton_importable()


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
