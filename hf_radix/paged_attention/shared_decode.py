"""Shared-prefix attention in decode steps: groups from the radix tree, planned when the batch changes.

Rows of a decode batch whose locked prefixes pass through one tree node form a group: the deepest node
another row of the batch also passes (every node of a locked path is locked, so it stays while they run).
Its length is page-aligned, as every node boundary is. The plan (:mod:`.prefix_groups`) is built
on the host only when the batch's membership changes -- its rows, in order, each with the lock it holds --
and loaded into static device buffers then. A step grows each row's suffix by one token; what that moves
(query positions, suffix ranges, where each context starts in the slot list) the device recomputes from
the batch's own lengths (`DecodeShare.refresh`), inside a captured graph's replay. The cost rule decides,
per membership, whether the batch reads shared prefixes once per group or every row reads its own.
`DecodePlanner` holds that lifecycle; deterministic mode plans its own tiles from the same groups
(:mod:`.grouped_decode`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from transformers.utils import logging

from ..memory.page_table import PADDING_ROW
from .prefix_groups import (
    DecodeShare,
    SharedPrefixBuffers,
    SharedPrefixCost,
    SharedPrefixPlan,
    build_shared_prefix_plan,
)

if TYPE_CHECKING:

    from ..forward.engine_view import ForwardEngine
    from ..memory.radix_tree import MatchHandle
    from .forward_batch import DecodePlan, StepRows

logger = logging.get_logger(__name__)

MAX_PREFIX_SPLITS = 8


def most_prefix_splits(mode: str) -> int:
    """The most splits a prefix gets in launch order `mode` (and the programs a captured graph launches a
    prefix tile): one beside the suffix launch ("overlap"), else `MAX_PREFIX_SPLITS`."""
    return 1 if mode == "overlap" else MAX_PREFIX_SPLITS


def tree_groups(handles: Sequence[MatchHandle | None]) -> tuple[np.ndarray, np.ndarray]:
    """(group node, shared prefix length) of each row: the deepest node of its locked path that another
    row's path passes too; (-1, 0) for a row sharing nothing (or with no handle: padding)."""
    paths: list[list[tuple[int, int]]] = []  # (node id, depth) from the row's node up, root excluded
    through: Counter[int] = Counter()
    for handle in handles:
        path = []
        if handle is not None:
            node, depth = handle.node, handle.cached_len
            while node is not None and node.parent is not None and depth > 0:
                path.append((id(node), depth))
                depth -= len(node.key)
                node = node.parent
        through.update(nid for nid, _ in path)
        paths.append(path)
    numbers: dict[int, int] = {}
    node_ids = np.full(len(handles), -1, dtype=np.int64)
    lengths = np.zeros(len(handles), dtype=np.int64)
    for i, path in enumerate(paths):
        shared = next(((nid, depth) for nid, depth in path if through[nid] > 1), None)
        if shared is not None:
            node_ids[i] = numbers.setdefault(shared[0], len(numbers))
            lengths[i] = shared[1]
    return node_ids, lengths


def prefix_splits(num_tiles: int, num_kv_heads: int, prefix_len: int, num_sms: int) -> int:
    """Splits of each prefix tile: at most one wave of programs, at least 256 keys each, a power of two."""
    want = max(1, min(num_sms // max(1, num_tiles * num_kv_heads), -(-prefix_len // 256), MAX_PREFIX_SPLITS))
    return 1 << (want.bit_length() - 1)


def decode_cost(engine: ForwardEngine) -> SharedPrefixCost | None:
    """The cost rule at the engine's attention shape; None where it reads no plain pool K/V (MLA)."""
    shape = engine.pool.shape
    heads = getattr(engine.model.config.get_text_config(decoder=True), "num_attention_heads", None)
    if shape.latent or not heads or heads % shape.num_kv_heads:
        return None
    return SharedPrefixCost(heads, shape.num_kv_heads, max(shape.head_dim, shape.value_dim),
                            engine.pool.dtype.itemsize, prefix_parts=2)


class DecodePlanner(abc.ABC):
    """Plans the decode batches of one engine when their membership changes (`share`, once a step).

    ``steps``: decode steps run with a plan; ``plans``: plans built. Subclasses build a plan from the
    batch's rows and their locks' tree handles (`_plan`), and give the plan a captured graph of ``rows``
    rows replays with (`graph_share`: the planner's static buffers, whatever plan they hold then).
    """

    def __init__(self, engine: ForwardEngine):
        self.engine = engine
        self.steps = 0
        self.plans = 0
        self._rows: np.ndarray | None = None
        self._handles: list[MatchHandle | None] = []
        self._lock_version = -1  # the manager's `lock_version` when `_handles` were last compared
        self._share: DecodePlan | None = None

    def share(self, step: StepRows, count: bool = True) -> DecodePlan | None:
        """The plan of a decode step (padding rows included), or None: per-row attention.
        `count=False`: the step is planned ahead (its run counts it in `steps`).

        O(1) Python work while the batch's rows are unchanged (the same read-only array, or equal ones) and
        no row's lock moved since the last call (the manager's `lock_version`); otherwise the rows' locks
        are compared and the plan rebuilt if they differ.
        """
        rows = step.rows
        manager = self.engine.manager
        same_rows = rows is self._rows or (self._rows is not None and np.array_equal(rows, self._rows))
        if not (same_rows and manager.lock_version == self._lock_version):
            handles = [None if r == PADDING_ROW else manager.row_handle(r) for r in rows.tolist()]
            if not (same_rows and all(a is b for a, b in zip(handles, self._handles))):
                # held: a lock's id is never reused meanwhile; read-only rows (a steady batch's) as they are
                self._rows, self._handles = rows if not rows.flags.writeable else rows.copy(), handles
                self.plans += 1
                self._share = self._plan(step, handles)
            self._lock_version = manager.lock_version
        if self._share is not None and count:
            self.steps += 1
        return self._share

    @abc.abstractmethod
    def _plan(self, step: StepRows, handles: list[MatchHandle | None]) -> DecodePlan | None:
        """The plan of a batch whose membership changed (its buffers loaded), or None: per-row."""

    @abc.abstractmethod
    def graph_share(self, rows: int) -> DecodePlan:
        """What a captured graph of ``rows`` (padded) rows reads: the static buffers, refilled by `share`."""

    @abc.abstractmethod
    def warm_up_plans(self, step: StepRows, prefix_len: int) -> Iterator[DecodePlan]:
        """Plans of ``step``'s rows as one group sharing their first ``prefix_len`` positions, whatever the
        tree says, each loaded as it is yielded: warm-up compiles the kernels on padding rows with them."""


class SharedPrefixDecode(DecodePlanner):
    """Plans decode batches of one engine and holds their static group buffers (sized for ``max_rows``).

    `share` rebuilds the plan only when the batch's rows (or their locks) changed. ``grow``: a batch past
    the capacity gets larger buffers (eager use; graphs keep theirs). ``captured``: the attention is
    launched inside CUDA graphs, with `graph_prefix_splits` programs a prefix tile whatever the plan's split
    count (the kernels read it from the buffers): one graph per batch size. Beside the suffix launch
    ("overlap") a prefix needs no split to fill the GPU: one, and no more programs; the other orders split
    it as `prefix_splits` says, up to `MAX_PREFIX_SPLITS`.
    """

    def __init__(self, engine: ForwardEngine, cost: SharedPrefixCost, max_rows: int, *, grow: bool = False,
                 captured: bool = False):
        super().__init__(engine)
        self.cost = cost
        self.grow = grow
        self.captured = captured
        self.mode = engine.options.shared_prefix_mode
        # the prefix launches beside the suffix launch ("overlap"): high priority, the longest programs first
        overlap = self.mode == "overlap"
        self.side_stream = engine.side_stream("shared_prefix", priority=-1) if overlap else None
        self.buffers = self._buffers(max_rows)

    def _buffers(self, rows: int) -> SharedPrefixBuffers:
        tile_q = max(1, self.cost.tile_rows // self.cost.q_heads_per_kv)
        return SharedPrefixBuffers(rows, rows, tile_q, 1, self.engine.device)

    def _plan(self, step: StepRows, handles: list[MatchHandle | None]) -> DecodeShare | None:
        node_ids, shared_lens = tree_groups(handles)
        if not (node_ids >= 0).any():
            return None
        seq = step.prefix_lens + 1
        plan = build_shared_prefix_plan(node_ids, shared_lens, np.cumsum(seq) - seq, seq, cost=self.cost,
                                        page_size=self.engine.page_size, suffix_tile_q=1)
        logger.debug("shared-prefix plan: %d groups over %d rows, modelled gain %.1f us a layer (%s)",
                     plan.num_shared_groups, step.batch_size, plan.gain_s * 1e6,
                     "shared" if plan.use_shared else "per-row")
        if not plan.use_shared:
            return None
        if step.batch_size > self.buffers.max_rows:
            if not self.grow:
                return None
            self.buffers = self._buffers(1 << (step.batch_size - 1).bit_length())
        return self._load(plan, step.batch_size, self._splits(plan))

    def _load(self, plan: SharedPrefixPlan, rows: int, splits: int) -> DecodeShare:
        self.buffers.load(plan, prefix_splits=splits)
        launched = self.graph_prefix_splits if self.captured else splits
        return DecodeShare(self.buffers, rows, launched, self.mode, self.side_stream)

    @property
    def graph_prefix_splits(self) -> int:
        """Prefix programs a tile launches in a captured graph: the most splits a plan of this launch order
        uses (`most_prefix_splits`)."""
        return most_prefix_splits(self.mode)

    def _splits(self, plan: SharedPrefixPlan) -> int:
        from ..kernels.triton_attention_common import _sm_count

        splits = prefix_splits(len(plan.prefix_tiles), self.cost.num_kv_heads, plan.max_prefix_len,
                               _sm_count(self.engine.device))
        return min(splits, self.graph_prefix_splits)

    def graph_share(self, rows: int) -> DecodeShare:
        return DecodeShare(self.buffers, rows, self.graph_prefix_splits, self.mode, self.side_stream)

    def warm_up_plans(self, step: StepRows, prefix_len: int) -> Iterator[DecodeShare]:
        """See `DecodePlanner.warm_up_plans`: with one and with several prefix splits (split counts are
        launch sizes, not compiled variants)."""
        rows = step.batch_size
        seq = step.prefix_lens + 1
        cost = dataclasses.replace(self.cost, keep_all=True)
        plan = build_shared_prefix_plan(np.zeros(rows, dtype=np.int64), np.full(rows, prefix_len),
                                        np.cumsum(seq) - seq, seq, cost=cost, page_size=self.engine.page_size,
                                        suffix_tile_q=1)
        for splits in (1, 2):
            self._rows = None  # the next `share` plans afresh
            yield self._load(plan, rows, splits)
