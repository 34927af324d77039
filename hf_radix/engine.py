"""RadixEngine: one per model — the KV pool, the prefix tree, the attention backend and the forward call."""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import asdict

import torch
from transformers.utils import logging

from .attention import make_backend, register
from .cache_utils import RadixCache
from .capability import check_model, hybrid_model_type, install_attention_guard
from .errors import TrainingModeError
from .forward.forward_context import attention_configs, radix_attention, radix_forward
from .forward.fused_ops import fused_norm_and_rope
from .forward.hybrid import hybrid_state_pool
from .forward.invariant_ops import invariant_ops, invariant_piece, refuse_deterministic
from .forward.model_runner import ModelRunner, graph_memory_bytes
from .forward.tensor_parallel import local_kv_shape, sync_tokens, tp_group
from .memory.cache_manager import CacheManager
from .memory.host_tier import HostTier, host_tier_tokens
from .memory.kv_pool import KVPool
from .memory.placement import (
    PlacedKVPool,
    hidden_output_device,
    is_dispatched,
    kv_devices,
    make_kv_pool,
    pool_devices,
    require_one_device,
)
from .memory.state_pool import host_state_slots
from .model_state import ModelState
from .options import EngineOptions
from .paged_attention.forward_batch import ForwardBatch
from .stats import RadixStats

logger = logging.get_logger(__name__)

ENGINE_ATTR = "_hf_radix_engine"


class RadixEngine:
    """Owns the paged KV pool and the radix tree of one model; shared by the runner and `generate`."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions | None = None):
        register()
        support = check_model(model)  # UnsupportedModelError before anything is allocated
        install_attention_guard(model, support, RadixCache)
        self.model = model
        self.state = ModelState(model)  # what cached K/V depends on besides token ids
        self.options = options or EngineOptions()
        device = next(model.parameters()).device
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        page_size = self.options.page_size
        text_config = model.config.get_text_config(decoder=True)
        self.max_context = getattr(text_config, "max_position_embeddings", None) or 1 << 62
        self.vocab_size = text_config.vocab_size
        self.tp_group = tp_group(model)  # multi-GPU hooks: this rank's KV heads; a device map's layer devices
        shape = local_kv_shape(model, support.kv_shape)
        self.kv_layer_index = support.kv_layer_index()
        self.backend = make_backend(self.options.attn_backend, device, self.options.deterministic)
        # hybrid models: the state layers' per-request states, in a pool allocated before the K/V pool
        self.hybrid = hybrid_model_type(model) is not None
        devices = kv_devices(model, shape.num_layers, device)
        if self.options.deterministic:  # before any memory is taken
            one_device = set(devices) == {device} and self.tp_group is None
            refuse_deterministic(model, self.hybrid, one_device, shape.latent)
        self.state_pool = hybrid_state_pool(model, self.options, shape, dtype, device,
                                            self.tp_group is not None) if self.hybrid else None
        self.graph_reserve = self._graph_reserve(shape, dtype, device)
        self.pool, num_pages = make_kv_pool(
            devices, shape, dtype, device, page_size, self.options.max_total_tokens,
            self.options.mem_fraction, self.options.store_backend, self.tp_group, self.graph_reserve,
        )
        self.output_device = hidden_output_device(model, device) if is_dispatched(model) else device
        self.scratch_slot = num_pages * page_size  # a page past the managed ones: padded graph rows
        self.manager = CacheManager(
            num_pages, page_size, device=device, scratch_slot=self.scratch_slot, row_tokens=self.max_context,
            state_pool=self.state_pool,
        )
        host_tokens = host_tier_tokens(self.pool, self.options.host_cache_tokens, self.options.host_cache_gb)
        self.host_tier = None
        if host_tokens:
            require_one_device(self.pool, "a host-memory tier (host_cache_tokens / host_cache_gb)")
            kv_bytes = host_tokens * shape.bytes_per_token(dtype)
            states = host_state_slots(self.state_pool, host_tokens // page_size, kv_bytes)
            self.host_tier = HostTier(self.pool, host_tokens, state_slots=states)
            self.host_tier.attach(self.manager)
        _announce_pool(self.pool, self.pool_tokens, self.options, self.graph_reserve)
        self.stats = RadixStats()
        self._model_runner: ModelRunner | None = None
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.takes_logits_to_keep = "logits_to_keep" in params
        self.attention_configs = attention_configs(model)
        # Radix calls (runner runs, generate calls) on this engine run one at a time; reentrant, so that a
        # call made inside another one in the same thread (a runner inside a logits processor) can proceed.
        self.lock = threading.RLock()
        self.generating = False  # a radix generate call is in progress (one at a time; under `lock`)
        self._streams: dict[str, torch.cuda.Stream] = {}

    def side_stream(self, name: str, priority: int = 0) -> torch.cuda.Stream | None:
        """The engine's CUDA stream `name` beside the current one, made on first use; None off CUDA or over
        several devices."""
        if self.device.type != "cuda" or not self.single_device:
            return None
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = torch.cuda.Stream(self.device, priority=priority)
        return stream

    def _graph_reserve(self, shape, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes a pool sized from free GPU memory leaves for the CUDA graphs this engine will capture.

        Graphs are captured after the pool exists (they hold its addresses), so their static buffers and
        memory pool are estimated (`graph_memory_bytes`) and kept out. Zero where the pool is sized by
        hand or no graphs will be captured (off CUDA, not Triton, MLA latents, several devices).
        """
        options = self.options
        if (
            options.max_total_tokens is not None
            or not options.cuda_graph
            or device.type != "cuda"
            or self.backend.name != "triton"
            or shape.latent
            or self.tp_group is not None
            or is_dispatched(self.model)
        ):
            return 0
        free, _ = torch.cuda.mem_get_info(device)
        kv_bound = min(self.max_context, free // shape.bytes_per_token(dtype))  # a row's longest context
        layers = self.state_pool.specs.values() if self.state_pool is not None else ()
        piece = invariant_piece(shape.head_dim, device) if options.deterministic else None
        return graph_memory_bytes(self.model, dtype, options.cuda_graph_max_batch, kv_bound,
                                  state_layer_bytes=max((s.nbytes for s in layers), default=0), piece=piece)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def page_size(self) -> int:
        return self.manager.page_size

    @property
    def pool_tokens(self) -> int:
        """Tokens of K/V the pool holds for requests (the scratch page of padded graph rows excluded)."""
        return self.manager.num_pages * self.manager.page_size

    @property
    def closed(self) -> bool:
        """True once `get_engine` replaced this engine and released its pool."""
        return self.pool is None

    @property
    def single_device(self) -> bool:
        """One device holds every layer's K/V, without tensor parallel: CUDA graphs and side streams apply."""
        return isinstance(self.pool, KVPool) and self.tp_group is None

    @property
    def captures_graphs(self) -> bool:
        """Forwards can replay CUDA graphs: one CUDA device (no device map across GPUs, no tensor
        parallel), Triton attention, and K/V read from the pool (not MLA latents, whose layers re-read
        every row's whole context). Hybrid models replay decode graphs only."""
        return (
            self.single_device
            and self.device.type == "cuda"
            and self.backend.name == "triton"
            and not self.pool.shape.latent
        )

    def sync_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sampled tokens, the same on every tensor-parallel rank (the first rank's)."""
        return sync_tokens(tokens, self.tp_group)

    @property
    def model_runner(self) -> ModelRunner:
        """The engine's model-runner core with its captured graphs, shared by generate and the runners."""
        if self._model_runner is None:
            options = self.options
            self._model_runner = ModelRunner(
                self, cuda_graph=options.cuda_graph, max_batch=options.cuda_graph_max_batch,
                fused_ops=options.fused_ops and not options.deterministic,  # deterministic: forward_ops
                shared_prefix=options.shared_prefix,
            )
        return self._model_runner

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the model on a packed batch; returns logits `[len(batch.logits_indices), vocab]`."""
        cache = RadixCache(self, batch)
        if self.hybrid and batch.state_batch is None:
            raise RuntimeError("a hybrid model's forward needs the rows' state slots (batch.state_batch)")
        with self.radix_attention(), radix_forward(cache), torch.inference_mode(), self.forward_ops(True):
            out = self.model(
                input_ids=batch.input_ids[None],
                position_ids=batch.positions[None],
                use_cache=True,
                logits_to_keep=cache.batch_on(self.output_device).logits_indices,
                **{self.cache_kwarg: cache},
            )
            if batch.state_batch is not None:  # the states the layers read, updated or wrote in place
                batch.state_batch.flush()
        return out.logits[0].to(self.device)  # a device map may end on another device

    @property
    def fuses_norms(self) -> bool:
        """Whether forwards run Llama-style norms and rotary as fused Triton kernels (not hybrids' yet)."""
        return (self.options.fused_ops and self.single_device and self.device.type == "cuda"
                and self.backend.name == "triton" and not self.hybrid)

    def forward_ops(self, fuse: bool = False) -> contextlib.AbstractContextManager:
        """The operators a radix forward swaps in. Deterministic mode: batch-invariant products and means, and
        the per-row fused norm and rotary kernels in every forward (eager, captured, generate's) where they
        apply (`forward.invariant_ops`); otherwise the fused kernels where `fuse` (`run_model`)."""
        fused = self.model if self.fuses_norms else None
        if self.options.deterministic:
            return invariant_ops(fused)
        return fused_norm_and_rope(fused) if fuse and fused is not None else contextlib.nullcontext()

    def radix_attention(self) -> contextlib.AbstractContextManager:
        """The model reads the "radix" attention in this thread (only) for the duration of the block."""
        return radix_attention(self.attention_configs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """`run_model`, counted in the engine's statistics."""
        logits = self.run_model(batch)
        self.record_forward(batch.num_tokens)
        return logits

    def record_forward(self, num_tokens: int) -> None:
        self.stats.computed_tokens += num_tokens
        self.stats.forward_calls += 1

    def record_prompt(self, prompt_len: int, cached_len: int, host_len: int = 0) -> None:
        self.stats.requests += 1
        self.stats.prompt_tokens += prompt_len
        self.stats.cached_tokens += cached_len
        self.stats.host_cached_tokens += host_len

    def stats_dict(self) -> dict:
        size = self.manager.tree.size_info
        return {
            **self.stats.as_dict(),
            "evicted_tokens": self.manager.evicted_tokens,
            "tree_tokens": size.total_size,
            "pool_tokens": self.pool_tokens,
            **(self.host_tier.stats() if self.host_tier is not None else {}),
        }

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    def reset_cache(self) -> None:
        self.manager.reset()

    def sync_model_state(self) -> None:
        """Brings the cache in line with the model as it is now; every radix call starts here, locked.

        A model training with active dropout is refused (`TrainingModeError`); K/V computed under other
        weights is dropped (an invalidation in the stats); the tree's namespace follows the active adapters.
        """
        dropout = self.state.active_dropout()
        if dropout is not None:
            raise TrainingModeError(dropout)
        check = self.state.check()
        if check.stale is not None:
            self.invalidate(check.stale)
        if check.moved:  # captured graphs read the old tensors' addresses
            self._release_model_runner()
        self.manager.set_namespace(check.namespace)

    def invalidate(self, reason: str) -> None:
        """Drops every cached prefix (both tiers, every namespace), counted in the stats, logged at INFO."""
        tokens = self.manager.tree.size_info.total_size
        self.manager.reset()
        self.stats.invalidations += 1
        self.stats.invalidated_tokens += tokens
        logger.info("hf_radix: dropped %d cached tokens computed under another model state: %s", tokens,
                    reason)

    def set_backends(self, options: EngineOptions) -> None:
        """Switches the attention and store backends and graph options; the pool and its cached prefixes stay.

        The model-runner core is rebuilt on next use (its graphs were captured with the old backends: they
        are released now).
        """
        self.backend = make_backend(options.attn_backend, self.device, options.deterministic)
        self.pool.store_backend = options.store_backend
        self.options = options
        self._release_model_runner()

    def _release_model_runner(self) -> None:
        """Frees the core's graphs (memory pool, static buffers); a holder of the core cannot replay them."""
        if self._model_runner is not None:
            self._model_runner.release()
        self._model_runner = None

    def close(self) -> None:
        """Releases the pool and its host tier for good; runners bound to this engine rebind on next use."""
        device = self.device
        if self.host_tier is not None:  # the tier holds the pool
            self.host_tier.detach()
        self._release_model_runner()  # its graphs hold the pool's addresses and their own memory
        self.pool = self.host_tier = None
        if device.type == "cuda":  # hand cached blocks back: a pool sized by mem_fraction sees them free
            torch.cuda.empty_cache()


def _announce_pool(pool: KVPool | PlacedKVPool, tokens: int, options: EngineOptions,
                   reserve: int = 0) -> None:
    """Says how much memory the pool took and how to size it: a WARNING, once, unless sized by hand on CPU."""
    if options.max_total_tokens is not None:
        sized_by = f"max_total_tokens={options.max_total_tokens:,}"
    elif pool.device.type == "cuda":
        sized_by = f"mem_fraction={options.mem_fraction} of the free GPU memory"
        if reserve:
            sized_by += f" after {reserve / 2**30:.2f} GiB kept for CUDA graphs"
    else:
        sized_by = "the default size off GPU"
    devices = " + ".join(str(d) for d in pool_devices(pool))  # a device map: every device with layers
    message = (
        f"hf_radix: the KV pool of this model takes {pool.nbytes / 2**30:.2f} GiB of {devices} memory "
        f"({tokens:,} tokens, {sized_by}); to change it, call "
        "hf_radix.configure(model, max_total_tokens=... or mem_fraction=...) before first use, "
        "or pass either to RadixBatchRunner"
    )
    if options.max_total_tokens is None or pool.device.type == "cuda":
        logger.warning_once(message)
    else:
        logger.info(message)


# Options read only by the forward path: a new value replaces the engine's backends (and its model-runner
# core) and keeps its cache.
_BACKEND_OPTIONS = (
    "attn_backend", "store_backend", "cuda_graph", "cuda_graph_max_batch", "fused_ops", "warm_up",
    "shared_prefix", "shared_prefix_mode",
)


def _same_pool(a: EngineOptions, b: EngineOptions) -> bool:
    """Whether two option sets build the same pool (mem_fraction is unused when max_total_tokens is set)."""
    unused = ("mem_fraction",) if a.max_total_tokens is not None else ()
    keep = set(_BACKEND_OPTIONS) | set(unused)
    return {k: v for k, v in asdict(a).items() if k not in keep} == {
        k: v for k, v in asdict(b).items() if k not in keep
    }


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (whose adapter layers live inside it), else `model`."""
    return model.get_base_model() if hasattr(type(model), "get_base_model") else model


def get_engine(model: torch.nn.Module, **options) -> RadixEngine:
    """The model's engine, created on first use.

    Options that only change backends update the engine in place and keep its cache; options that need
    another pool release the old pool first (only while no request is running), so a model never holds two.
    A model moved to another dtype or device, or with a changed config, gets a new engine the same way.
    """
    model = transformers_model(model)
    engine: RadixEngine | None = getattr(model, ENGINE_ATTR, None)
    if engine is None:
        engine = RadixEngine(model, EngineOptions(**options))
        setattr(model, ENGINE_ATTR, engine)
        return engine
    requested = EngineOptions(**{**asdict(engine.options), **options}) if options else engine.options
    moved = engine.state.engine_change() if requested == engine.options else None
    if requested == engine.options and moved is None:
        return engine
    if engine.manager.num_rows:
        raise RuntimeError("cannot change hf_radix options while requests are running on this model")
    if moved is None and _same_pool(requested, engine.options):
        engine.set_backends(requested)
        return engine
    logger.info("releasing the hf_radix KV pool of this model for a new one: %s", moved or requested)
    stats = engine.stats
    engine.close()
    delattr(model, ENGINE_ATTR)
    engine = RadixEngine(model, requested)
    setattr(model, ENGINE_ATTR, engine)
    if moved is not None:  # the same model in another state: its statistics go on
        engine.stats = stats
        stats.invalidations += 1
    return engine


def configure(model: torch.nn.Module, **options) -> RadixEngine:
    """Sets the model's pool and backend options (before first use, or when idle); returns its engine.

    `options` are `EngineOptions` fields (docs/options.md); another name raises TypeError listing them.
    """
    EngineOptions.check_names(options)
    return get_engine(model, **options)
