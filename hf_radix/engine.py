"""RadixEngine: one per model — the KV pool, the prefix tree, the attention backend and the forward call."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from transformers.utils import logging

from .attention import ATTENTION_NAME, make_backend, register
from .cache_manager import CacheManager
from .forward_batch import ForwardBatch
from .kv_pool import KVPool
from .placement import hidden_output_device, is_dispatched, make_kv_pool
from .tensor_parallel import local_kv_shape, sync_tokens, tp_group

logger = logging.get_logger(__name__)

_ENGINE_ATTR = "_hf_radix_engine"


@dataclass
class CacheStats:
    """Prefix-reuse counters of one engine, summed over every path that used it."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    forward_calls: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class EngineOptions:
    """Pool and backend options; fixed for the life of an engine."""

    page_size: int = 1
    max_total_tokens: int | None = None
    mem_fraction: float = 0.85
    attn_backend: str = "auto"
    store_backend: str = "auto"

    def __post_init__(self):
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")


@contextlib.contextmanager
def radix_attention(model: torch.nn.Module) -> Iterator[None]:
    """Switches the model to the "radix" attention for the duration of the block."""
    config = model.config
    previous = config._attn_implementation
    if previous == ATTENTION_NAME:
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


class RadixEngine:
    """Owns the paged KV pool and the radix tree of one model; shared by the runner and `generate`."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions | None = None):
        register()
        self.model = model
        self.options = options or EngineOptions()
        device = next(model.parameters()).device
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        page_size = self.options.page_size
        # multi-GPU hooks: KV heads of this rank's tensor-parallel shard; per-layer devices of a device map
        self.tp_group = tp_group(model)
        # One extra page past the managed ones: padded rows of captured decode graphs write there.
        self.pool, num_pages = make_kv_pool(
            model, local_kv_shape(model), dtype, device, page_size, self.options.max_total_tokens,
            self.options.mem_fraction, self.options.store_backend, self.tp_group,
        )
        self.output_device = hidden_output_device(model, device) if is_dispatched(model) else device
        self.scratch_slot = num_pages * page_size
        self.manager = CacheManager(num_pages, page_size)
        self.backend = make_backend(self.options.attn_backend, device)
        self.stats = CacheStats()
        text_config = model.config.get_text_config(decoder=True)
        self.max_context = getattr(text_config, "max_position_embeddings", None) or 1 << 62
        self.vocab_size = text_config.vocab_size
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.takes_logits_to_keep = "logits_to_keep" in params

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def single_device(self) -> bool:
        """One device holds every layer's K/V, without tensor parallel: CUDA graphs and side streams apply."""
        return isinstance(self.pool, KVPool) and self.tp_group is None

    @property
    def cuda_graphs_supported(self) -> bool:
        """Decode/extend graphs can be captured: one CUDA device, Triton attention."""
        return self.single_device and self.device.type == "cuda" and self.backend.name == "triton"

    def sync_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sampled tokens, the same on every tensor-parallel rank (the first rank's)."""
        return sync_tokens(tokens, self.tp_group)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the model on a packed batch; returns logits `[len(batch.logits_indices), vocab]`."""
        from .cache_utils import RadixCache

        cache = RadixCache(self, batch)
        with radix_attention(self.model), torch.inference_mode():
            out = self.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.positions[None],
                use_cache=True,
                logits_to_keep=cache.batch_on(self.output_device).logits_indices,
                radix_cache=cache,
                **{self.cache_kwarg: cache},
            )
        return out.logits[0].to(self.device)  # a device map may end on another device

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`run_model`, counted in the engine's statistics."""
        logits = self.run_model(batch)
        self.record_forward(batch.num_tokens)
        return logits

    def record_forward(self, num_tokens: int) -> None:
        self.stats.computed_tokens += num_tokens
        self.stats.forward_calls += 1

    def record_prompt(self, prompt_len: int, cached_len: int) -> None:
        self.stats.prompt_tokens += prompt_len
        self.stats.cached_tokens += cached_len

    def stats_dict(self) -> dict:
        size = self.manager.tree.size_info
        return {
            **self.stats.as_dict(),
            "evicted_tokens": self.manager.evicted_tokens,
            "tree_tokens": size.total_size,
            "pool_tokens": self.manager.num_pages * self.page_size,
        }

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    def reset_cache(self) -> None:
        self.manager.reset()


def get_engine(model: torch.nn.Module, **options) -> RadixEngine:
    """The model's engine, created on first use; replaced (when idle) if `options` ask for another pool."""
    engine = getattr(model, _ENGINE_ATTR, None)
    requested = EngineOptions(**{**(asdict(engine.options) if engine else {}), **options})
    if engine is not None:
        if requested == engine.options:
            return engine
        if engine.manager.num_rows:
            raise RuntimeError("cannot change hf_radix pool options while requests are running on this model")
        logger.info("replacing the hf_radix engine of this model: %s", requested)
    engine = RadixEngine(model, requested)
    setattr(model, _ENGINE_ATTR, engine)
    return engine


def configure(model: torch.nn.Module, **options) -> RadixEngine:
    """Sets the model's pool and backend options (before first use, or when idle); returns its engine."""
    return get_engine(model, **options)
