"""Host→device staging: one copy per upload through a ring of reused pinned buffers.

Every step sends a few host arrays (new page-table entries, the step's metadata) to the device. Pinning a
fresh tensor per array costs tens of microseconds each; here the arrays of one upload are packed into one
pinned buffer of a small ring and sent with one asynchronous copy. A buffer is rewritten only after the
event recorded behind its last copy has completed, so a copy still in flight never sees new data (in
steady state that event is long done: the ring holds several steps' uploads).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING = 8  # pinned buffers; a step makes one to three uploads
# Every array handed to a kernel starts on a 16-byte boundary: Triton compiles a variant per alignment of
# its pointer arguments, so views at offsets that follow the batch's sizes would compile new variants.
ALIGN_BYTES = 16


def aligned_offsets(sizes: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Start of each of `sizes` consecutive arrays in one buffer, each `ALIGN_BYTES`-aligned; the total."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // step) * step
    return offsets, total


def aligned_views(flat: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
    """The arrays `aligned_offsets` laid out in `flat`."""
    return [flat[o:o + n] for o, n in zip(offsets, sizes)]


class HostStaging:
    """Uploads int64 (and int32) host arrays to `device`; off CUDA the packed array itself is returned (no
    copy made)."""

    def __init__(self, device: torch.device | str, ring: int = RING):
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * ring
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0
        self.uploads = 0

    def upload(self, parts: Sequence[np.ndarray], narrow: Sequence[np.ndarray] = ()) -> list[torch.Tensor]:
        """`parts` (int64 after conversion), then `narrow` (int32), on the device, one tensor each, sent
        as one packed copy (the int32 values share the packed buffer's last words: no cast on the device).
        Every tensor starts `ALIGN_BYTES`-aligned.
        """
        sizes, narrow_sizes = [len(p) for p in parts], [len(p) for p in narrow]
        offsets, wide = aligned_offsets(sizes, 8)
        narrow_offsets, count = aligned_offsets(narrow_sizes, 4)
        total = wide + count // 2  # `count` is a whole number of aligned int64 pairs' worth of int32s
        self.uploads += 1
        cuda = self.device.type == "cuda"
        if cuda:
            slot = self._next
            self._next = (slot + 1) % len(self._buffers)
            event = self._events[slot]
            if event is not None:
                event.synchronize()  # the last copy out of this buffer has completed (almost always long ago)
            buffer = self._buffers[slot]
            if buffer is None or buffer.numel() < total:
                size = max(total, 2 * (0 if buffer is None else buffer.numel()), 1024)
                buffer = self._buffers[slot] = torch.empty(size, dtype=torch.int64, pin_memory=True)
            host = buffer.numpy()[:total]
        else:
            host = np.empty(total, dtype=np.int64)  # returned as is: never reused
        for offset, part in zip(offsets, parts):
            host[offset:offset + len(part)] = part
        words = host[wide:].view(np.int32)
        for offset, part in zip(narrow_offsets, narrow):
            words[offset:offset + len(part)] = part
        if cuda:
            packed = buffer[:total].to(self.device, non_blocking=True)
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
        else:
            packed = torch.from_numpy(host)
        out = aligned_views(packed, offsets, sizes)
        if narrow:
            out += aligned_views(packed[wide:].view(torch.int32), narrow_offsets, narrow_sizes)
        return out
