"""Shared-prefix groups of a batch and the tile tables the shared-prefix attention kernels read.

Rows whose cached prefix is the same radix-tree node (locked by each of them) form a group: that node's
page-aligned prefix is read once per tile of the group's queries, each row's own suffix (private cached
tokens + new tokens) once per row (:mod:`hf_radix.kernels.triton_shared_prefix`). Rows sharing nothing are
groups of one, read whole by their suffix tiles. :func:`build_shared_prefix_plan` is a pure numpy function
of the batch, run when the batch changes; :class:`SharedPrefixCost` decides, per group and per batch,
whether sharing beats per-row attention; :class:`SharedPrefixBuffers` holds static, padded device copies
of the tables, refilled in place, so a captured CUDA graph replays any batch that fits.

Slot ranges are offsets into one flat slot array (a batch's ``kv_indices``, or the flattened
request-to-slot table): row ``i``'s context position ``p`` lives at ``slots[kv_starts[i] + p]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from ..forward.staging import aligned_offsets, aligned_views

logger = logging.get_logger(__name__)

MODES = ("fold", "merge", "overlap", "fused")  # launch orders of shared-prefix attention (equal results)

TILE_FIELDS = 5  # kv_start, kv_pos0, kv_len, q_start, q_len (hf_radix.kernels.triton_shared_prefix)
_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class SharedPrefixCost:
    """Time model of the attention over a group's prefix, per layer: the larger of K/V bytes over HBM
    bandwidth and tensor-core FLOPs (M rows padded to whole tiles) over peak, as on an H100/H200.

    Per row, the prefix is read once per row and multiplied with tiles of that row's queries only (a
    decode row fills 16 of the M rows). Shared, it is read once per group, with tiles packed across rows,
    plus the fp32 partial results (written, read back) of ``prefix_parts`` splits and one more launch.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    prefix_parts: int = 1
    tile_rows: int = 128  # (query, head) rows of a shared-prefix tile
    bandwidth: float = 4.0e12  # bytes/s
    flops: float = 6.0e14  # dense bf16 FLOP/s reachable by these kernels
    launch_s: float = 4e-6  # an extra kernel launch (and its tail) inside a CUDA graph
    keep_all: bool = False  # keep every group of two readers or more, whatever its gain (tests, benchmarks)

    @property
    def q_heads_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def _seconds(self, kv_tokens: float, m_rows: float, prefix_len: int, partial_queries: float) -> float:
        kv_bytes = kv_tokens * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes
        partial = partial_queries * self.num_q_heads * self.prefix_parts * (self.head_dim + 1) * 4 * 2
        flops = 4.0 * self.head_dim * prefix_len * m_rows * self.num_kv_heads
        return max((kv_bytes + partial) / self.bandwidth, flops / self.flops)

    def group_gain_s(self, new_lens: np.ndarray, prefix_len: int) -> float:
        """Seconds saved by reading a ``prefix_len``-token prefix once for rows with ``new_lens`` queries."""
        new_lens = np.asarray(new_lens, dtype=np.int64)
        if np.count_nonzero(new_lens) < 2 or prefix_len <= 0:
            return 0.0
        group = self.q_heads_per_kv
        rows_m = np.where(new_lens * group <= 16, 16, -(-new_lens * group // self.tile_rows) * self.tile_rows)
        rows_m[new_lens == 0] = 0  # a row without queries reads nothing
        readers = int(np.count_nonzero(new_lens))
        per_row = self._seconds(prefix_len * readers, float(rows_m.sum()), prefix_len, 0)
        tile_q = max(1, self.tile_rows // group)
        shared_m = -(-int(new_lens.sum()) // tile_q) * self.tile_rows
        shared = self._seconds(prefix_len, shared_m, prefix_len, float(new_lens.sum()))
        return per_row - shared

    def worth_it(self, total_gain_s: float) -> bool:
        """Whether the groups' total gain pays for the extra launch (always, with ``keep_all``)."""
        return self.keep_all or total_gain_s > self.launch_s


@dataclass
class SharedPrefixPlan:
    """Groups of one batch and the kernel's tile tables (numpy; see :func:`build_shared_prefix_plan`).

    Groups ``0 .. num_shared_groups - 1`` share a prefix (two rows or more); the rest are rows alone
    (``group_prefix_len`` 0). Tile rows are ``(kv_start, kv_pos0, kv_len, q_start, q_len)``: a prefix
    tile's queries are ``prefix_queries[q_start : q_start + q_len]``, a suffix tile's the consecutive
    tokens from ``q_start`` (each row's tokens are consecutive).
    """

    row_group: np.ndarray  # [B] group of each row
    group_row_indptr: np.ndarray  # [G+1] CSR over group_rows
    group_rows: np.ndarray  # [B] rows ordered by group
    group_kv_start: np.ndarray  # [G] offset of the group's prefix in the flat slot array
    group_prefix_len: np.ndarray  # [G] shared prefix length (0: a row alone)
    row_suffix_start: np.ndarray  # [B] offset of the row's suffix (first key after the shared prefix)
    row_suffix_len: np.ndarray  # [B] suffix length (the row's context minus its group's prefix)
    prefix_tiles: np.ndarray  # [Np, 5] int32
    prefix_tile_leader: np.ndarray  # [Np] int32 the row whose slots each prefix tile reads (its group leader)
    prefix_queries: np.ndarray  # [Qp] int32 query tokens of the prefix tiles, tile after tile
    suffix_tiles: np.ndarray  # [Ns, 5] int32
    query_pos: np.ndarray  # [T] int32 absolute position of each query token
    query_shared: np.ndarray  # [T] int32 shared prefix length of the token's group (0: none)
    prefix_tile_q: int
    suffix_tile_q: int
    gain_s: float  # modelled time saved per layer by sharing (see SharedPrefixCost)
    use_shared: bool  # the cost rule's verdict for this batch

    @property
    def num_groups(self) -> int:
        return len(self.group_prefix_len)

    @property
    def num_shared_groups(self) -> int:
        return int(np.count_nonzero(self.group_prefix_len))

    @property
    def max_prefix_len(self) -> int:
        return int(self.group_prefix_len.max(initial=0))


def _chunks(seg_starts: np.ndarray, seg_lens: np.ndarray, size: int) -> tuple[np.ndarray, ...]:
    """Splits segments into chunks of at most ``size``: (segment of each chunk, chunk start, chunk length)."""
    counts = -(-seg_lens // size)
    seg = np.repeat(np.arange(len(seg_lens)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(len(seg)) - first) * size
    return seg, seg_starts[seg] + offset, np.minimum(seg_lens[seg] - offset, size)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` over the segments."""
    return np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))


def _table(*cols: np.ndarray) -> np.ndarray:
    table = np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1).reshape(-1, TILE_FIELDS)
    if table.size and (table.max() > _INT32_MAX or table.min() < 0):
        raise ValueError("slot offsets / lengths must fit in int32 and be non-negative")
    return table.astype(np.int32)


def build_shared_prefix_plan(
    node_ids: np.ndarray,
    shared_lens: np.ndarray,
    kv_starts: np.ndarray,
    seq_lens: np.ndarray,
    new_lens: np.ndarray | None = None,
    *,
    cost: SharedPrefixCost,
    page_size: int = 1,
    slots: np.ndarray | None = None,
    suffix_tile_q: int | None = None,
) -> SharedPrefixPlan:
    """Groups a batch's rows by their cached-prefix tree node and builds the tile tables.

    Row ``i`` has context length ``seq_lens[i]``, whose last ``new_lens[i]`` tokens (default 1: decode) are
    its query tokens, packed row after row as in :class:`.forward_batch.ForwardBatch`. ``node_ids[i]``
    names the tree node holding the row's shared cached prefix (negative: none) and ``shared_lens[i]`` that
    node's page-aligned prefix length; rows naming one node form a group. A group whose modelled gain is not
    positive is dissolved into rows alone (unless ``cost.keep_all``). With ``slots`` (the flat slot array),
    each group's rows are checked to hold the same slots for the shared prefix. Prefix tiles hold
    ``cost.tile_rows`` (query, head) rows; suffix tiles hold ``suffix_tile_q`` queries of one row (default:
    1 if every row adds one token, else as many as a prefix tile; fix it to share buffers between both).
    """
    node_ids = np.asarray(node_ids, dtype=np.int64)
    shared_lens = np.asarray(shared_lens, dtype=np.int64)
    kv_starts = np.asarray(kv_starts, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    batch = len(node_ids)
    new_lens = np.ones(batch, dtype=np.int64) if new_lens is None else np.asarray(new_lens, dtype=np.int64)
    if not (len(shared_lens) == len(kv_starts) == len(seq_lens) == len(new_lens) == batch):
        raise ValueError("node_ids, shared_lens, kv_starts, seq_lens, new_lens need one entry per row")
    if (new_lens < 0).any() or (new_lens > seq_lens).any() or (kv_starts < 0).any():
        raise ValueError("need 0 <= new_lens <= seq_lens and kv_starts >= 0")
    has_node = node_ids >= 0
    if (has_node & ((shared_lens < 0) | (shared_lens > seq_lens - new_lens))).any():
        raise ValueError("a shared prefix must lie within the row's cached tokens (seq_len - new_len)")
    if page_size > 1 and (shared_lens[has_node] % page_size).any():
        raise ValueError(f"shared prefix lengths must be multiples of the page size ({page_size})")

    row_group, num_shared, total_gain = _form_groups(node_ids, shared_lens, new_lens, cost)
    num_groups = int(row_group.max(initial=-1)) + 1
    qo = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(new_lens, out=qo[1:])
    group_rows = np.argsort(row_group, kind="stable")
    group_sizes = np.bincount(row_group, minlength=num_groups)
    group_row_indptr = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(group_sizes, out=group_row_indptr[1:])
    leaders = group_rows[group_row_indptr[:-1]]
    group_prefix_len = np.where(np.arange(num_groups) < num_shared, shared_lens[leaders], 0)
    group_kv_start = kv_starts[leaders]
    row_prefix = group_prefix_len[row_group]
    if slots is not None:
        _check_shared_slots(np.asarray(slots), kv_starts, row_prefix, group_kv_start[row_group])

    # ---- prefix tiles: chunks of each shared group's query tokens ----
    group_q = max(1, cost.tile_rows // cost.q_heads_per_kv)
    shared_rows = group_rows[: group_row_indptr[num_shared]]
    prefix_queries = _ranges(qo[shared_rows], new_lens[shared_rows])
    g_tokens = np.bincount(row_group, weights=new_lens, minlength=num_groups)[:num_shared].astype(np.int64)
    g_start = np.cumsum(g_tokens) - g_tokens
    seg, q_start, q_len = _chunks(g_start, g_tokens, group_q)
    prefix_tiles = _table(group_kv_start[seg], np.zeros_like(seg), group_prefix_len[seg], q_start, q_len)
    prefix_tile_leader = leaders[seg].astype(np.int32)

    # ---- suffix tiles: chunks of each row's query tokens over its own context ----
    if suffix_tile_q is None:
        suffix_tile_q = group_q if (new_lens > 1).any() else 1
    seg, q_start, q_len = _chunks(qo[:-1], new_lens, suffix_tile_q)
    suffix_start = kv_starts + row_prefix
    suffix_len = seq_lens - row_prefix
    suffix_tiles = _table(suffix_start[seg], row_prefix[seg], suffix_len[seg], q_start, q_len)

    token_row = np.repeat(np.arange(batch), new_lens)
    query_pos = (seq_lens - new_lens)[token_row] + np.arange(int(qo[-1])) - qo[token_row]
    return SharedPrefixPlan(
        row_group=row_group,
        group_row_indptr=group_row_indptr,
        group_rows=group_rows,
        group_kv_start=group_kv_start,
        group_prefix_len=group_prefix_len,
        row_suffix_start=suffix_start,
        row_suffix_len=suffix_len,
        prefix_tiles=prefix_tiles,
        prefix_tile_leader=prefix_tile_leader,
        prefix_queries=prefix_queries.astype(np.int32),
        suffix_tiles=suffix_tiles,
        query_pos=query_pos.astype(np.int32),
        query_shared=row_prefix[token_row].astype(np.int32),
        prefix_tile_q=group_q,
        suffix_tile_q=suffix_tile_q,
        gain_s=total_gain,
        use_shared=num_shared > 0 and cost.worth_it(total_gain),
    )


def _form_groups(node_ids: np.ndarray, shared_lens: np.ndarray, new_lens: np.ndarray,
                 cost: SharedPrefixCost) -> tuple[np.ndarray, int, float]:
    """(group of each row, number of shared groups, their modelled gain): rows naming one node, if the
    cost rule keeps it, numbered in order of first appearance; then each other row alone."""
    has_node = node_ids >= 0
    nodes, first, inverse, counts = np.unique(node_ids[has_node], return_index=True, return_inverse=True,
                                              return_counts=True)
    node_row = np.flatnonzero(has_node)
    node_len = shared_lens[node_row[first]]
    if (shared_lens[node_row] != node_len[inverse]).any():
        raise ValueError("rows of one tree node must have the same shared prefix length")
    gains = np.zeros(len(nodes))
    by_node = np.split(new_lens[node_row[np.argsort(inverse, kind="stable")]], np.cumsum(counts)[:-1])
    readers = np.array([np.count_nonzero(lens) for lens in by_node], dtype=np.int64)
    eligible = (readers > 1) & (node_len > 0)
    for n in np.flatnonzero(eligible):
        gains[n] = cost.group_gain_s(by_node[n], int(node_len[n]))
    kept = np.flatnonzero(eligible & (cost.keep_all | (gains > 0.0)))
    kept = kept[np.argsort(first[kept], kind="stable")]
    node_group = np.full(len(nodes), -1, dtype=np.int64)
    node_group[kept] = np.arange(len(kept))
    row_group = np.full(len(node_ids), -1, dtype=np.int64)
    row_group[node_row] = node_group[inverse]
    alone = np.flatnonzero(row_group < 0)
    row_group[alone] = len(kept) + np.arange(len(alone))
    return row_group, len(kept), float(gains[kept].sum())


def _check_shared_slots(slots: np.ndarray, kv_starts: np.ndarray, row_prefix: np.ndarray,
                        group_start: np.ndarray) -> None:
    """Every row's first ``row_prefix`` slots equal its group leader's."""
    lens = row_prefix[row_prefix > 0]
    if not len(lens):
        return
    mine = _ranges(kv_starts[row_prefix > 0], lens)
    leader = _ranges(group_start[row_prefix > 0], lens)
    if mine.max() >= len(slots) or not np.array_equal(slots[mine], slots[leader]):
        raise ValueError("rows of one group do not hold the same slots for their shared prefix")


class SharedPrefixBuffers:
    """Static device copies of plans' tables (the kernel's ``SharedPrefixTiles``), refilled by :meth:`load`.

    Sized once for at most ``max_rows`` rows and ``max_tokens`` query tokens, so one CUDA graph replays
    every batch that fits; unused tile rows are zero (``q_len`` 0: no work). All tables live in one int32
    device tensor, filled by one host-to-device copy. A decode plan's per-step fields follow the batch on
    the device (:meth:`refresh_decode`), so the tables are loaded only when the batch's rows change.
    """

    def __init__(self, max_rows: int, max_tokens: int, prefix_tile_q: int, suffix_tile_q: int,
                 device: torch.device | str):
        if max_tokens < 1 or max_rows < 1 or prefix_tile_q < 1 or suffix_tile_q < 1:
            raise ValueError("capacities and tile sizes must be >= 1")
        self.prefix_tile_q = prefix_tile_q
        self.suffix_tile_q = suffix_tile_q
        # Each segment (a group's or a row's queries) adds at most one partial chunk.
        num_prefix = min(max_tokens, -(-max_tokens // prefix_tile_q) + max_rows // 2)
        num_suffix = min(max_tokens, -(-max_tokens // suffix_tile_q) + max_rows)
        sizes = [num_prefix * TILE_FIELDS, max_tokens, num_suffix * TILE_FIELDS, max_tokens, max_tokens,
                 num_prefix, 1]
        offsets, total = aligned_offsets(sizes, 4)  # every table 16-byte aligned, whatever the capacities
        self._sizes, self._offsets = sizes, offsets
        with torch.inference_mode(False):  # refreshed in place by calls in any grad mode
            self._data = torch.zeros(total, dtype=torch.int32, device=device)
        views = aligned_views(self._data, offsets, sizes)
        self.prefix_tiles = views[0].view(num_prefix, TILE_FIELDS)
        self.prefix_queries = views[1]
        self.suffix_tiles = views[2].view(num_suffix, TILE_FIELDS)
        self.query_pos, self.query_shared = views[3], views[4]
        self.prefix_tile_leader = views[5]
        self.prefix_splits = views[6]  # splits of each prefix (at most the launch's; see load)
        self.prefix_splits.fill_(_INT32_MAX)

    @property
    def max_rows(self) -> int:
        """Rows of a decode batch (one suffix tile each) the buffers hold."""
        return min(self.suffix_tiles.shape[0], self.query_pos.shape[0])

    @classmethod
    def from_plan(cls, plan: SharedPrefixPlan, device: torch.device | str) -> SharedPrefixBuffers:
        """Buffers sized for this plan's batch, filled with it."""
        rows, tokens = len(plan.row_group), max(1, len(plan.query_pos))
        buffers = cls(max(1, rows), tokens, plan.prefix_tile_q, plan.suffix_tile_q, device)
        buffers.load(plan)
        return buffers

    def load(self, plan: SharedPrefixPlan, prefix_splits: int = _INT32_MAX) -> None:
        """Copies ``plan``'s tables in (stream-ordered, no sync), padding the rest with zeros.

        ``prefix_splits``: how many splits the kernels cut each prefix into (default: as many as launched).
        """
        if prefix_splits < 1:
            raise ValueError("prefix_splits must be >= 1")
        if (plan.prefix_tile_q, plan.suffix_tile_q) != (self.prefix_tile_q, self.suffix_tile_q):
            raise ValueError(
                f"plan tiles hold {plan.prefix_tile_q}/{plan.suffix_tile_q} queries, buffers "
                f"{self.prefix_tile_q}/{self.suffix_tile_q}"
            )
        parts = [plan.prefix_tiles.reshape(-1), plan.prefix_queries, plan.suffix_tiles.reshape(-1),
                 plan.query_pos, plan.query_shared, plan.prefix_tile_leader,
                 np.array([min(prefix_splits, _INT32_MAX)])]
        host = np.zeros(self._data.numel(), dtype=np.int32)
        for part, size, offset in zip(parts, self._sizes, self._offsets):
            if len(part) > size:
                raise ValueError(f"batch exceeds the buffers' capacity ({len(part)} > {size} entries)")
            host[offset:offset + len(part)] = part
        staged = torch.from_numpy(host)
        if self._data.device.type == "cuda":
            staged = staged.pin_memory()
        self._data.copy_(staged, non_blocking=True)

    def refresh_decode(self, kv_indptr: torch.Tensor, seq_lens: torch.Tensor, rows: int) -> None:
        """Sets a decode plan's per-step fields from the batch's own metadata, on the device.

        A decode step grows each row's context by one token: its query position, its suffix range and
        where each row's (and so each group's) context starts in the batch's slot list follow from
        ``kv_indptr`` / ``seq_lens`` (int32, the first ``rows`` rows). Row ``i`` is suffix tile ``i`` (one
        query each); the fixed fields (groups, prefix lengths, queries) stay as loaded. No host work, so it
        runs inside a captured graph's replay.
        """
        starts, lens = kv_indptr[:rows], seq_lens[:rows]
        suffix = self.suffix_tiles[:rows]
        torch.sub(lens, 1, out=self.query_pos[:rows])
        suffix[:, 0] = starts + suffix[:, 1]
        suffix[:, 2] = lens - suffix[:, 1]
        self.prefix_tiles[:, 0] = kv_indptr.index_select(0, self.prefix_tile_leader)


@dataclass(frozen=True)
class DecodeShare:
    """What the attention of one decode batch needs to read each group's prefix once: the loaded buffers,
    the batch's (padded) row count and the prefix split count (python ints: fixed in a captured graph), the
    launch order (the engine's `shared_prefix_mode`, one of `MODES`) and the engine's stream for the prefix
    launches beside the suffix launch ("overlap")."""

    buffers: SharedPrefixBuffers
    rows: int
    prefix_splits: int
    mode: str = "fold"
    side_stream: torch.cuda.Stream | None = None

    def refresh(self, kv_indptr: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """This step's query positions and slot ranges, from the batch's device metadata (once a step)."""
        self.buffers.refresh_decode(kv_indptr, seq_lens, self.rows)
