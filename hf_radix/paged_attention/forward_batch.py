"""One packed forward: the rows a step computes (`StepRows`) and the kernels' metadata (`ForwardBatch`), built
by one function (`build_forward_batch`) in fresh tensors or in a captured graph's static ones (`GraphInputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..forward.staging import PackedLayout, StaticBlock
from ..kernels import triton_runs_on
from ..memory.page_table import PageTable

if TYPE_CHECKING:
    from ..memory.state_pool import StateBatch


class DecodePlan(Protocol):
    """What a decode batch's attention reads besides its metadata (`ForwardBatch.shared_prefix`): a
    `DecodeShare` (shared-prefix decode), or a `grouped_decode.DecodeTiles` (deterministic mode)."""

    def refresh(self, kv_indptr: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Sets what a step moves from the batch's device metadata (once a step, before the forward)."""


@dataclass
class ForwardBatch:
    """A packed `(1, T)` forward over B requests; row i computes positions `prefix_lens[i]:seq_lens[i]`.

    Built on the device from the page table (`build_forward_batch`); the `*_host` arrays let the backends
    size launches without synchronizing. It holds the slot list the backend reads: every row's whole
    context (decode kernels, the torch reference) or its cached prefix (extend kernels); the other's
    fields are None.
    """

    input_ids: torch.Tensor  # [T] new token ids
    positions: torch.Tensor  # [T]
    out_loc: torch.Tensor  # [T] slot of each new token
    qo_indptr: torch.Tensor  # [B+1] int32
    logits_indices: torch.Tensor  # positions in the packed batch whose logits are needed
    qo_indptr_host: np.ndarray
    seq_lens_host: np.ndarray
    max_new_len: int
    max_kv_len: int
    seq_lens: torch.Tensor | None = None  # [B] int32
    kv_indices: torch.Tensor | None = None  # slots of every row's whole context (prefix + new), concatenated
    kv_indptr: torch.Tensor | None = None  # [B+1] int32
    prefix_lens: torch.Tensor | None = None  # [B] int32
    prefix_kv_indices: torch.Tensor | None = None  # slots of every row's cached prefix, rows concatenated
    prefix_kv_indptr: torch.Tensor | None = None  # [B+1] int32
    shared_prefix: DecodePlan | None = None  # decode: each group's prefix read once (shared/grouped_decode)
    state_batch: StateBatch | None = None  # hybrid models: the rows' state slots (forward.hybrid)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_host[-1])

    @property
    def is_decode(self) -> bool:
        """Every row adds exactly one token."""
        return self.max_new_len == 1 and self.num_tokens == self.batch_size


@dataclass
class StepRows:
    """The rows of one forward in page-table terms: row i computes positions `prefix_lens[i]:` of table
    row `rows[i]`, `new_lens[i]` tokens long; `input_ids` are the new tokens, rows concatenated.

    `logits_offsets[i]` selects the offsets (within row i's new tokens) whose logits are wanted; None asks
    for the last new token of every row. `from_table` lists positions of `input_ids` whose id is not known
    on the host yet (increasing): the row's `next_token` on the device (the token the previous step sampled)
    is used.
    """

    rows: np.ndarray
    prefix_lens: np.ndarray
    new_lens: np.ndarray
    input_ids: np.ndarray
    logits_offsets: list[np.ndarray] | None = None
    from_table: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        new_token_ids: Sequence[np.ndarray],
        logits_offsets: Sequence[np.ndarray] | None = None,
    ) -> StepRows:
        """Rows given as their new token ids."""
        return cls(
            rows=np.asarray(rows, dtype=np.int64),
            prefix_lens=np.asarray(prefix_lens, dtype=np.int64),
            new_lens=np.fromiter((len(t) for t in new_token_ids), dtype=np.int64, count=len(new_token_ids)),
            input_ids=_concat([np.asarray(t, dtype=np.int64) for t in new_token_ids]),
            logits_offsets=None if logits_offsets is None else list(logits_offsets),
        )

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.rows) > 0 and bool((self.new_lens == 1).all())

    @property
    def last_tokens_only(self) -> bool:
        """Each row wants the logits of its last new token or none (what a captured graph computes)."""
        if self.logits_offsets is None:
            return True
        pairs = zip(self.logits_offsets, self.new_lens.tolist())
        return all(len(o) == 0 or (len(o) == 1 and o[0] == n - 1) for o, n in pairs)

    def logits_rows(self) -> np.ndarray | None:
        """Rows whose last token's logits are wanted (None: all), for a batch with `last_tokens_only`."""
        if self.logits_offsets is None:
            return None
        wanted = np.fromiter((len(o) > 0 for o in self.logits_offsets), dtype=bool, count=len(self.rows))
        return None if wanted.all() else np.flatnonzero(wanted)


_EMPTY = np.zeros(0, dtype=np.int64)
_ARANGES: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """`np.arange(n)` (int64, read-only), made once per length: decode metadata that depends on the batch
    size alone."""
    out = _ARANGES.get(n)
    if out is None:
        out = _ARANGES[n] = np.arange(n, dtype=np.int64)
        out.setflags(write=False)
    return out


def _indptr(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    lengths.cumsum(out=out[1:])
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else _EMPTY


def _token_layout(step: StepRows, decode: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The packed tokens of `step`: each row's offset (`qo_indptr`), each token's position and table row,
    and the packed positions whose logits are wanted. `decode`: every row adds one token (else any)."""
    rows, prefix, new = step.rows, step.prefix_lens, step.new_lens
    if decode:  # a decode step: one token per row, at its prefix length
        qo_indptr = _arange(len(rows) + 1)
        positions, token_rows = prefix, rows
    else:
        qo_indptr = _indptr(new)
        positions = np.arange(int(qo_indptr[-1]), dtype=np.int64) - np.repeat(qo_indptr[:-1] - prefix, new)
        token_rows = np.repeat(rows, new)
    if step.logits_offsets is None:
        logits = _arange(len(rows)) if decode else qo_indptr[1:] - 1
    else:
        logits = _concat(
            [np.asarray(o, dtype=np.int64) + start for o, start in zip(step.logits_offsets, qo_indptr)]
        )
    return qo_indptr, positions, token_rows, logits


def gather_contexts(
    flat_slots: torch.Tensor, bases: torch.Tensor, indptr: torch.Tensor, total: int, longest: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs of the flat device table, concatenated (int64), on the device, without a sync: entry `k` of
    the result lies in run `i` (`indptr[i] <= k < indptr[i + 1]`: the runs' offsets, int32, `total` the
    last, `longest` the longest run's length) and reads `flat_slots[bases[i] + k]`.

    With `bases[i] = rows[i] * width - indptr[i]` that is `slots[rows[i], :indptr[i + 1] - indptr[i]]` of
    every row. With `out` (int64, at least `total` long) the result is written into its first `total`
    entries (and returned). One Triton launch where Triton runs (`kernels.triton_slots`); otherwise each
    entry finds its run by a binary search.
    """
    if total == 0:
        return bases[:0] if out is None else out[:0]
    out = torch.empty(total, dtype=torch.int64, device=flat_slots.device) if out is None else out[:total]
    if triton_runs_on(flat_slots):
        from ..kernels.triton_slots import gather_runs

        return gather_runs(flat_slots, bases, indptr, longest, out)
    position = torch.arange(total, dtype=indptr.dtype, device=flat_slots.device)
    run = torch.searchsorted(indptr[1:], position, right=True)
    torch.index_select(bases, 0, run, out=out)
    out += position
    return out.copy_(flat_slots.index_select(0, out))


def build_forward_batch(
    table: PageTable, step: StepRows, context: bool, into: GraphInputs | None = None
) -> ForwardBatch:
    """The kernels' metadata of `step`, built on the device from the page table: in fresh tensors, or in a
    captured graph's static buffers `into` (the step padded to the graph's shape), through the same steps.

    `context`: the kernels read every row's whole-context slot list (`kv_indices`, `kv_indptr`, and the
    sequence lengths), else its cached prefix's (`prefix_kv_indices`, `prefix_kv_indptr`, the prefix
    lengths); the backend says which (`AttentionBackend.reads_context`), the other list's fields are None.

    The host sends O(tokens + rows) numbers in one staged copy (which also carries the page-table writes
    made since the last one; into `into`'s block, where given): the slot of each new token is read from the
    host table, the slot list is gathered from the device table, the ids of `step.from_table` are read from
    the device's `next_token`.
    """
    rows, prefix, new = step.rows, step.prefix_lens, step.new_lens
    seq = prefix + new
    decode = into.decode if into is not None else bool((new == 1).all())  # a token a row (graphs: known)
    qo_indptr, positions, token_rows, logits = _token_layout(step, decode)
    lens = seq if context else prefix
    indptr = _indptr(lens)
    from_table = _EMPTY if step.from_table is None else np.asarray(step.from_table, dtype=np.int64)
    every_id_from_table = len(from_table) == len(step.input_ids)  # (increasing positions: all, in order)
    # the ids read from the table are written below
    token_parts = [_EMPTY if every_id_from_table else step.input_ids, positions,
                   table.host[token_rows, positions], logits]
    narrow = [qo_indptr, lens, indptr]  # int32 on the device
    bases = rows * table.width - indptr[:-1]
    parts = [bases, token_rows] if every_id_from_table else [bases, token_rows[from_table], from_table]
    if into is None:  # one copy, with the page-table writes made since the last
        uploaded = table.upload([*token_parts, *parts], narrow)
        tokens, (bases_d, table_rows, *table_pos), narrow_d = uploaded[:4], uploaded[4:-3], uploaded[-3:]
        input_ids, positions_d, out_loc, logits_d = tokens
        qo_d, lens_d, indptr_d = narrow_d
    else:
        bases_d, table_rows, *table_pos = table.upload(
            parts, into=into.block, into_parts=token_parts, into_narrow=narrow
        )
        input_ids, positions_d, out_loc, logits_d, qo_d, lens_d, indptr_d = into.block.views
    if every_id_from_table:
        if into is None:
            input_ids = table.next_token.index_select(0, table_rows)
        else:
            torch.index_select(table.next_token, 0, table_rows, out=input_ids)
    elif len(from_table):
        input_ids.index_copy_(0, table_pos[0], table.next_token.index_select(0, table_rows))
    longest = int(lens.max(initial=0))
    kv = gather_contexts(table.flat_slots, bases_d, indptr_d, int(indptr[-1]), longest,
                         out=None if into is None else into.kv)
    if into is not None:
        kv = into.kv  # the whole static list: what a captured graph reads, whatever its length now
    lists = dict(seq_lens=lens_d, kv_indices=kv, kv_indptr=indptr_d) if context else dict(
        prefix_lens=lens_d, prefix_kv_indices=kv, prefix_kv_indptr=indptr_d)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions_d,
        out_loc=out_loc,
        qo_indptr=qo_d,
        logits_indices=logits_d,
        qo_indptr_host=qo_indptr,
        seq_lens_host=seq,
        max_new_len=min(len(rows), 1) if decode else int(new.max(initial=0)),
        max_kv_len=longest if context else int(seq.max(initial=0)),
        **lists,
    )


class GraphInputs:
    """The static metadata one captured graph reads, at addresses fixed by its padded shape: a
    `StaticBlock` (each token's id, position and slot, the logits rows; the int32 row offsets, lengths and
    slot-list offsets) and the static slot list `kv`, which `build_forward_batch(..., into=)` fills.

    `decode`: the kernels read every row's whole context (`lens` are sequence lengths); otherwise its
    cached prefix (`lens` are prefix lengths).
    """

    def __init__(
        self, block: torch.Tensor, kv: torch.Tensor, rows: int, tokens: int, logits: int, decode: bool
    ):
        self.block = StaticBlock(self.layout(rows, tokens, logits), block)
        (self.input_ids, self.positions, self.out_loc, self.logits_indices,
         self.qo_indptr, self.lens, self.kv_indptr) = self.block.views
        self.kv = kv
        self.decode = decode

    @staticmethod
    def layout(rows: int, tokens: int, logits: int) -> PackedLayout:
        """Where the block holds the metadata of `rows` rows (padding row included) and `tokens` tokens."""
        return PackedLayout([tokens, tokens, tokens, logits], [rows + 1, rows, rows + 1])
