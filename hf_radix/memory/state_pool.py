"""Fixed-size per-request states of hybrid and state-space layers, in preallocated slots.

A state layer (Gated DeltaNet, Mamba/Mamba2 mixer, LFM2 short convolution) keeps, per request, a
convolution window ``[channels, kernel]`` and (except LFM2) a recurrent state, whatever the number of
tokens seen. :class:`StatePool` holds, for every state layer and state kind, one tensor
``[num_slots, *shape]``; a *slot* is the place of one request's whole state across all layers.
Running requests and radix-tree snapshots take slots from the same pool: a snapshot is a slot that a
tree node holds, saved and restored with :meth:`StatePool.copy_slots`.

:class:`StateBatch` binds the slots of the rows of one forward to the ``transformers.Cache`` state API
(``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``), which
the models' own layers call; :class:`StateCacheMixin` gives a ``Cache`` subclass those methods.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..hybrid_layers import StateLayerSpec
from .page_table import to_device

__all__ = [
    "StateBatch", "StateCacheMixin", "StatePool", "StatePoolError", "default_state_slots", "host_state_slots",
]

# Without a `state_slots` option, the slots (running requests plus prefix snapshots) take this share of
# the memory budget, within these bounds (docs/hybrid.md).
STATE_POOL_SHARE = 4  # one quarter
MIN_STATE_SLOTS, MAX_STATE_SLOTS = 16, 1024
_ALIGN = 16  # bytes: each state's place in a slot


def default_state_slots(
    specs: Sequence[StateLayerSpec], max_total_tokens: int | None, kv_bytes_per_token: int,
    mem_fraction: float, device: torch.device,
) -> int:
    """State slots of a hybrid model's pool: a quarter of `mem_fraction` of the free GPU memory (off GPU, of
    the K/V budget of `max_total_tokens` tokens, else of 4 GiB) over the bytes of one slot, between 16 and
    1024. On a GPU the K/V pool is sized after it, from what is left, unless `max_total_tokens` is set."""
    per_slot = max(1, sum(s.nbytes for s in specs))
    if device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * mem_fraction)
    elif max_total_tokens is not None:
        budget = max_total_tokens * kv_bytes_per_token
    else:
        budget = 1 << 32
    return int(min(MAX_STATE_SLOTS, max(MIN_STATE_SLOTS, budget // STATE_POOL_SHARE // per_slot)))


def host_state_slots(pool: StatePool | None, host_pages: int, host_kv_bytes: int) -> int | None:
    """Snapshot slots of a host tier of `host_pages` pages holding `host_kv_bytes` of K/V: a quarter as many
    bytes, between 16 and 1024 like the GPU pool's default, and at most one per page (a snapshot ends a
    page); None without state layers."""
    if pool is None:
        return None
    share = host_kv_bytes // STATE_POOL_SHARE // pool.bytes_per_slot
    return min(host_pages, MAX_STATE_SLOTS, max(MIN_STATE_SLOTS, share))


class StatePoolError(RuntimeError):
    """Slot bookkeeping was broken: out of slots, a double free, or a slot that is not allocated."""


class StatePool:
    """Preallocated per-layer state tensors, handed out by slot.

    Args:
        specs: the state layers and the shape and dtype of each of their states
            (:func:`hf_radix.hybrid_layers.state_specs`).
        num_slots: how many requests' states (running rows plus snapshots) the pool holds.
        device: where the tensors live.
    """

    def __init__(self, specs: Sequence[StateLayerSpec], num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.specs = {s.layer_idx: s for s in specs}
        self.num_slots = num_slots
        self.device = torch.device(device)
        # One row of bytes per slot, every state a 16-byte-aligned piece of it: a slot is copied or zeroed
        # whole with one kernel, and each (layer, kind) is a strided view of its pieces.
        pieces, row_bytes = [], 0
        for spec in specs:
            for k in spec.kinds:
                nbytes = math.prod(k.shape) * k.dtype.itemsize
                pieces.append(((spec.layer_idx, k.kind), k, row_bytes, nbytes))
                row_bytes += -(-nbytes // _ALIGN) * _ALIGN
        # and one scratch slot past them (`scratch_slot`), never handed out.
        shape = (num_slots + 1, max(row_bytes, _ALIGN))
        self._rows = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self._words = self._rows.view(torch.int64)
        self.tensors: dict[tuple[int, str], torch.Tensor] = {
            key: self._rows[:, start : start + nbytes].view(k.dtype).view(num_slots + 1, *k.shape)
            for key, k, start, nbytes in pieces
        }
        # Lowest slots first, so that small workloads use a compact range.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    # ------------------------------------------------------------------------------ bookkeeping

    @property
    def scratch_slot(self) -> int:
        """A slot outside the ones handed out: what the padding rows of a captured decode step read and
        write."""
        return self.num_slots

    @property
    def layer_ids(self) -> list[int]:
        """The model layers that keep a state, in order."""
        return sorted(self.specs)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot: one request's state across all state layers (each state 16-byte aligned)."""
        return self._rows.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (the scratch slot included)."""
        return self._rows.numel()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def used_slots(self) -> frozenset[int]:
        """The allocated slots."""
        return frozenset(self._used)

    def alloc(self, n: int = 1, zero: bool = True) -> list[int]:
        """Take ``n`` free slots (zeroed unless ``zero=False``); raises :class:`StatePoolError` if short."""
        if n > len(self._free):
            raise StatePoolError(f"state pool out of slots: {n} asked, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        self._used.update(slots)
        if zero and slots:
            self.zero_slots(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Give slots back; freeing a slot that is not allocated raises :class:`StatePoolError`."""
        slots = list(slots)
        if len(set(slots)) != len(slots):
            raise StatePoolError(f"slot freed twice in one call: {slots}")
        for s in slots:
            if s not in self._used:
                raise StatePoolError(f"slot {s} is not allocated")
        for s in slots:
            self._used.remove(s)
            self._free.append(s)

    def check_integrity(self) -> None:
        """Free and used slots partition the pool."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or len(free) + len(self._used) != self.num_slots:
            raise StatePoolError(
                f"state pool bookkeeping broken: {len(self._free)} free, {len(self._used)} used, "
                f"{self.num_slots} slots"
            )

    # ------------------------------------------------------------------------------ data movement

    def _index(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Slot numbers as an index on the pool's device (sent without waiting for the device)."""
        if isinstance(slots, torch.Tensor) and slots.device == self.device:
            return slots
        return to_device(np.asarray(slots, dtype=np.int64), self.device)

    def zero_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        """Reset slots to the state of an empty sequence (all zeros)."""
        self._words.index_fill_(0, self._index(slots), 0)

    def copy_slots(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy the whole state of slots ``src`` into slots ``dst`` (snapshot save and restore)."""
        s, d = self._index(src), self._index(dst)
        if s.shape != d.shape:
            raise ValueError("copy_slots needs as many destination slots as sources")
        self._words.index_copy_(0, d, self._words.index_select(0, s))

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one slot's state into another."""
        self.copy_slots([src], [dst])

    def gather(self, layer_idx: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        """A new ``[len(slots), *shape]`` tensor holding these slots' state of one layer and kind."""
        return self.tensors[(layer_idx, kind)].index_select(0, slots)

    def scatter(self, layer_idx: int, kind: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (``[len(slots), *shape]``) into these slots' state of one layer and kind."""
        t = self.tensors[(layer_idx, kind)]
        t.index_copy_(0, slots, values.to(t.dtype))

    def state_dict(self, slots: Sequence[int]) -> dict[str, torch.Tensor]:
        """The states of ``slots`` on the host, keyed ``"<layer>.<kind>"`` (host tier, cache files)."""
        idx = self._index(slots)
        return {f"{layer}.{kind}": t.index_select(0, idx).cpu() for (layer, kind), t in self.tensors.items()}

    def load_state_dict(self, slots: Sequence[int], states: dict[str, torch.Tensor]) -> None:
        """Write states saved by :meth:`state_dict` into ``slots``; refuses mismatched layouts."""
        idx = self._index(slots)
        expected = {f"{layer}.{kind}" for layer, kind in self.tensors}
        if set(states) != expected:
            raise ValueError(f"state layout differs: {sorted(set(states) ^ expected)}")
        for (layer, kind), t in self.tensors.items():
            v = states[f"{layer}.{kind}"]
            if tuple(v.shape) != (len(idx), *t.shape[1:]) or v.dtype != t.dtype:
                raise ValueError(f"state {layer}.{kind}: got {tuple(v.shape)} {v.dtype}, "
                                 f"expected {(len(idx), *t.shape[1:])} {t.dtype}")
            t.index_copy_(0, idx, v.to(self.device))


class StateBatch:
    """The states of the rows of one forward: the transformers ``Cache`` state API over pool slots.

    Row ``i`` of the batch reads and writes slot ``slots[i]``. ``has_previous`` says whether the rows
    continue from a state (a prefix hit or an earlier chunk) or start a sequence: then the layers get
    ``None`` from ``get_*_state`` and take their prefill path, exactly as with a fresh ``DynamicCache``.
    (Fresh rows batched with continuing rows also work: their slot is zeros.) Layers update states in
    place (single-token decode) or through ``update_*_state``; :meth:`flush` writes the batch's states
    back into the slots once the forward is done.

    ``positions`` (rows of different lengths): where each of the forward's tokens, rows concatenated,
    sits in the ``[rows, width]`` layout the state layers see, the rest being zero padding at the rows'
    ends; a row shorter than ``width`` gets exact outputs but an end state that is not its own.
    """

    def __init__(self, pool: StatePool, slots: Sequence[int] | torch.Tensor, has_previous: bool,
                 width: int = 0, positions: torch.Tensor | None = None):
        self.pool = pool
        self.slots = pool._index(slots)
        self.has_previous = has_previous
        self.width = width
        self.positions = positions
        self._work: dict[tuple[int, str], torch.Tensor] = {}

    def _get(self, layer_idx: int, kind: str) -> torch.Tensor:
        key = (layer_idx, kind)
        if key not in self._work:
            self._work[key] = self.pool.gather(layer_idx, kind, self.slots)
        return self._work[key]

    def get_conv_state(self, layer_idx: int) -> torch.Tensor | None:
        """The rows' conv windows ``[B, channels, kernel]`` (``None`` for rows starting a sequence)."""
        return self._get(layer_idx, "conv") if self.has_previous else None

    def get_recurrent_state(self, layer_idx: int) -> torch.Tensor | None:
        """The rows' recurrent states (``None`` for rows starting a sequence)."""
        return self._get(layer_idx, "recurrent") if self.has_previous else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None
                          ) -> torch.Tensor:
        """Take a chunk's conv inputs ``[B, channels, T]``; return them with the cached window in front.

        Starting rows get the chunk left-padded with zeros up to the kernel size, continuing rows the
        concatenation (window, chunk); the last ``kernel`` columns become the new window.
        """
        kernel = self.pool.specs[layer_idx]
        kernel = next(k.shape[-1] for k in kernel.kinds if k.kind == "conv")
        if conv_kernel_size is not None and conv_kernel_size != kernel:
            raise ValueError(f"layer {layer_idx}: conv kernel {conv_kernel_size}, pool window {kernel}")
        if self.has_previous:
            full = torch.cat([self._get(layer_idx, "conv").to(conv_states.dtype), conv_states], dim=-1)
        elif conv_states.shape[-1] < kernel:
            full = F.pad(conv_states, (kernel - conv_states.shape[-1], 0))
        else:
            full = conv_states
        self._work[(layer_idx, "conv")] = full[..., -kernel:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Write the rows' new recurrent state, and the layer's conv window, into their slots (the layers
        call this last); return the state as the layer would read it."""
        states = recurrent_states.to(self.pool.tensors[(layer_idx, "recurrent")].dtype)
        self.pool.scatter(layer_idx, "recurrent", self.slots, states)
        self._work.pop((layer_idx, "recurrent"), None)
        conv = self._work.pop((layer_idx, "conv"), None)
        if conv is not None:
            self.pool.scatter(layer_idx, "conv", self.slots, conv)
        return states

    def flush(self) -> None:
        """Write every state this forward read or updated in place, and not written yet, into the rows'
        slots."""
        for (layer_idx, kind), t in self._work.items():
            self.pool.scatter(layer_idx, kind, self.slots, t)
        self._work.clear()


class StateCacheMixin:
    """The transformers ``Cache`` state methods, routed to a :class:`StateBatch` in ``self.state_batch``.

    Put it before the ``Cache`` base class (``class C(StateCacheMixin, DynamicCache)``). The cache's
    ``layers`` list must still hold, at each state layer, an object that is an instance of
    ``LinearAttentionCacheLayerMixin`` (transformers' masks and ``get_seq_length`` look at the layer
    types); those objects are never filled.
    """

    state_batch: StateBatch

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check_state_idx(state_idx)
        return self.state_batch.get_conv_state(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        self._check_state_idx(state_idx)
        return self.state_batch.get_recurrent_state(layer_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
                          ) -> torch.Tensor:
        self._check_state_idx(state_idx)
        return self.state_batch.update_conv_state(conv_states, layer_idx, kwargs.get("conv_kernel_size"))

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._check_state_idx(state_idx)
        return self.state_batch.update_recurrent_state(recurrent_states, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.state_batch.has_previous

    def is_recording_past(self, layer_idx: int) -> bool:
        # No speculative rollback: single-token decode may update the states in place.
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        # transformers >= 5.25: intermediate states kept for a rollback; none without one.
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        # transformers >= 5.25 counts a layer's tokens at an in-place decode step; hf_radix counts its own.
        self._check_state_idx(state_idx)

    @staticmethod
    def _check_state_idx(state_idx: int) -> None:
        if state_idx != 0:
            raise NotImplementedError("layers with more than one conv/recurrent state are not supported")
