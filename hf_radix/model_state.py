"""What cached K/V depends on besides token ids, and whether it changed since the last radix call.

A prefix's K/V is valid only for the model state that computed it. `ModelState` watches, at the start of
every radix call:

- every parameter and buffer: its identity, in-place version counter and storage address (optimizer
  steps, `load_state_dict`, `copy_`, edits under `no_grad`, `.to()`, tensors replaced, added or removed);
- optimizer steps, through torch's global step hook (fused optimizers write without bumping versions);
- the PEFT state of every adapter layer: active adapters, adapters disabled, LoRA scaling (a namespace
  of the prefix tree: each adapter set keeps its own prefixes) and merged adapters (a weights change);
- the config entries the forward reads and the model's dtype and device (a change needs a new engine).

It cannot see writes that bypass the version counter (through `tensor.data`, or a custom kernel writing
into a parameter's memory) nor plain Python attributes of modules other than PEFT's; after such a change,
call `hf_radix.reset_cache(model)`.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers import PreTrainedConfig

__all__ = ["BASE_NAMESPACE", "CONFIG_IGNORED", "ModelState", "StateCheck", "config_snapshot"]

_VERSION = attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
BASE_NAMESPACE: Hashable = None  # the model without adapters (or with every adapter disabled)

# Config entries that do not change what K/V a prompt produces.
CONFIG_IGNORED = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "pad_token_id", "eos_token_id",
    "bos_token_id", "problem_type", "chunk_size_feed_forward", "architectures",
})


class _Epochs:
    """Process-wide counters bumped by torch's global hooks (registrations into watched models, optimizer
    steps)."""

    structure = 0
    optimizer = 0
    stepped: dict[int, int] = {}  # id(parameter) -> the optimizer epoch of its last step
    watched: weakref.WeakSet = weakref.WeakSet()  # every module of every model a ModelState watches


def _on_registration(module: torch.nn.Module, *_args) -> None:
    # modules built outside a watched model (a forward's `layers[:n]` makes a new ModuleList) do not count
    if module in _Epochs.watched:
        _Epochs.structure += 1


def _on_optimizer_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    _Epochs.optimizer += 1
    epoch, stepped = _Epochs.optimizer, _Epochs.stepped
    for group in optimizer.param_groups:
        for param in group["params"]:
            stepped[id(param)] = epoch


register_module_parameter_registration_hook(_on_registration)
register_module_buffer_registration_hook(_on_registration)
register_module_module_registration_hook(_on_registration)
register_optimizer_step_post_hook(_on_optimizer_step)


def config_snapshot(config) -> dict:
    """The config entries that shape K/V (sub-configs included), as plain values to compare."""
    out = {}
    for key, value in vars(config).items():
        if key in CONFIG_IGNORED or key[:1] == "_":
            continue
        out[key] = config_snapshot(value) if isinstance(value, PreTrainedConfig) else value
    return out


def _first_floating(model: torch.nn.Module) -> torch.Tensor | None:
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's adapter layers inside `model` (none when peft was never imported)."""
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft_tuners is None:
        return []
    return [m for m in model.modules() if isinstance(m, peft_tuners.BaseTunerLayer)]


def _adapter_tensors(layers: list[torch.nn.Module]) -> dict[int, str]:
    """id -> adapter name of every tensor that belongs to an adapter (not to the base model)."""
    owners = {}
    for layer in layers:
        for name in layer.adapter_layer_names:
            container = getattr(layer, name, None)
            for adapter, part in container.items() if isinstance(container, torch.nn.ModuleDict) else ():
                owners.update((id(t), adapter) for t in (*part.parameters(), *part.buffers()))
            for adapter, t in container.items() if isinstance(container, torch.nn.ParameterDict) else ():
                owners[id(t)] = adapter
    return owners


def _dropout_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that drop activations in training mode: dropout layers and attention with a dropout rate."""
    out = []
    for name, module in model.named_modules():
        rate = getattr(module, "p", None) if isinstance(module, torch.nn.modules.dropout._DropoutNd) else (
            getattr(module, "attention_dropout", None))
        if isinstance(rate, (int, float)) and rate > 0:
            out.append((name or type(module).__name__, module))
    return out


@dataclass(frozen=True)
class StateCheck:
    """What a radix call must do before it reads the cache."""

    stale: str | None  # why the cached K/V no longer fits the model (drop it), or None
    moved: bool  # tensors were replaced or moved: captured CUDA graphs hold their old addresses
    namespace: Hashable  # the adapter set the model runs with: its prefixes are a namespace of the tree


class ModelState:
    """The state of one model that cached K/V depends on; `check()` says what changed since its last call."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = config_snapshot(model.config)
        self._optimizer = _Epochs.optimizer
        self._rebuild()
        self._snapshot()
        self.dtype = self._first.dtype if self._first is not None else None
        self.device = self._first.device if self._first is not None else None
        self._merged = self._merged_adapters()
        self._namespace_raw: tuple = ()
        self._namespace: Hashable = BASE_NAMESPACE

    # -- what needs a new engine ---------------------------------------------------------------------
    def engine_change(self) -> str | None:
        """Why the engine's pool or attention set-up no longer fits the model (dtype, device, config)."""
        first = self._first if self._structure == _Epochs.structure else _first_floating(self.model)
        if first is not None and (first.dtype, first.device) != (self.dtype, self.device):
            return f"the model moved from {self.dtype} on {self.device} to {first.dtype} on {first.device}"
        if config_snapshot(self.model.config) != self.config:
            return "the model's config changed"
        return None

    # -- what drops the cache or switches its namespace ----------------------------------------------
    def check(self) -> StateCheck:
        """Compares the model with the state seen at the last check; the new state becomes the seen one."""
        stale, moved = None, False
        if self._structure != _Epochs.structure:
            stale, moved = self._rebuilt_diff()
        elif (sum(map(_VERSION, self._versioned)) != self._version_sum  # versions only grow
              or tuple(map(_DATA_PTR, self._tensors)) != self._addresses):
            stale, moved = self._diff()
        if self._optimizer != _Epochs.optimizer:
            since, stepped = self._optimizer, _Epochs.stepped
            self._optimizer = _Epochs.optimizer
            if stale is None and any(stepped.get(id(t), 0) > since for t in self._tensors):
                stale = "an optimizer step updated its parameters"
        merged = self._merged_adapters()
        if merged != self._merged:
            self._merged = merged
            stale = stale or "adapters were merged into the weights or unmerged"
        return StateCheck(stale, moved, self._read_namespace())

    def active_dropout(self) -> str | None:
        """The first module that would drop activations now (the model is training), or None."""
        return next((name for name, m in self._dropouts if m.training), None)

    @property
    def num_tensors(self) -> int:
        """Parameters and buffers watched."""
        return len(self._tensors)

    def namespace_label(self) -> str:
        """The current namespace in words, for cache files: the active adapters and their scaling."""
        namespace = self._read_namespace()
        return "base model" if namespace == BASE_NAMESPACE else f"adapters {json.dumps(namespace)}"

    def inactive_adapter_tensors(self) -> set[int]:
        """Ids of the adapter tensors that the current namespace does not run (left out of its digest)."""
        active = {name for adapters, disabled, _ in self._namespace_raw if not disabled for name in adapters}
        return {key for key, adapter in self._adapter_of.items() if adapter not in active}

    # -- internals -----------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Lists the model's tensors, PEFT layers and dropout modules anew."""
        self._structure = _Epochs.structure
        tensors, names, seen = [], [], set()
        for prefix, module in self.model.named_modules():
            _Epochs.watched.add(module)
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None and id(tensor) not in seen:
                        seen.add(id(tensor))
                        tensors.append(tensor)
                        names.append(f"{prefix}.{name}" if prefix else name)
        self._tensors, self._names = tensors, names
        self._versioned = [t for t in tensors if not t.is_inference()]  # inference tensors have no version
        self._first = next((t for t in tensors if t.is_floating_point()), None)
        self._layers = _tuner_layers(self.model)
        self._adapter_of = _adapter_tensors(self._layers)
        self._dropouts = _dropout_modules(self.model)

    def _snapshot(self) -> None:
        """Remembers every tensor's (identity, version, address), and their per-call summary."""
        self._seen = [(id(t), 0 if t.is_inference() else t._version, t.data_ptr()) for t in self._tensors]
        self._version_sum = sum(version for _, version, _ in self._seen)
        self._addresses = tuple(address for *_, address in self._seen)

    def _diff(self) -> tuple[str, bool]:
        """The reason and whether storage moved, for a change among the same tensors."""
        before = self._seen
        self._snapshot()
        changed = [i for i, (old, new) in enumerate(zip(before, self._seen)) if old != new]
        moved = any(before[i][2] != self._seen[i][2] for i in changed)
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        return f"{self._names[changed[0]]} changed{more}", moved

    def _rebuilt_diff(self) -> tuple[str | None, bool]:
        """Re-lists the tensors after a structural change and compares them with those seen before."""
        before = {entry[0]: entry for entry in self._seen}
        self._rebuild()
        self._snapshot()
        now = self._seen
        gone = set(before) - {entry[0] for entry in now}
        moved = bool(gone) or any(before[e[0]][2] != e[2] for e in now if e[0] in before)
        if gone:
            return "parameters or buffers were replaced or removed", moved
        if moved or any(before[e[0]] != e for e in now if e[0] in before):
            return "parameters or buffers changed in place", moved
        if any(e[0] not in before and e[0] not in self._adapter_of for e in now):
            return "parameters or buffers were added to the model", moved
        return None, False

    def _merged_adapters(self) -> tuple:
        return tuple(tuple(layer.merged_adapters) for layer in self._layers)

    def _read_namespace(self) -> Hashable:
        """The adapter set every PEFT layer runs with now: BASE_NAMESPACE without adapters."""
        raw = tuple(
            (tuple(layer.active_adapters), layer.disable_adapters, _scaling(layer)) for layer in self._layers
        )
        if raw != self._namespace_raw:
            self._namespace_raw = raw
            active = any(not disabled and adapters for adapters, disabled, _ in raw)
            self._namespace = raw if active else BASE_NAMESPACE
        return self._namespace


def _scaling(layer: torch.nn.Module) -> tuple:
    scaling = getattr(layer, "scaling", None)
    if not isinstance(scaling, dict):
        return ()
    return tuple(scaling.get(name) for name in layer.active_adapters)
