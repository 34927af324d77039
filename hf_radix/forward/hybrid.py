"""The forward layout of hybrid models (docs/hybrid.md, section 4): the model keeps hf_radix's packed
`(1, N)` sequence; only the state mixers see the step's rows as the batch dimension.

`install_row_hooks` puts a forward pre-hook on each state mixer that reshapes its input `[1, B*T, C]` to
`[B, T, C]` (every row of a step adds the same `T` tokens; a scoring request's last chunk may be shorter,
zero-padded at its end: `scheduling.admission.pads_end`) and drops its padding mask, and a forward hook that
reshapes the output back. The hooks read the rows of the radix forward in progress
(`current_forward().state_batch`) and do nothing outside radix forwards, so a plain `forward`/`generate`
of the same model is unchanged. `state_batch` builds the `StateBatch` of a step: row `i` reads and writes
its running state slot.
"""

from __future__ import annotations

import numpy as np
import torch

from ..hybrid_layers import state_mixers, state_specs
from ..memory.page_table import PADDING_ROW, to_device
from ..memory.placement import is_dispatched
from ..memory.state_pool import StateBatch, StatePool, default_state_slots
from ..options import EngineOptions
from ..paged_attention.forward_batch import StepRows
from .forward_context import current_forward

_HOOKS_ATTR = "_hf_radix_row_hooks"
_MASK_KWARGS = ("attention_mask", "mask")


def hybrid_state_pool(model: torch.nn.Module, options: EngineOptions, kv_shape, dtype: torch.dtype,
                      device: torch.device, tensor_parallel: bool) -> StatePool:
    """The pool of a hybrid model's per-request states (`state_slots` of them, or a default share of the
    K/V budget), with the row hooks installed on its state mixers. Its forwards run eagerly."""
    if tensor_parallel or is_dispatched(model):
        raise NotImplementedError(
            "hf_radix: hybrid models run on one device for now (no device map, no tensor parallel)"
        )
    specs = state_specs(model, dtype)
    num_slots = options.state_slots or default_state_slots(
        specs, options.max_total_tokens, kv_shape.bytes_per_token(dtype), options.mem_fraction, device
    )
    install_row_hooks(model)
    return StatePool(specs, num_slots, device)


class MixedStepError(RuntimeError):
    """A hybrid model's step the scheduler never makes: rows without a state slot, or a state layer's
    input that does not split into the step's rows."""


def _state() -> StateBatch | None:
    cache = current_forward()
    return None if cache is None else getattr(cache, "state_batch", None)


def _to_rows(module, args, kwargs):
    state = _state()
    if state is None:
        return None
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    rows = len(state.slots)
    if state.positions is not None:
        padded = hidden.new_zeros(rows * state.width, hidden.shape[2])
        hidden = padded.index_copy_(0, state.positions, hidden[0]).view(rows, state.width, -1)
    elif hidden.shape[0] != 1 or hidden.shape[1] % rows:
        raise MixedStepError(f"a state layer got {tuple(hidden.shape)} for {rows} rows")
    else:
        hidden = hidden.reshape(rows, hidden.shape[1] // rows, hidden.shape[2])
    kwargs = {**kwargs, "hidden_states": hidden}
    for name in _MASK_KWARGS:
        if name in kwargs:
            kwargs[name] = None  # the padding (if any) follows every row's tokens: no mask needed
    return args, kwargs


def _to_packed(module, args, kwargs, out):
    state = _state()
    if state is None:
        return None
    first = out[0] if isinstance(out, tuple) else out
    first = first.reshape(-1, first.shape[-1])
    if state.positions is not None:
        first = first.index_select(0, state.positions)
    first = first[None]
    return (first, *out[1:]) if isinstance(out, tuple) else first


def install_row_hooks(model: torch.nn.Module) -> None:
    """Hooks every state mixer of `model` (idempotent: earlier hooks are replaced)."""
    for handle in getattr(model, _HOOKS_ATTR, ()):
        handle.remove()
    handles = []
    for mixer in state_mixers(model).values():
        handles.append(mixer.register_forward_pre_hook(_to_rows, with_kwargs=True))
        handles.append(mixer.register_forward_hook(_to_packed, with_kwargs=True))
    setattr(model, _HOOKS_ATTR, tuple(handles))


def state_batch(manager, step: StepRows) -> StateBatch:
    """The state slots of `step`'s rows (each row's running slot). Rows that start a sequence next to
    continuing rows read their zeroed slot; rows shorter than the longest are padded at their end."""
    slots = [manager.row_state_slot(int(row)) for row in step.rows]
    if any(s is None for s in slots):
        raise MixedStepError("a row of a hybrid model's step has no state slot (a padding row?)")
    continuing = bool((np.asarray(step.prefix_lens) > 0).any())
    pool = manager.state_slots.pool
    new = np.asarray(step.new_lens, dtype=np.int64)
    width = int(new.max()) if len(new) else 0
    if not (new < width).any():
        return StateBatch(pool, slots, has_previous=continuing)
    starts = np.arange(len(new), dtype=np.int64) * width - (np.cumsum(new) - new)
    positions = np.repeat(starts, new) + np.arange(int(new.sum()), dtype=np.int64)
    return StateBatch(pool, slots, has_previous=continuing, width=width,
                      positions=to_device(positions, pool.device))


class GraphStates:
    """The state slots of a decode graph's rows: a static index its capture reads, loaded with the step's
    slots before each replay (a padding row: the pool's scratch slot). Every row continues a state."""

    def __init__(self, manager, max_rows: int, device: torch.device) -> None:
        self.manager = manager
        self.pool: StatePool = manager.state_slots.pool
        with torch.inference_mode(False):  # written later by calls in any grad mode
            self.static = torch.full((max_rows,), self.pool.scratch_slot, dtype=torch.int64, device=device)

    def batch(self, rows: int) -> StateBatch:
        """The `StateBatch` of a graph of `rows` rows: the first `rows` entries of the static index."""
        return StateBatch(self.pool, self.static[:rows], has_previous=True)

    def load(self, rows: np.ndarray) -> None:
        """Writes the state slots of a padded step's `rows` into the static index (without waiting)."""
        scratch, slot_of = self.pool.scratch_slot, self.manager.row_state_slot
        slots = np.array([scratch if r == PADDING_ROW else slot_of(r) for r in rows.tolist()], dtype=np.int64)
        self.static[: len(slots)].copy_(to_device(slots, self.static.device))
