"""The "radix" attention function: paged attention over the KV pool, with a backend dispatch."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.utils import logging

from .forward_batch import ForwardBatch
from .placement import layer_device

logger = logging.get_logger(__name__)

ATTENTION_NAME = "radix"
BACKENDS = ("auto", "torch", "triton", "flashinfer")


class AttentionBackend(Protocol):
    """Computes attention for a packed batch whose K/V (new tokens included) are already in the pool."""

    name: str

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
    ) -> torch.Tensor: ...


class TorchBackend:
    """Exact reference: gathers each row's K/V from the pool and runs masked softmax attention."""

    name = "torch"

    def forward(self, q, k_new, v_new, k_cache, v_cache, batch, scaling, sliding_window, softcap):
        out = torch.empty_like(q)
        qo = batch.qo_indptr_host
        seq = batch.seq_lens_host
        kv_start = 0
        group = q.shape[1] // k_cache.shape[1]
        for row in range(batch.batch_size):
            q_start, q_end, kv_len = int(qo[row]), int(qo[row + 1]), int(seq[row])
            slots = batch.kv_indices[kv_start : kv_start + kv_len]
            kv_start += kv_len
            if q_end == q_start:
                continue
            k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
            v = v_cache[slots].float().repeat_interleave(group, dim=1)
            qr = q[q_start:q_end].float()  # [n, Hq, D]
            scores = torch.einsum("nhd,lhd->hnl", qr, k) * scaling
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            q_pos = torch.arange(kv_len - (q_end - q_start), kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window:
                allowed &= q_pos - k_pos < sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[q_start:q_end] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).to(q.dtype)
        return out


class TritonBackend:
    """Triton paged kernels: split-KV decode for all-decode batches, paged extend otherwise."""

    name = "triton"

    def __init__(self):
        from .kernels import triton_attention

        self._kernels = triton_attention

    def forward(self, q, k_new, v_new, k_cache, v_cache, batch, scaling, sliding_window, softcap):
        if batch.is_decode:
            return self._kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                batch.kv_indices,
                batch.kv_indptr,
                scaling,
                sliding_window=sliding_window,
                softcap=softcap,
                max_kv_len=batch.max_kv_len,
            )
        return self._kernels.extend_attention(
            q,
            k_new,
            v_new,
            k_cache,
            v_cache,
            batch.qo_indptr,
            batch.prefix_lens,
            batch.prefix_kv_indices,
            batch.prefix_kv_indptr,
            scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            max_new_len=batch.max_new_len,
            max_prefix_len=batch.max_kv_len,
        )


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """Resolves a backend name; "auto" is Triton on CUDA when importable, the torch reference otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {BACKENDS}, got {name!r}")
    if name == "flashinfer":
        raise ValueError("attn_backend='flashinfer' is not available in this build; use 'triton' or 'torch'")
    if name == "auto":
        if device.type != "cuda":
            return TorchBackend()
        try:
            return TritonBackend()
        except ImportError:
            logger.warning("Triton is not installed; falling back to the torch attention reference")
            return TorchBackend()
    return TritonBackend() if name == "triton" else TorchBackend()


def radix_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the pool for a packed `(1, T)` batch; the cache already stored this layer's K/V."""
    cache = kwargs.get("radix_cache")
    if cache is None or cache.batch is None:
        raise RuntimeError(
            "the 'radix' attention runs only inside hf_radix forwards (RadixBatchRunner or "
            "generate(..., cache_implementation='radix'))"
        )
    pool = cache.engine.pool
    if query.shape[0] != 1:
        raise ValueError(
            f"radix attention expects a packed batch of shape (1, T), got batch size {query.shape[0]}"
        )
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    with layer_device(pool, layer):  # a device map: this layer's kernels on its device
        out = cache.engine.backend.forward(
            q,
            k,
            v,
            pool.k_cache(layer),
            pool.v_cache(layer),
            cache.batch_on(q.device),
            scaling,
            sliding_window,
            softcap or None,
        )
    return out.unsqueeze(0), None


def no_dense_mask(*args, **kwargs) -> None:
    """Mask function for "radix": masking is done inside the kernels from the batch metadata."""
    return None


def register() -> None:
    """Registers the "radix" attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, radix_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_dense_mask)
