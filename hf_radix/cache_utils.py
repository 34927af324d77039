"""RadixCache, the `transformers.Cache` routing each layer's K/V into the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from .memory.placement import batch_to
from .memory.state_pool import StateBatch, StateCacheMixin
from .paged_attention.forward_batch import ForwardBatch
from .paged_attention.latent import context_latents

if TYPE_CHECKING:
    from .forward.engine_view import ForwardEngine


class RadixCache(StateCacheMixin, Cache):
    """K/V router for one packed forward: `update` stores the new K/V at the batch's slots.

    It keeps no dense copy of K/V: the "radix" attention reads each request's pages from the
    engine's pool through the batch metadata (`self.batch`). For a hybrid model, the state layers' calls
    (`get_conv_state`, `update_recurrent_state`, ...) go to the batch's `StateBatch` (the rows' state
    slots; `StateCacheMixin`), flushed back into the slots by the engine after the forward.
    """

    is_compileable = False

    def __init__(self, engine: ForwardEngine, batch: ForwardBatch | None = None):
        super().__init__(layers=[])
        self.engine = engine
        self.batch = batch
        self._copies: dict[torch.device, tuple[ForwardBatch, ForwardBatch]] = {}  # device -> (batch, copy)
        self.state_batch: StateBatch | None = None if batch is None else batch.state_batch

    def batch_on(self, device: torch.device) -> ForwardBatch:
        """The batch metadata on `device` (a layer's device under a device map), copied once per batch."""
        batch = self.batch
        if batch is None or batch.out_loc.device == device:
            return batch
        copy = self._copies.get(device)
        if copy is None or copy[0] is not batch:
            copy = self._copies[device] = (batch, batch_to(batch, device))
        return copy[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores this layer's new K/V (`[1, kv_heads, T, head_dim]`) in the pool; returns them unchanged."""
        if self.batch is None:
            raise RuntimeError("RadixCache.update called outside an hf_radix forward")
        k = key_states[0].transpose(0, 1)
        v = value_states[0].transpose(0, 1)
        batch = self.batch_on(k.device)  # a device map: this layer's copy of the metadata
        layer = self.engine.kv_layer_index[layer_idx]
        self.engine.pool.store_kv(k, v, batch.out_loc, layer)
        if self.engine.pool.shape.latent:  # MLA: the layer expands its whole context's latents itself
            return context_latents(self.engine.pool, batch, layer, k, v)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.batch is None else int(self.batch.max_kv_len - self.batch.max_new_len)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


CACHE_IMPLEMENTATION = "radix"
