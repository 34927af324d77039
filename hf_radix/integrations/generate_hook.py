"""`generate(..., cache_implementation="radix")`: the hook on transformers' generate and the call wrapper.

The hook passes every other call through unchanged; a radix call checks what it cannot do, builds the
call's `RadixGenerateCache`, routes the model's forward through it and always cleans up.

The first radix call on an engine (on CUDA, with graphs) warms its model-runner core up first: every
decode and extend graph shape is captured and the eager Triton kernels compiled then, once, so that no
later call of any batch size pays a capture or a compile inline (`engine.model_runner.warm_up_times`
says what it cost; `hf_radix.configure(model, warm_up=False)` captures each shape on first use instead).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar

import torch
from transformers.utils import logging

from ..cache_utils import CACHE_IMPLEMENTATION
from ..capability import check_inputs
from ..engine import ENGINE_ATTR, get_engine
from ..errors import OWN_CACHE_MESSAGE
from ..scheduling.inputs import token_id_list
from .generate_session import RadixGenerateCache

logger = logging.get_logger(__name__)

_SUPPORTED_MODES = ("greedy_search", "sample")
_TAKEN_OVER = ("cache_implementation", "prefill_chunk_size")  # generation options the radix path handles
# generation settings the radix call in this context takes over: generate, called by it, sees them unset
_taken_over: ContextVar[tuple[str, ...]] = ContextVar("hf_radix_taken_over_settings", default=())


def _requested_cache_implementation(model, args: tuple, kwargs: dict) -> str | None:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"]
    config = args[1] if len(args) > 1 else kwargs.get("generation_config")
    value = getattr(config, "cache_implementation", None)  # a config object's None defers to the model's
    return value if value is not None else getattr(model.generation_config, "cache_implementation", None)


@functools.cache
def _positional_names(original: Callable) -> tuple[str, ...]:
    """Names of `generate`'s parameters (after `self`) that can be passed by position."""
    params = list(inspect.signature(original).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _as_keywords(original, args: tuple, kwargs: dict) -> dict:
    """`generate`'s positional arguments (after `self`) turned into keywords."""
    if not args:
        return dict(kwargs)
    names = _positional_names(original)
    if len(args) > len(names):
        raise TypeError(f"generate() takes at most {len(names)} positional arguments, got {len(args)}")
    out = dict(kwargs)
    for name, value in zip(names, args, strict=False):
        if name in out:
            raise TypeError(f"generate() got multiple values for argument {name!r}")
        out[name] = value
    return out


def _effective_config(model, kwargs: dict):
    """The GenerationConfig this call runs with: keywords over the config object over the model's defaults
    over transformers' global defaults (generate's own precedence).

    Without a config object (the common case) a shallow copy of the model's defaults, its unset fields
    filled from the global defaults: generate's `_prepare_generation_config` deep-copies and re-serializes
    the configs (most of a millisecond, before the first step can start); generate itself still runs it,
    with its legacy checks. A config object goes through that function, with the model's defaults as base.
    """
    base = kwargs.get("generation_config")
    if base is None:
        config = copy.copy(model.generation_config)
        for name, value in config._get_default_generation_params().items():
            if getattr(config, name, None) is None:
                setattr(config, name, value)
    else:
        config, _ = model._prepare_generation_config(base)
    config.update(**{key: value for key, value in kwargs.items() if key != "generation_config"})
    return config


def prepare_generation_config(original: Callable, model, args: tuple, kwargs: dict):
    """Generate's `_prepare_generation_config`, with the settings a radix call in this context takes over
    unset (the model's defaults and every other thread's view stay untouched)."""
    config, model_kwargs = original(model, *args, **kwargs)
    for name in _taken_over.get():
        setattr(config, name, None)
    return config, model_kwargs


def _check_supported(model, config, kwargs: dict) -> None:
    """Raises a ValueError naming the alternative for everything the radix path cannot do."""
    if model.config.is_encoder_decoder:
        raise ValueError("cache_implementation='radix' supports decoder-only models")
    check_inputs(model, kwargs)
    mode = getattr(config.get_generation_mode(kwargs.get("assistant_model")), "value", None)
    if mode not in _SUPPORTED_MODES:
        if mode is not None and "beam" in mode:
            raise ValueError(
                "cache_implementation='radix' does not support beam search (num_beams > 1); use num_beams=1 "
                "(greedy, or do_sample=True with num_return_sequences for several answers), or drop "
                "cache_implementation='radix' to run beam search on the default cache"
            )
        if mode == "assisted_generation":
            raise ValueError(
                "cache_implementation='radix' does not support assisted decoding (assistant_model, "
                "prompt_lookup_num_tokens, assistant_early_exit); drop those arguments, or drop "
                "cache_implementation='radix' to run assisted decoding on the default cache"
            )
        raise ValueError(
            f"cache_implementation='radix' supports greedy decoding and sampling, not {mode!r}; use those, "
            "or drop cache_implementation='radix' to use the default cache"
        )
    if config.use_cache is False:
        raise ValueError(
            "cache_implementation='radix' is a KV cache and needs use_cache=True; drop use_cache=False, or "
            "drop cache_implementation='radix' to generate without a cache"
        )
    if config.output_attentions or config.output_hidden_states:
        raise ValueError(
            "cache_implementation='radix' cannot return attentions or hidden states (its attention computes "
            "neither); drop output_attentions / output_hidden_states, or use the default cache"
        )
    if any(kwargs.get(name) is not None for name in ("past_key_values", "cache", "cache_params")):
        raise ValueError(OWN_CACHE_MESSAGE)


def _sequences(result) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result
    return getattr(result, "sequences", None)


def _route_forward(model: torch.nn.Module, cache: RadixGenerateCache) -> Callable[[], None]:
    """Sends the model's forward through `cache.forward` (signature kept); returns the undo."""
    own = vars(model)
    had, previous = "forward" in own, own.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return cache.forward(model, inner, args, kwargs)

    model.forward = forward

    def restore() -> None:
        if had:
            model.forward = previous
        else:
            own.pop("forward", None)

    return restore


def _radix_generate(original, model, kwargs: dict):
    """Runs `original` generate with a RadixGenerateCache routing the model's forward; always cleans up."""
    config = _effective_config(model, kwargs)
    _check_supported(model, config, kwargs)
    engine = get_engine(model)
    dropout = engine.state.active_dropout()
    if dropout is not None:  # random K/V: nothing to reuse, and plain generate is what the user expects
        logger.warning_once(
            f"hf_radix: the model is in training mode with active dropout ({dropout}); "
            "generate(cache_implementation='radix') runs plain generate without the prefix cache"
        )
        return original(model, **{**kwargs, "cache_implementation": "dynamic"})
    cache = RadixGenerateCache(
        engine,
        token_id_list(config.eos_token_id),
        max_new_tokens=config.max_new_tokens,
        max_length=config.max_length,
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
        num_return_sequences=config.num_return_sequences or 1,
        logits_to_keep=engine.takes_logits_to_keep,
    )
    # generate must not see what the radix path takes over: not in keywords, not in a config object (a
    # copy; the user's stays untouched), not from the model's defaults (unset in this context only).
    call = {key: value for key, value in kwargs.items() if key not in _TAKEN_OVER}
    if call.get("generation_config") is not None:
        call["generation_config"] = copy.deepcopy(call["generation_config"])
        for name in _TAKEN_OVER:
            setattr(call["generation_config"], name, None)
    call[engine.cache_kwarg] = cache
    with engine.lock:  # another thread's radix call on this engine finishes first
        if engine.generating:  # the same thread, inside its own call (another thread waits for the lock)
            raise RuntimeError(
                "another generate(cache_implementation='radix') is running on this model; run the calls "
                "one after another or pass the prompts as one batch"
            )
        engine.generating = True
        result = None
        token = _taken_over.set(_TAKEN_OVER)
        try:
            try:
                engine.sync_model_state()  # K/V of other weights dropped; the adapter set's namespace
                if engine.options.warm_up:
                    engine.model_runner.ensure_warm()  # once per engine: graphs and kernels before any step
                cache.prefill_ahead(call)  # first: the GPU computes while generate sets up
                restore_forward = _route_forward(model, cache)
                try:
                    with engine.radix_attention():
                        result = original(model, **call)
                finally:
                    restore_forward()
            finally:
                cache.finish(_sequences(result))
        finally:
            _taken_over.reset(token)
            engine.generating = False
    return result


def maybe_radix_generate(original: Callable, model, args: tuple, kwargs: dict):
    """Runs `original` generate; through the radix path when the call asks for the "radix" cache.

    A finished radix call's returned `past_key_values` passed back (transformers' continuation idiom)
    continues through the prefix cache, which already holds that conversation.
    """
    for name in ("past_key_values", "cache"):
        past = kwargs.get(name)
        ours = isinstance(past, RadixGenerateCache) and past.engine is getattr(model, ENGINE_ATTR, None)
        if ours and past.finished:
            kwargs = {key: value for key, value in kwargs.items() if key != name}
            kwargs["cache_implementation"] = CACHE_IMPLEMENTATION
    if _requested_cache_implementation(model, args, kwargs) != CACHE_IMPLEMENTATION:
        return original(model, *args, **kwargs)
    return _radix_generate(original, model, _as_keywords(original, args, kwargs))


def register_generate_support() -> None:
    """Makes "radix" a valid `cache_implementation` and routes such `generate` calls here (idempotent).

    Touches transformers in three places only: the tuple of valid cache implementations, a thin wrapper
    around `GenerationMixin.generate` that passes every other call through unchanged, and one around
    `GenerationMixin._prepare_generation_config` that unsets, in a radix call's own context only, the
    settings the radix path takes over.
    """
    from transformers.generation import configuration_utils as gen_config
    from transformers.generation.utils import GenerationMixin

    if CACHE_IMPLEMENTATION not in gen_config.ALL_CACHE_IMPLEMENTATIONS:
        gen_config.ALL_CACHE_IMPLEMENTATIONS = (*gen_config.ALL_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION)
    if getattr(GenerationMixin.generate, "_hf_radix", False):
        return
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        return maybe_radix_generate(original, self, args, kwargs)

    generate._hf_radix = True
    GenerationMixin.generate = generate
    original_prepare = GenerationMixin._prepare_generation_config

    @functools.wraps(original_prepare)
    def _prepare_generation_config(self, *args, **kwargs):
        return prepare_generation_config(original_prepare, self, args, kwargs)

    GenerationMixin._prepare_generation_config = _prepare_generation_config
