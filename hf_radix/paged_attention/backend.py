"""The interface every attention backend implements (`hf_radix.attention` holds the backends)."""

from __future__ import annotations

from typing import Protocol

import torch

from .forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """Computes attention for a packed batch whose K/V (new tokens included) are already in the pool.

    K and V may have different head sizes (MLA); ``sinks`` (``[Hq]`` or None) are attention-sink logits
    (gpt-oss): one extra key per head that takes softmax mass and contributes no value.
    """

    name: str

    def reads_context(self, decode: bool, latent: bool) -> bool:
        """Whether a batch's kernels read every row's whole-context slot list, else its cached prefix's
        (`build_forward_batch`); `decode`: every row adds one token; `latent`: MLA latents in the pool."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
