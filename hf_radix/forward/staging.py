"""Host→device staging: one copy per upload through a ring of reused pinned buffers.

Every step sends a few host arrays (new page-table entries, the step's metadata) to the device. Pinning a
fresh tensor per array costs tens of microseconds each; here the arrays of one upload are packed into one
pinned buffer of a small ring and sent with one asynchronous copy. A buffer is rewritten only after the
event recorded behind its last copy has completed, so a copy still in flight never sees new data (in
steady state that event is long done: the ring holds several steps' uploads).

An upload may also fill a `StaticBlock`: arrays at addresses fixed by their sizes (a captured CUDA graph's
inputs), sent from the same pinned buffer, so a graph's metadata lands where the graph reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING = 8  # pinned buffers; a step makes one to three uploads
MAX_LAYOUTS = 32  # packed layouts kept by their arrays' sizes
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


class PackedLayout:
    """Where one upload packs its arrays: int64 arrays of `sizes`, then int32 arrays of `narrow_sizes` (in
    the buffer's last words), each `ALIGN_BYTES`-aligned; `total` int64 words in all (a whole number of
    aligned units, so whatever follows is aligned too)."""

    def __init__(self, sizes: Sequence[int], narrow_sizes: Sequence[int] = ()):
        self.sizes, self.narrow_sizes = list(sizes), list(narrow_sizes)
        self.offsets, self.wide = aligned_offsets(self.sizes, 8)
        self.narrow_offsets, count = aligned_offsets(self.narrow_sizes, 4)
        self.total = self.wide + count // 2

    def pack(self, host: np.ndarray, parts: Sequence[np.ndarray], narrow: Sequence[np.ndarray]) -> None:
        """Writes `parts` and `narrow` (at most the layout's sizes each) into `host` (int64, `total` long)."""
        _pack(host, self.offsets, parts, self.wide, self.narrow_offsets, narrow)

    def views(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The arrays in `packed` (int64, `total` long): int64 views, then int32 views."""
        out = aligned_views(packed, self.offsets, self.sizes)
        if self.narrow_sizes:
            out += aligned_views(packed[self.wide:].view(torch.int32), self.narrow_offsets, self.narrow_sizes)
        return out


class StaticBlock:
    """A device region holding one `PackedLayout`'s arrays at fixed addresses (`views`) at its start:
    uploads that name it copy their arrays of that layout straight there, and the rest of the upload into
    the room behind them when it fits (one copy)."""

    def __init__(self, layout: PackedLayout, block: torch.Tensor):
        if block.dtype != torch.int64 or block.numel() < layout.total:
            raise ValueError(f"a static block of {layout.total} int64s; got {block.numel()} {block.dtype}")
        self.layout = layout
        self.block = block
        self.flat = block[: layout.total]
        self.views = layout.views(self.flat)
        self._behind: tuple[PackedLayout, torch.Tensor, list[torch.Tensor]] | None = None

    def behind(self, layout: PackedLayout) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Where an upload of `layout` behind the block's own lands when it fits the block (None if not):
        the block's words it is copied into, and `layout`'s views there (kept for the last layout)."""
        kept = self._behind
        if kept is None or kept[0] is not layout:
            total = self.layout.total + layout.total
            if total > self.block.numel():
                return None
            destination = self.block[:total]
            kept = self._behind = (layout, destination, layout.views(destination[self.layout.total:]))
        return kept[1], kept[2]


def _pack(
    host: np.ndarray, offsets: Sequence[int], parts: Sequence[np.ndarray], wide: int,
    narrow_offsets: Sequence[int], narrow: Sequence[np.ndarray],
) -> None:
    for offset, part in zip(offsets, parts):
        host[offset:offset + len(part)] = part
    if narrow:
        words = host[wide:].view(np.int32)
        for offset, part in zip(narrow_offsets, narrow):
            words[offset:offset + len(part)] = part


class HostStaging:
    """Uploads int64 (and int32) host arrays to `device`; off CUDA the packed array itself is returned (no
    copy made)."""

    def __init__(self, device: torch.device | str, ring: int = RING):
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * ring
        self._hosts: list[np.ndarray | None] = [None] * ring  # the buffers' numpy views
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0
        self.uploads = 0
        self._layouts: dict[tuple[tuple[int, ...], tuple[int, ...]], PackedLayout] = {}  # by the sizes

    def upload(
        self, parts: Sequence[np.ndarray], narrow: Sequence[np.ndarray] = (), *,
        into: StaticBlock | None = None, into_parts: Sequence[np.ndarray] = (),
        into_narrow: Sequence[np.ndarray] = (),
    ) -> list[torch.Tensor]:
        """`parts` (int64 after conversion), then `narrow` (int32), on the device, one tensor each, sent
        as one packed copy (the int32 values share the packed buffer's last words: no cast on the device).
        Every tensor starts `ALIGN_BYTES`-aligned.

        With `into`, `into_parts` and `into_narrow` (of its layout's sizes, or shorter: the rest of such an
        array is left undefined) land in that static block, from the same pinned buffer; the returned tensors
        are those of `parts` and `narrow` alone, in the block's room behind the layout when they fit there
        (one copy in all; valid until the next upload into the block) or sent beside it.
        """
        layout = self._layout(tuple(map(len, parts)), tuple(map(len, narrow)))
        start = 0 if into is None else into.layout.total
        total = start + layout.total
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
                self._hosts[slot] = buffer.numpy()
            host = self._hosts[slot]
            source = buffer[:total]
        else:
            host = np.empty(total, dtype=np.int64)  # returned as is: never reused
            source = torch.from_numpy(host)
        if into is not None:
            into.layout.pack(host, into_parts, into_narrow)
        layout.pack(host[start:], parts, narrow)
        if into is None:
            out = layout.views(source.to(self.device, non_blocking=True))  # off CUDA: `source` itself
        elif (behind := into.behind(layout)) is not None:
            destination, views = behind
            destination.copy_(source, non_blocking=True)
            out = list(views)
        else:
            into.flat.copy_(source[:start], non_blocking=True)
            out = layout.views(source[start:].to(self.device, non_blocking=True))
        if cuda:
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the stream the copies were queued on
        return out

    def _layout(self, sizes: tuple[int, ...], narrow_sizes: tuple[int, ...]) -> PackedLayout:
        """The packed layout of arrays of these sizes, made once per sizes (a steady decode step's repeat)."""
        key = (sizes, narrow_sizes)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:  # prefill chunks' sizes vary: keep few
                self._layouts.clear()
            layout = self._layouts[key] = PackedLayout(sizes, narrow_sizes)
        return layout
