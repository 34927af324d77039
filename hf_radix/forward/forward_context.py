"""What the radix forward running in this thread (or task) is: context variables, never process-wide state.

Two things reach the model code through the context rather than through the model or its arguments:

- the configs that read `_attn_implementation == "radix"`: a radix call switches only its own context to
  the "radix" attention, so a plain `forward`/`generate` of the same model in another thread keeps the
  model's own attention;
- the `RadixCache` of the forward in progress, whose batch metadata the "radix" attention function reads,
  so models whose attention drops unknown keyword arguments work too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedConfig

if TYPE_CHECKING:
    from ..cache_utils import RadixCache

ATTENTION_NAME = "radix"

_radix_configs: ContextVar[frozenset[int]] = ContextVar("hf_radix_radix_configs", default=frozenset())
_forward_cache: ContextVar[RadixCache | None] = ContextVar("hf_radix_forward_cache", default=None)


def _context_aware(prop: property) -> property:
    """`prop` (a config's `_attn_implementation`) reading "radix" for the configs this context switched."""
    read = prop.fget

    def fget(config):
        if id(config) in _radix_configs.get():
            return ATTENTION_NAME
        return read(config)

    fget.hf_radix_context_aware = True
    return property(fget, prop.fset, prop.fdel, prop.__doc__)


def _install_override(config_class: type) -> None:
    """Makes `config_class._attn_implementation` context-aware where it is defined (idempotent)."""
    for owner in config_class.__mro__:
        prop = owner.__dict__.get("_attn_implementation")
        if prop is None:
            continue
        if not isinstance(prop, property):
            raise TypeError(f"{owner.__name__}._attn_implementation is no property")
        if not getattr(prop.fget, "hf_radix_context_aware", False):
            owner._attn_implementation = _context_aware(prop)
        return
    raise TypeError(f"{config_class.__name__} has no _attn_implementation; hf_radix cannot switch it")


def attention_configs(model: torch.nn.Module) -> frozenset[int]:
    """Ids of every config the model's code may read the attention implementation from.

    The model's config and its sub-configs, and any other config object a module holds; each one's class
    gets the context-aware `_attn_implementation` (a plain read outside radix contexts).
    """
    found: dict[int, PreTrainedConfig] = {}

    def visit(config) -> None:
        if not isinstance(config, PreTrainedConfig) or id(config) in found:
            return
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}):
            visit(getattr(config, key, None))

    visit(model.config)
    for module in model.modules():
        visit(getattr(module, "config", None))
    for config in found.values():
        _install_override(type(config))
    return frozenset(found)


@contextlib.contextmanager
def radix_attention(configs: frozenset[int]) -> Iterator[None]:
    """`configs` read the "radix" attention in this context (only) for the duration of the block."""
    token = _radix_configs.set(_radix_configs.get() | configs)
    try:
        yield
    finally:
        _radix_configs.reset(token)


@contextlib.contextmanager
def model_attention() -> Iterator[None]:
    """Inside a radix call: a pass that runs with the models' own attention (no config reads "radix")."""
    token = _radix_configs.set(frozenset())
    try:
        yield
    finally:
        _radix_configs.reset(token)


@contextlib.contextmanager
def radix_forward(cache: RadixCache) -> Iterator[None]:
    """`cache` (its engine and batch) is the forward in progress in this context for the block."""
    token = _forward_cache.set(cache)
    try:
        yield
    finally:
        _forward_cache.reset(token)


def current_forward() -> RadixCache | None:
    """The `RadixCache` of the radix forward running in this context, or None."""
    return _forward_cache.get()
