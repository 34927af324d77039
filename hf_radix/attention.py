"""The "radix" attention function: paged attention over the KV pool, with a backend dispatch."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.utils import logging

from .capability import REFUSED_ATTENTION_KWARGS, count_attention_call
from .errors import UnsupportedModelError
from .forward.forward_context import ATTENTION_NAME, current_forward
from .kernels import triton_runs_on
from .memory.placement import layer_device
from .paged_attention.backend import AttentionBackend
from .paged_attention.latent import expanded_attention_inputs

logger = logging.get_logger(__name__)

BACKENDS = ("auto", "torch", "triton")


class TorchBackend:
    """Exact reference: gathers each row's K/V from the pool and runs masked softmax attention."""

    name = "torch"

    def reads_context(self, decode: bool, latent: bool) -> bool:
        # MLA extends: the layer gathers its cached prefix's latents, this reference indexes them on the host
        return decode or not latent

    def forward(self, q, k_new, v_new, k_cache, v_cache, batch, scaling, sliding_window, softcap, sinks=None):
        out = q.new_empty((*q.shape[:2], v_cache.shape[-1]))
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
            v = v_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, Dv]
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
            if sinks is not None:
                sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            out[q_start:q_end] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
        return out


class TritonBackend:
    """Triton paged kernels: split-KV decode for all-decode batches, paged extend otherwise; decode batches
    with a `shared_prefix` plan read each group's prefix once (`hf_radix.paged_attention.shared_decode`)."""

    name = "triton"

    def __init__(self):
        from .kernels import triton_attention, triton_shared_prefix

        self._kernels = triton_attention
        self._shared = triton_shared_prefix

    def reads_context(self, decode: bool, latent: bool) -> bool:
        return decode  # split-KV decode over whole contexts; extend over cached prefixes + the new tokens

    def forward(self, q, k_new, v_new, k_cache, v_cache, batch, scaling, sliding_window, softcap, sinks=None):
        share = batch.shared_prefix
        if share is not None and batch.is_decode:
            return self._shared.shared_prefix_attention(
                q, k_cache, v_cache, batch.kv_indices, share.buffers, scaling,
                num_prefix_splits=share.prefix_splits, sliding_window=sliding_window, softcap=softcap,
                sinks=sinks, mode=share.mode, side_stream=share.side_stream,
            )
        if batch.is_decode:
            return self._kernels.decode_attention(
                q, k_cache, v_cache, batch.kv_indices, batch.kv_indptr, scaling,
                sliding_window=sliding_window, softcap=softcap, max_kv_len=batch.max_kv_len, sinks=sinks,
            )
        return self._kernels.extend_attention(
            q, k_new, v_new, k_cache, v_cache, batch.qo_indptr, batch.prefix_lens, batch.prefix_kv_indices,
            batch.prefix_kv_indptr, scaling, sliding_window=sliding_window, softcap=softcap,
            max_new_len=batch.max_new_len, max_prefix_len=batch.max_kv_len, sinks=sinks,
        )


class InvariantBackend(TritonBackend):
    """Deterministic mode: extend and mixed batches run the batch-invariant kernel
    (`kernels.triton_invariant_attention`), decode batches the same pieces of each context as programs of
    their own (`kernels.triton_split_decode`), with the same results; a tile plan
    (`paged_attention.grouped_decode`) computes a group's shared pieces once per tile of rows."""

    def __init__(self):
        super().__init__()
        from .kernels import triton_invariant_attention, triton_split_decode

        self._invariant = triton_invariant_attention
        self._split = triton_split_decode

    def reads_context(self, decode: bool, latent: bool) -> bool:
        return True

    def forward(self, q, k_new, v_new, k_cache, v_cache, batch, scaling, sliding_window, softcap, sinks=None):
        if batch.is_decode:
            tiles = batch.shared_prefix
            return self._split.split_decode_attention(
                q, k_cache, v_cache, batch.kv_indices, batch.kv_indptr, scaling, max_kv_len=batch.max_kv_len,
                tiles=None if tiles is None else tiles.tables, sliding_window=sliding_window, softcap=softcap,
                sinks=sinks,
            )
        return self._invariant.invariant_attention(
            q, k_cache, v_cache, batch.qo_indptr, batch.kv_indices, batch.kv_indptr, scaling,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        )


def make_backend(name: str, device: torch.device, deterministic: bool = False) -> AttentionBackend:
    """Resolves a backend name; "auto" is Triton on CUDA when importable, the torch reference otherwise.

    `deterministic`: the batch-invariant Triton backend; refused (ValueError) where Triton cannot run.
    """
    if name not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {BACKENDS}, got {name!r}")
    if deterministic:
        if name == "torch" or not triton_runs_on(torch.empty(0, device=device)):
            raise ValueError(
                "deterministic=True needs the Triton attention backend on a CUDA device (attn_backend "
                f"'auto' or 'triton'; got {name!r} on {device}): the torch reference's reductions depend on "
                "the batch"
            )
        return InvariantBackend()
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
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the pool for a packed `(1, T)` batch; the cache already stored this layer's K/V.

    `s_aux` are gpt-oss's attention sinks. Arguments that would change the result and that this
    attention does not implement raise instead of being ignored.
    """
    cache = current_forward()
    if cache is None or cache.batch is None:
        raise RuntimeError(
            "the 'radix' attention runs only inside hf_radix forwards (RadixBatchRunner or "
            "generate(..., cache_implementation='radix'))"
        )
    count_attention_call()
    _check_call(module, dropout, kwargs)
    pool = cache.engine.pool
    if query.shape[0] != 1:
        raise ValueError(
            f"radix attention expects a packed batch of shape (1, T), got batch size {query.shape[0]}"
        )
    layer = cache.engine.kv_layer_index[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    backend = cache.engine.backend
    batch = cache.batch_on(q.device)  # a device map: this layer's copy of the metadata
    if pool.shape.latent:
        k, v, k_cache, v_cache, batch = expanded_attention_inputs(
            batch, key, value, host_indices=backend.name == "torch"
        )
    else:
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)
    with layer_device(pool, layer):  # a device map: this layer's kernels on its device
        out = backend.forward(
            q, k, v, k_cache, v_cache, batch, scaling, sliding_window, softcap or None, s_aux
        )
    return out.unsqueeze(0), None


def _check_call(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Raises for what this attention cannot compute exactly (instead of silently ignoring it)."""
    if dropout:
        raise ValueError(
            f"the 'radix' attention has no dropout (got dropout={dropout}): put the model in eval mode "
            "(model.eval()) before radix calls"
        )
    if kwargs.get("is_causal") is False:
        raise UnsupportedModelError(type(module).__name__, "its attention is not causal")
    given = [name for name in REFUSED_ATTENTION_KWARGS if kwargs.get(name) is not None]
    if given:
        raise UnsupportedModelError(
            type(module).__name__,
            f"it passes {', '.join(given)} to the attention function, which the radix attention does not "
            "implement",
        )


def no_dense_mask(*args, **kwargs) -> None:
    """Mask function for "radix": masking is done inside the kernels from the batch metadata."""
    return None


def register() -> None:
    """Registers the "radix" attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, radix_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_dense_mask)
