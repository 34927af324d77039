"""The shapes CUDA graphs are captured at (padded batch sizes) and the size of their static buffers."""

from __future__ import annotations

from collections.abc import Sequence

from ..paged_attention.forward_batch import GraphInputs

EXTEND_TOKEN_BUCKETS = (16, 32, 64, 128, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: powers of two up to 16, then steps of 16."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def bucket(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


def static_block_words(max_rows: int, max_tokens: int) -> int:
    """int64 words of the static block: the largest shape's layout (every array 16-byte aligned), and room
    behind it for the rest of a step's upload (page-table writes, row bases, ids' rows: a few numbers per
    row and token), so that one copy sends it all."""
    layout = GraphInputs.layout(max_rows + 1, max_tokens, max_rows + 1)
    return layout.total + 4 * (max_rows + max_tokens) + 256


def static_buffer_bytes(max_rows: int, max_tokens: int, kv_bound: int) -> int:
    """Bytes of the static metadata buffers: the static block and the slot list."""
    return 8 * (static_block_words(max_rows, max_tokens) + (max_rows + 1) * kv_bound)
