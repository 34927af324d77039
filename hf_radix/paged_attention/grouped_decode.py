"""Deterministic mode's decode tiles: rows sharing a tree node compute its whole pieces once, bit for bit.

The rows of a group (`shared_decode.tree_groups`, the groups shared-prefix decode uses) go into tiles of
up to ``BLOCK_M // GROUP`` rows, each tile with the shared prefix's whole ``PIECE``-key pieces; every other
row gets a tile of its own. The split decode kernels (:mod:`hf_radix.kernels.triton_split_decode`) compute
a tile's shared pieces once for its rows and every other piece per row, and give each row the result the
extend kernel gives it, so the tiles change what is read, never a result: no cost rule. The tables are
built on the host when the batch's membership changes (`DecodePlanner`) and nothing in them moves with a
step: the kernels read each row's slot range from the batch's ``kv_indptr``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .shared_decode import DecodePlanner, SharedPrefixDecode, decode_cost, tree_groups

if TYPE_CHECKING:
    from ..forward.engine_view import ForwardEngine
    from ..memory.radix_tree import MatchHandle
    from .forward_batch import StepRows


def build_decode_tiles(node_ids: np.ndarray, shared_lens: np.ndarray, rows_per_tile: int,
                       piece: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiles of a decode batch from its rows' tree groups (`tree_groups`): (rows ``[tiles,
    rows_per_tile]``, -1 past a tile's last; shared pieces ``[tiles]``; each row's tile's pieces ``[rows]``),
    int32.

    The rows naming one node whose prefix holds a whole ``piece``-key piece fill tiles in batch order, each
    with ``shared_len // piece`` pieces; then every other row alone, with none. At most a tile a row.
    """
    node_ids = np.asarray(node_ids, dtype=np.int64)
    pieces = np.asarray(shared_lens, dtype=np.int64) // piece
    grouped = np.flatnonzero((node_ids >= 0) & (pieces > 0))
    grouped = grouped[np.argsort(node_ids[grouped], kind="stable")]
    firsts = np.flatnonzero(np.diff(node_ids[grouped], prepend=-1))  # where each group starts in `grouped`
    sizes = np.diff(np.append(firsts, len(grouped)))
    place = np.arange(len(grouped)) - np.repeat(firsts, sizes)  # each row's place in its group
    group_tiles = -(-sizes // rows_per_tile)
    tile = np.repeat(np.cumsum(group_tiles) - group_tiles, sizes) + place // rows_per_tile
    alone = np.setdiff1d(np.arange(len(node_ids)), grouped)
    num_grouped = int(group_tiles.sum())
    rows = np.full((num_grouped + len(alone), rows_per_tile), -1, dtype=np.int32)
    rows[tile, place % rows_per_tile] = grouped
    rows[num_grouped:, 0] = alone
    tile_pieces = np.zeros(len(rows), dtype=np.int32)
    tile_pieces[tile] = pieces[grouped]
    row_pieces = np.zeros(len(node_ids), dtype=np.int32)
    row_pieces[grouped] = pieces[grouped]
    return rows, tile_pieces, row_pieces


@dataclass(frozen=True)
class DecodeTiles:
    """The tile tables a decode batch's split attention reads (`ForwardBatch.shared_prefix`): views of
    static buffers (see `build_decode_tiles`), the row table covering every row the buffers hold."""

    rows: torch.Tensor  # [tiles, rows a tile] int32
    pieces: torch.Tensor  # [tiles] int32
    row_pieces: torch.Tensor  # [rows] int32

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rows, self.pieces, self.row_pieces

    def refresh(self, kv_indptr: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Nothing moves with a step: the kernels read each row's slot range from ``kv_indptr``."""


class TileBuffers:
    """Static device tables of up to ``max_tiles`` tiles and rows, refilled in place by `load` (a captured
    graph replays every plan that fits). They start as every row alone: valid for any batch that fits."""

    def __init__(self, max_tiles: int, rows_per_tile: int, device: torch.device | str):
        self.max_tiles, self.rows_per_tile = max_tiles, rows_per_tile
        with torch.inference_mode(False):  # refreshed in place by calls in any grad mode
            self._data = torch.zeros(max_tiles * (rows_per_tile + 2), dtype=torch.int32, device=device)
        table = max_tiles * rows_per_tile
        self._rows = self._data[:table].view(max_tiles, rows_per_tile)
        self._pieces = self._data[table : table + max_tiles]
        self._row_pieces = self._data[table + max_tiles :]
        alone = np.full((max_tiles, rows_per_tile), -1, dtype=np.int32)
        alone[:, 0] = np.arange(max_tiles)
        none = np.zeros(max_tiles, dtype=np.int32)
        self.load(alone, none, none)

    def load(self, rows: np.ndarray, pieces: np.ndarray, row_pieces: np.ndarray) -> None:
        """Copies a plan's tables in (stream-ordered, no sync); the tiles and rows past it do nothing."""
        if len(rows) > self.max_tiles or len(row_pieces) > self.max_tiles:
            raise ValueError(f"{len(rows)} tiles exceed the buffers' {self.max_tiles}")
        host = np.full((self.max_tiles, self.rows_per_tile), -1, dtype=np.int32)
        host[: len(rows)] = rows
        pad = lambda t: np.concatenate([t, np.zeros(self.max_tiles - len(t), dtype=np.int32)])  # noqa: E731
        staged = torch.from_numpy(np.concatenate([host.reshape(-1), pad(pieces), pad(row_pieces)]))
        if self._data.device.type == "cuda":
            staged = staged.pin_memory()
        self._data.copy_(staged, non_blocking=True)

    def tiles(self, count: int) -> DecodeTiles:
        """The first ``count`` tiles (what a launch of ``count`` tile slots reads)."""
        return DecodeTiles(self._rows[:count], self._pieces[:count], self._row_pieces)


class GroupedDecode(DecodePlanner):
    """Plans deterministic decode batches of one engine into tiles (static buffers for ``max_rows`` rows).

    A plan exists where some tile shares a whole piece; otherwise every row's pieces run alone (the same
    results). ``grow``: a batch past the capacity gets larger buffers (eager use; graphs keep theirs).
    ``captured``: the attention runs in CUDA graphs, which launch a tile a (padded) row.
    """

    def __init__(self, engine: ForwardEngine, rows_per_tile: int, piece: int, max_rows: int, *,
                 grow: bool = False, captured: bool = False):
        super().__init__(engine)
        self.rows_per_tile, self.piece = rows_per_tile, piece
        self.grow, self.captured = grow, captured
        self.buffers = TileBuffers(max_rows, rows_per_tile, engine.device)

    def _plan(self, step: StepRows, handles: list[MatchHandle | None]) -> DecodeTiles | None:
        tables = build_decode_tiles(*tree_groups(handles), self.rows_per_tile, self.piece)
        if not tables[1].any():
            return None
        return self._load(tables, step.batch_size)

    def _load(self, tables: tuple[np.ndarray, np.ndarray, np.ndarray], batch_size: int) -> DecodeTiles | None:
        if batch_size > self.buffers.max_tiles:
            if not self.grow:
                return None
            self.buffers = TileBuffers(1 << (batch_size - 1).bit_length(), self.rows_per_tile,
                                       self.engine.device)
        self.buffers.load(*tables)
        return self.buffers.tiles(batch_size if self.captured else len(tables[0]))

    def graph_share(self, rows: int) -> DecodeTiles:
        return self.buffers.tiles(rows)

    def warm_up_plans(self, step: StepRows, prefix_len: int) -> Iterator[DecodeTiles]:
        rows = step.batch_size
        tables = build_decode_tiles(np.zeros(rows), np.full(rows, prefix_len), self.rows_per_tile, self.piece)
        self._rows = None  # the next `share` plans afresh
        yield self._load(tables, rows)


def decode_planner(engine: ForwardEngine, max_rows: int, *, grow: bool = False,
                   captured: bool = False) -> DecodePlanner | None:
    """The planner of an engine's decode batches whose rows share prefixes: deterministic mode's tiles, else
    shared-prefix decode (`shared_decode`); None where neither applies (MLA latents; a tile of one row)."""
    if engine.options.deterministic:
        from ..kernels.triton_split_decode import tile_shape

        shape = engine.pool.shape
        heads = engine.model.config.get_text_config(decoder=True).num_attention_heads
        rows_per_tile, piece = tile_shape(heads, shape.num_kv_heads, shape.head_dim, engine.device)
        if rows_per_tile < 2:
            return None
        return GroupedDecode(engine, rows_per_tile, piece, max_rows, grow=grow, captured=captured)
    cost = decode_cost(engine)
    return None if cost is None else SharedPrefixDecode(engine, cost, max_rows, grow=grow, captured=captured)
