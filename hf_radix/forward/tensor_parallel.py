"""Tensor parallel through transformers' own `tp_plan` (launched with torchrun): what the engine adapts.

Each rank's pool holds the KV heads of its shard of every attention layer (`local_kv_shape`); every rank
runs the same scheduling decisions in lockstep, which needs the same pool size on every rank (`make_kv_pool`
takes the smallest rank's) and the same sampled tokens (`sync_tokens`: the group's first rank broadcasts).
The logits are the full vocabulary on every rank (transformers gathers the `lm_head` output).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.utils import logging

from ..errors import UnsupportedModelError
from ..integrations.distributed import broadcast_from_first
from ..memory.kv_pool import KVShape

logger = logging.get_logger(__name__)


def tp_group(model: torch.nn.Module):
    """The process group the model is tensor-parallel over, or None when it is not sharded."""
    if (getattr(model, "_tp_size", None) or 1) <= 1:
        return None
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        return manager.get_mesh("tp").get_group()
    mesh = model._device_mesh
    return (mesh["tp"] if mesh.ndim > 1 else mesh).get_group()


def _local_rows(weight: torch.Tensor) -> int:
    """Output features this rank holds of a (possibly DTensor-sharded) linear weight."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.shape[0]


def local_kv_shape(model: torch.nn.Module, shape: KVShape) -> KVShape:
    """The model's K/V geometry `shape` on this rank: the KV heads of this rank's shard under tensor
    parallel. MLA latent pools (one latent "head" every rank would hold whole) are refused there."""
    if tp_group(model) is None:
        return shape
    if shape.latent:
        raise UnsupportedModelError(
            type(model).__name__,
            "its MLA layers cache compressed latents, which hf_radix does not shard under tensor parallel "
            "(run it unsharded, with device_map, or one replica per GPU with DataParallelRunner)",
        )
    heads = set()
    for module in model.modules():
        k_proj = getattr(module, "k_proj", None)
        if isinstance(getattr(module, "layer_idx", None), int) and isinstance(k_proj, torch.nn.Linear):
            heads.add(_local_rows(k_proj.weight) // shape.head_dim)
    if len(heads) != 1:
        raise ValueError(
            "hf_radix: cannot tell how many KV heads this tensor-parallel rank holds "
            f"(attention k_proj shards give {sorted(heads) or 'none'})"
        )
    local = dataclasses.replace(shape, num_kv_heads=heads.pop())
    logger.info(
        "tensor parallel: this rank's pool holds %d of %d KV heads", local.num_kv_heads, shape.num_kv_heads
    )
    return local


def sync_tokens(tokens: torch.Tensor, group) -> torch.Tensor:
    """Sampled tokens of the group's first rank, on every rank (identity without a group)."""
    return tokens if group is None else broadcast_from_first(tokens, group)
