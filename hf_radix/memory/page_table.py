"""The request→slot table: one row per running request, the pool slot of each of its token positions.

A host array and its device twin hold the same table (int32, `[rows, width]`). Slots are written once,
when they are allocated (or when a row's prefix is re-pointed at the tree's copy); a forward reads the
device table through row indices and lengths, never through re-uploaded contexts. Row 0 is reserved for
padding: every position of it is the scratch slot, so padded rows of captured graphs write there.
Each row also keeps, on the device, the next token it will compute (`next_token`): the runner writes the
token it samples there, and the next step reads it without a round trip through the host. The padding
row's is never written: 0, the id padded rows compute.

Writes land in the host table at once; the device table receives them at the next `upload` (the step's
metadata), in the same staged copy, so the writes of one step (new slots of every row, prefixes of new
rows, re-pointed duplicates) cost one copy and one scatter whatever their number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..forward.staging import HostStaging, StaticBlock

PADDING_ROW = 0
_FIRST_ROWS = 16


def to_device(values: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Copies a host array to `device` without waiting.

    On CUDA the array goes through pinned memory from torch's caching host allocator, which does not hand
    a block out again before the copy from it has completed: a staging buffer is never rewritten while a
    copy from it may be in flight.
    """
    host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PageTable:
    """Request rows → slots, on the host and on `device`; rows are recycled, lowest first."""

    def __init__(
        self, max_width: int, device: torch.device | str = "cpu", scratch_slot: int = 0,
        width: int | None = None,
    ):
        if max_width < 1:
            raise ValueError(f"page table width must be >= 1, got {max_width}")
        self.max_width = max_width  # a row's most positions (the pool's slots)
        width = min(max_width, width or max_width)
        self.width = width  # positions held now: the table widens when a row needs more
        self.device = torch.device(device)
        self.scratch_slot = scratch_slot
        self.host = np.zeros((_FIRST_ROWS, width), dtype=np.int32)
        with torch.inference_mode(False):  # written later by calls in any grad mode
            self.slots = torch.zeros((_FIRST_ROWS, width), dtype=torch.int32, device=self.device)
            self.next_token = torch.zeros(_FIRST_ROWS, dtype=torch.int64, device=self.device)
        self.host[PADDING_ROW] = scratch_slot
        self.slots[PADDING_ROW] = scratch_slot
        self.flat_slots = self.slots.view(-1)  # the device table as one run (kept with `slots`)
        self._free_rows = list(range(_FIRST_ROWS - 1, PADDING_ROW, -1))  # a stack: lowest row on top
        self.staging = HostStaging(self.device)
        self._pending: list[np.ndarray] = []  # flat positions written on the host, not yet on the device

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def open(self) -> int:
        """A free row (the table doubles when full)."""
        if not self._free_rows:
            self.reserve(2 * self.capacity - 1)
        return self._free_rows.pop()

    def reserve(self, rows: int) -> None:
        """Grows the table (host and device) to hold `rows` open rows besides the padding row."""
        old = self.capacity
        if rows + 1 <= old:
            return
        new = max(rows + 1, 2 * old)
        grown = np.zeros((new, self.width), dtype=np.int32)
        grown[:old] = self.host
        self.host = grown
        with torch.inference_mode(False):
            slots = torch.zeros((new, self.width), dtype=torch.int32, device=self.device)
            slots[:old] = self.slots
            next_token = torch.zeros(new, dtype=torch.int64, device=self.device)
            next_token[:old] = self.next_token
        self.slots, self.next_token, self.flat_slots = slots, next_token, slots.view(-1)
        self._free_rows = list(range(new - 1, old - 1, -1)) + self._free_rows

    def close(self, row: int) -> None:
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)

    def write(
        self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray, width: int | None = None
    ) -> None:
        """Sets `table[rows[i], positions[i]] = slots[i]` on the host; the device follows at `upload`.

        `width`, when given, bounds the positions (at least `positions.max() + 1`; saves computing it).
        """
        if len(slots) == 0:
            return
        self._check_width(int(positions.max()) + 1 if width is None else width)
        self.host[rows, positions] = slots
        self._pending.append(rows.astype(np.int64, copy=False) * self.width + positions)

    def _check_width(self, positions: int) -> None:
        if positions <= self.width:
            return
        if positions > self.max_width:
            raise ValueError(
                f"a request needs {positions} positions; the page table holds {self.max_width} (the KV pool)"
            )
        self._widen(min(self.max_width, max(positions, 2 * self.width)))

    def _widen(self, width: int) -> None:
        """Holds `width` positions per row from now on (host and device; pending writes re-addressed)."""
        old = self.width
        host = np.full((self.capacity, width), 0, dtype=np.int32)
        host[:, :old] = self.host
        host[PADDING_ROW] = self.scratch_slot
        with torch.inference_mode(False):
            slots = torch.zeros((self.capacity, width), dtype=torch.int32, device=self.device)
            slots[:, :old] = self.slots
            slots[PADDING_ROW] = self.scratch_slot
        self._pending = [(p // old) * width + p % old for p in self._pending]
        self.host, self.slots, self.width, self.flat_slots = host, slots, width, slots.view(-1)

    def upload(
        self, parts: list[np.ndarray], narrow: list[np.ndarray] | tuple = (), *,
        into: StaticBlock | None = None, into_parts: Sequence[np.ndarray] = (),
        into_narrow: Sequence[np.ndarray] = (),
    ) -> list[torch.Tensor]:
        """`parts` (int64) and `narrow` (int32) on the device (one staged copy, `HostStaging.upload`; with
        `into`, `into_parts` and `into_narrow` land in that static block), after the device table received
        the pending writes.

        The values sent are read from the host table now, so a position written twice since the last
        upload carries its last value in every duplicate (the scatter's order cannot matter).
        """
        static = {"into": into, "into_parts": into_parts, "into_narrow": into_narrow}
        if not self._pending:
            return self.staging.upload(parts, narrow, **static)
        flat = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        values = self.host.reshape(-1)[flat]
        position, *out = self.staging.upload([flat, *parts], [values, *narrow], **static)
        self.flat_slots.index_copy_(0, position, out.pop(len(parts)))
        return out

    def flush(self) -> None:
        """Sends the pending writes to the device table now."""
        if self._pending:
            self.upload([])

    def write_row(self, row: int, start: int, slots: np.ndarray) -> None:
        """Sets positions `start:start + len(slots)` of one row."""
        end = start + len(slots)
        self._check_width(end)
        if end == start:
            return
        self.host[row, start:end] = slots
        self._pending.append(np.arange(row * self.width + start, row * self.width + end, dtype=np.int64))

    def set_next_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Records, on the device, the token each of `rows` computes next."""
        self.next_token.index_copy_(0, rows, tokens if tokens.dtype == torch.int64 else tokens.long())

    def check(self, lengths: dict[int, int]) -> str | None:
        """A description of the first disagreement between host and device rows (`lengths`: open rows)."""
        self.flush()
        device = self.slots.cpu().numpy()
        padding = (self.host[PADDING_ROW], device[PADDING_ROW])
        if any(np.any(p != self.scratch_slot) for p in padding):
            return "the padding row of the page table no longer holds the scratch slot"
        for row, n in lengths.items():
            if not np.array_equal(device[row, :n], self.host[row, :n]):
                return f"page-table row {row} differs between the host and the device"
        open_rows = set(lengths)
        if open_rows & set(self._free_rows) or PADDING_ROW in open_rows:
            return "a running request's page-table row is also free (or the padding row)"
        return None
