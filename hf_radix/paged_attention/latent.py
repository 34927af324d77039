"""MLA layers (DeepSeek-V2/V3 as transformers implements them): the pool holds compressed latents.

Such a layer stores its compressed K/V latent (``kv_lora_rank`` wide) and its shared rotary key
(``qk_rope_head_dim`` wide) through ``cache.update`` and expands what the cache returns into per-head K
(``qk_nope_head_dim + qk_rope_head_dim``) and V (``v_head_dim``). So the update hands back every row's whole
context, and the attention reads those expanded K/V in the same order instead of the pool:

* decode batches: the rows' whole contexts in ``kv_indices`` order (the new token is already stored);
* other batches: the cached prefixes in ``prefix_kv_indices`` order, then the new tokens in batch order,
  so the new tokens' K/V are the tail and each row's prefix starts at its ``prefix_kv_indptr`` offset.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..memory.kv_pool import KVPool
from .forward_batch import ForwardBatch


def context_latents(
    pool: KVPool, batch: ForwardBatch, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents of every row's context as ``[1, 1, N, dim]`` (after this layer's new ones are stored)."""
    k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)
    if batch.is_decode:
        k, v = k_cache[batch.kv_indices], v_cache[batch.kv_indices]
    else:
        prefix = batch.prefix_kv_indices
        k = torch.cat([k_cache[prefix], k_new.to(k_cache.dtype)])
        v = torch.cat([v_cache[prefix], v_new.to(v_cache.dtype)])
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def expanded_attention_inputs(
    batch: ForwardBatch, key: torch.Tensor, value: torch.Tensor, host_indices: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
    """(k_new, v_new, k_cache, v_cache, batch) for a backend, from the layer's expanded ``[1, H, N, D]`` K/V.

    The returned batch indexes the expanded tensors instead of the pool. ``host_indices``: also build
    each row's whole-context list on the host (the torch backend reads it for every batch).
    """
    k_all, v_all = key[0].transpose(0, 1), value[0].transpose(0, 1)
    n = k_all.shape[0]
    if batch.is_decode:
        local = torch.arange(n, device=k_all.device)
        return k_all, v_all, k_all, v_all, dataclasses.replace(batch, kv_indices=local)
    p = batch.prefix_kv_indices.shape[0]
    changes = {"prefix_kv_indices": torch.arange(p, device=k_all.device)}
    if host_indices:
        qo = batch.qo_indptr_host
        new = np.diff(qo)
        prefix_lens = batch.seq_lens_host - new
        starts = np.concatenate([[0], np.cumsum(prefix_lens)[:-1]])
        rows = [
            np.concatenate([np.arange(s, s + pl), p + np.arange(qo[i], qo[i + 1])])
            for i, (s, pl) in enumerate(zip(starts, prefix_lens))
        ]
        whole = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        changes["kv_indices"] = torch.as_tensor(whole, dtype=torch.int64, device=k_all.device)
    return k_all[p:], v_all[p:], k_all, v_all, dataclasses.replace(batch, **changes)
