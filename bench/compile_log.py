"""What Triton compiles while a block of code runs: kernel names, compile seconds, variants added.

Cold-start accounting for benchmarks and tests: a first run in a fresh process should compile nothing
that warm-up did not (`RadixBatchRunner` warms up when built). :class:`CompileLog` listens to Triton's
compilation hook (``triton.knobs.compilation.listener``, Triton >= 3.4) for compile times and counts each
hf_radix kernel's compiled variants before and after (``JITFunction.device_caches``), so it works where
the hook does not exist too (counts only).
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_MODULES = ("store", "triton_decode", "triton_extend", "triton_norm_rope", "triton_sampling",
            "triton_shared_prefix_kernels", "triton_attention_common", "triton_slots")


def _jit_kernels() -> dict[str, Any]:
    """hf_radix's Triton kernels (JIT functions launched from the host), by name."""
    import triton

    kernels = {}
    for name in _MODULES:
        try:
            module = importlib.import_module(f"hf_radix.kernels.{name}")
        except ImportError:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and attr.endswith("_kernel"):
                kernels[attr] = value
    return kernels


def _variant_keys() -> dict[str, set[str]]:
    """The specialization keys of each hf_radix kernel's compiled variants (all devices)."""
    keys: dict[str, set[str]] = {}
    for name, fn in _jit_kernels().items():
        caches = getattr(fn, "device_caches", None)
        if caches is not None:  # Triton 3.2+: the first entry of each device's tuple is its kernel cache
            keys[name] = {str(key) for cache in caches.values() for key in cache[0]}
    return keys


@dataclass
class CompileLog:
    """Use as ``with CompileLog() as log: ...``; then ``log.summary()``."""

    compiles: list[tuple[str, float]] = field(default_factory=list)  # (kernel, seconds), cache misses
    disk_hits: int = 0  # variants loaded from Triton's on-disk cache (compiled by an earlier process)
    new_variants: dict[str, list[str]] = field(default_factory=dict)  # kernel -> specialization keys
    _before: dict[str, set[str]] = field(default_factory=dict, repr=False)
    _knobs: Any = field(default=None, repr=False)
    _previous: Any = field(default=None, repr=False)

    def __enter__(self) -> CompileLog:
        self._before = _variant_keys()
        try:
            from triton import knobs
        except ImportError:
            knobs = None
        if knobs is not None and hasattr(getattr(knobs, "compilation", None), "listener"):
            self._knobs, self._previous = knobs, knobs.compilation.listener
            knobs.compilation.listener = self._listen
        return self

    def _listen(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit)
        if cache_hit:
            self.disk_hits += 1
        else:
            name = getattr(getattr(src, "fn", None), "__name__", str(src))
            self.compiles.append((name, times.total / 1e6))

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._previous
        gained = {k: sorted(keys - self._before.get(k, set())) for k, keys in _variant_keys().items()}
        self.new_variants = {k: keys for k, keys in gained.items() if keys}

    def summary(self) -> dict[str, Any]:
        """JSON-ready: compile seconds and count, per kernel, and the variants each kernel gained (with
        their specialization keys: what differed from the variants compiled before)."""
        seconds: Counter[str] = Counter()
        for name, s in self.compiles:
            seconds[name] += s
        return {
            "compile_s": sum(seconds.values()),
            "compiles": len(self.compiles),
            "compile_s_by_kernel": dict(seconds),
            "disk_cache_hits": self.disk_hits,
            "new_variants": {k: len(keys) for k, keys in self.new_variants.items()},
            "new_variant_keys": self.new_variants,
        }
