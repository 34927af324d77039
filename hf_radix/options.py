"""EngineOptions: the one list of an engine's pool and backend options, their defaults, checks and docs.

`hf_radix.configure`, `RadixBatchRunner` and the lm-eval model_args take exactly these names (derived from
the fields here); docs/options.md is their table (`options_table()` writes it).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields

from .paged_attention.prefix_groups import MODES


def _option(default, doc: str):
    """A field with its one-line doc (the table in docs/options.md)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class EngineOptions:
    """Pool and backend options; fixed for the life of an engine.

    A pool sized from free GPU memory (no `max_total_tokens`) takes `mem_fraction` of what is free after an
    estimate of what the engine's CUDA graphs will take (`model_runner.graph_memory_bytes`), since they are
    captured after the pool exists.
    """

    page_size: int = _option(1, "tokens per KV page; the prefix tree shares whole pages")
    max_total_tokens: int | None = _option(None, "KV pool size in tokens (None: sized by `mem_fraction`)")
    mem_fraction: float = _option(
        0.85, "share of the free GPU memory the pool takes when `max_total_tokens` is None"
    )
    attn_backend: str = _option("auto", "attention backend: auto, triton or torch")
    store_backend: str = _option("auto", "how K/V are written into the pool: auto, triton or torch")
    cuda_graph: bool = _option(
        True,
        "replay captured graphs for decode steps and short prefills (CUDA, Triton attention; hybrid models: "
        "decode steps)",
    )
    cuda_graph_max_batch: int = _option(
        256, "decode graphs up to this many rows (a runner asking for more grows them)"
    )
    fused_ops: bool = _option(True, "Llama-style norms and rotary embeddings as single Triton kernels (CUDA)")
    warm_up: bool = _option(
        True, "the first radix call captures every graph and compiles kernels (else each on first use)"
    )
    shared_prefix: bool = _option(
        True, "decode reads a prefix shared by rows once per group (Triton, where a cost rule expects a "
        "gain; deterministic: once per tile of rows, the same results)"
    )
    shared_prefix_mode: str = _option(
        "overlap", "shared-prefix launch order: overlap (beside the suffix launch, then merged) or fold"
    )
    host_cache_tokens: int | None = _option(
        None, "host-memory tier for evicted pages, in tokens (None or 0: off)"
    )
    host_cache_gb: float | None = _option(None, "or the host-memory tier's size in GB")
    state_slots: int | None = _option(
        None, "hybrid models: state slots for running requests and prefix snapshots (None: a quarter of the "
        "free GPU memory's `mem_fraction`, 16 to 1024)"
    )
    state_snapshot_interval: int = _option(
        4096, "hybrid models: also snapshot a long prompt's state every this many tokens (0: only at branch "
        "points and prompt ends)"
    )
    deterministic: bool = _option(
        False, "batch-invariant forward: a request's tokens and log-likelihoods are bit-identical whatever "
        "else runs with it (docs/deterministic.md)"
    )

    def __post_init__(self):
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.state_slots is not None and self.state_slots < 1:
            raise ValueError(f"state_slots must be >= 1 or None, got {self.state_slots}")
        if self.state_snapshot_interval < 0:
            raise ValueError(f"state_snapshot_interval must be >= 0, got {self.state_snapshot_interval}")
        if self.shared_prefix_mode not in MODES:
            raise ValueError(f"shared_prefix_mode must be one of {MODES}, got {self.shared_prefix_mode!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in field order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def check_names(cls, names: Iterable[str], where: str = "hf_radix.configure", others=()) -> None:
        """Raises TypeError for names that are not engine options (nor `others`, the caller's own), listing
        the ones that are."""
        unknown = sorted(set(names) - set(cls.names()) - set(others))
        if unknown:
            own = f"; its own: {', '.join(others)}" if others else ""
            raise TypeError(
                f"{where}: unknown option(s) {unknown}; engine options (docs/options.md): "
                f"{', '.join(cls.names())}{own}"
            )

    @classmethod
    def convert(cls, name: str, value):
        """`value` of option `name` in its field's type: a command-line string ('16', 'false', 'none') is
        converted; other values are returned as they are (the dataclass checks them)."""
        cls.check_names([name])
        if not isinstance(value, str):
            return value
        kinds = typing.get_args(_hints(cls)[name]) or (_hints(cls)[name],)
        text = value.strip()
        if type(None) in kinds and text.lower() in ("none", "null", ""):
            return None
        kind = next(k for k in kinds if k is not type(None))
        if kind is bool:
            flags = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            if text.lower() in flags:
                return flags[text.lower()]
        elif kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        else:
            return text
        raise ValueError(f"engine option {name}={value!r}: expected {_type_name(kinds)}")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _type_name(kinds: tuple) -> str:
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def options_table() -> str:
    """The Markdown table of engine options (name, type, default, doc): docs/options.md holds it."""
    hints = _hints(EngineOptions)
    rows = ["| option | type | default | what it does |", "| --- | --- | --- | --- |"]
    for f in fields(EngineOptions):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        default = None if f.default is MISSING else f.default
        rows.append(f"| `{f.name}` | {_type_name(kinds)} | `{default!r}` | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"
