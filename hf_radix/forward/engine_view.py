"""What the forward machinery reads of its engine: a `Protocol` that `RadixEngine` satisfies, so that the
model runner, the graphs, the shared-prefix planner and the cache depend on it, not on the engine module."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from ..memory.cache_manager import CacheManager
from ..memory.kv_pool import KVPool
from ..memory.placement import PlacedKVPool
from ..options import EngineOptions
from ..paged_attention.backend import AttentionBackend
from ..paged_attention.forward_batch import ForwardBatch, StepRows, build_forward_batch


class ForwardEngine(Protocol):
    """One model's pool, page table and backend, and its forward on a packed batch."""

    model: torch.nn.Module
    options: EngineOptions
    manager: CacheManager
    pool: KVPool | PlacedKVPool
    backend: AttentionBackend
    max_context: int
    kv_layer_index: list[int]  # the pool layer of each decoder layer (-1: a state layer)
    hybrid: bool  # state layers: the manager keeps a state slot per row (forward.hybrid)

    @property
    def device(self) -> torch.device: ...

    @property
    def page_size(self) -> int: ...

    @property
    def single_device(self) -> bool: ...

    @property
    def captures_graphs(self) -> bool: ...

    def run_model(self, batch: ForwardBatch) -> torch.Tensor: ...

    def forward_ops(self, fuse: bool = False) -> contextlib.AbstractContextManager: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def record_forward(self, num_tokens: int) -> None: ...

    def sync_sampled(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def side_stream(self, name: str, priority: int = 0) -> torch.cuda.Stream | None: ...


def eager_batch(engine: ForwardEngine, step: StepRows) -> ForwardBatch:
    """The metadata of `step` in fresh tensors, with the slot list the engine's attention backend reads."""
    context = engine.backend.reads_context(step.is_decode, engine.pool.shape.latent)
    return build_forward_batch(engine.manager.table, step, context)
