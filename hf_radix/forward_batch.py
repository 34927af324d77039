"""One packed forward: the rows a step computes (`StepRows`) and the kernels' metadata (`ForwardBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .page_table import PageTable
from .staging import aligned_offsets, aligned_views

if TYPE_CHECKING:
    from .shared_decode import DecodeShare


@dataclass
class ForwardBatch:
    """A packed `(1, T)` forward over B requests; row i computes positions `prefix_lens[i]:seq_lens[i]`.

    Built on the device from the page table (`build_forward_batch`); the `*_host` arrays let the backends
    size launches without synchronizing.
    """

    input_ids: torch.Tensor  # [T] new token ids
    positions: torch.Tensor  # [T]
    out_loc: torch.Tensor  # [T] slot of each new token
    qo_indptr: torch.Tensor  # [B+1] int32
    prefix_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    kv_indices: torch.Tensor  # slots of every row's whole context (prefix + new), rows concatenated
    kv_indptr: torch.Tensor  # [B+1] int32
    prefix_kv_indices: torch.Tensor  # slots of every row's cached prefix, rows concatenated
    prefix_kv_indptr: torch.Tensor  # [B+1] int32
    logits_indices: torch.Tensor  # positions in the packed batch whose logits are needed
    qo_indptr_host: np.ndarray
    seq_lens_host: np.ndarray
    max_new_len: int
    max_kv_len: int
    shared_prefix: DecodeShare | None = None  # decode: each group's prefix read once (hf_radix.shared_decode)

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
    on the host yet: the row's `next_token` on the device (the token the previous step sampled) is used.
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
        return bool(len(self.rows)) and bool(np.all(self.new_lens == 1))

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


def _indptr(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def gather_contexts(
    slots: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, indptr: torch.Tensor, total: int
) -> torch.Tensor:
    """`slots[rows[i], :lengths[i]]` of every row, concatenated (int64), on the device, without a sync."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=slots.device)
    row_of = torch.repeat_interleave(rows, lengths, output_size=total)
    start_of = torch.repeat_interleave(indptr[:-1], lengths, output_size=total)
    positions = torch.arange(total, device=slots.device) - start_of
    return slots[row_of, positions].long()


SLOT_LISTS = ("both", "context", "prefix")


def build_forward_batch(table: PageTable, step: StepRows, slot_lists: str = "both") -> ForwardBatch:
    """The kernels' metadata of `step`, built on the device from the page table.

    `slot_lists` names the slot lists the kernels will read: every row's whole context (`kv_indices`,
    decode), its cached prefix (`prefix_kv_indices`, extend) or both; one left out is empty.

    The host sends O(tokens + rows) numbers in one staged copy (which also carries the page-table writes
    made since the last one); the slot lists of whole contexts and cached prefixes are gathered from the
    device table.
    """
    if slot_lists not in SLOT_LISTS:
        raise ValueError(f"slot_lists must be one of {SLOT_LISTS}, got {slot_lists!r}")
    prefix, new = step.prefix_lens, step.new_lens
    seq = prefix + new
    qo_indptr, kv_indptr, prefix_indptr = _indptr(new), _indptr(seq), _indptr(prefix)
    tokens = int(qo_indptr[-1])
    positions = np.arange(tokens, dtype=np.int64) - np.repeat(qo_indptr[:-1] - prefix, new)
    token_rows = np.repeat(step.rows, new)
    if step.logits_offsets is None:
        logits = qo_indptr[1:] - 1
    else:
        logits = _concat(
            [np.asarray(o, dtype=np.int64) + start for o, start in zip(step.logits_offsets, qo_indptr)]
        )
    from_table = _concat([]) if step.from_table is None else np.asarray(step.from_table, dtype=np.int64)
    narrow_parts = [qo_indptr, prefix, seq, kv_indptr, prefix_indptr]  # sent once more, cast to int32
    narrow_sizes = [len(a) for a in narrow_parts]
    narrow_offsets, narrow_total = aligned_offsets(narrow_sizes, 4)
    narrow_host = np.zeros(narrow_total, dtype=np.int64)
    for offset, part in zip(narrow_offsets, narrow_parts):
        narrow_host[offset:offset + len(part)] = part
    parts = [
        step.input_ids, positions, token_rows, logits, from_table, token_rows[from_table], step.rows, seq,
        prefix, kv_indptr, prefix_indptr, narrow_host,
    ]
    wide = table.upload(parts)  # one copy, with the page-table writes made since the last one
    input_ids, positions_d, token_rows_d, logits_d, table_pos, table_rows, rows_d, seq_d, prefix_d = wide[:9]
    narrow = aligned_views(wide[11].to(torch.int32), narrow_offsets, narrow_sizes)
    qo_d, prefix32, seq32, kv_indptr32, prefix_indptr32 = narrow
    if len(from_table):
        input_ids.index_copy_(0, table_pos, table.next_token.index_select(0, table_rows))
    context_total = int(kv_indptr[-1]) if slot_lists != "prefix" else 0
    prefix_total = int(prefix_indptr[-1]) if slot_lists != "context" else 0
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions_d,
        out_loc=table.slots[token_rows_d, positions_d].long(),
        qo_indptr=qo_d,
        prefix_lens=prefix32,
        seq_lens=seq32,
        kv_indices=gather_contexts(table.slots, rows_d, seq_d, wide[9], context_total),
        kv_indptr=kv_indptr32,
        prefix_kv_indices=gather_contexts(table.slots, rows_d, prefix_d, wide[10], prefix_total),
        prefix_kv_indptr=prefix_indptr32,
        logits_indices=logits_d,
        qo_indptr_host=qo_indptr,
        seq_lens_host=seq,
        max_new_len=int(new.max(initial=0)),
        max_kv_len=int(seq.max(initial=0)),
    )
