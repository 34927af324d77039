"""Metadata of one packed forward: which tokens are new, where their K/V go, which slots each row reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """A packed `(1, T)` forward over B requests; row i computes positions `prefix_lens[i]:seq_lens[i]`.

    Device tensors are built on the host with numpy and copied once; the `*_host` arrays let the
    backends size launches without synchronizing.
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


def _indptr(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _to_device(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Copies several host arrays to the device in one transfer; returns device views of each."""
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64 if dtype == torch.int64 else np.int32))
    packed = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    return list(packed.split([len(a) for a in arrays]))


@dataclass
class HostBatch:
    """The host (numpy) metadata of a packed batch, before it goes to the device; fields as ForwardBatch."""

    input_ids: np.ndarray
    positions: np.ndarray
    out_loc: np.ndarray
    kv_indices: np.ndarray
    prefix_kv_indices: np.ndarray
    logits_indices: np.ndarray
    qo_indptr: np.ndarray
    prefix_lens: np.ndarray
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    prefix_kv_indptr: np.ndarray

    @property
    def max_new_len(self) -> int:
        return int(np.diff(self.qo_indptr).max(initial=0))


def pack_batch(
    row_slots: Sequence[np.ndarray],
    new_token_ids: Sequence[np.ndarray],
    prefix_lens: Sequence[int],
    logits_offsets: Sequence[np.ndarray] | None,
    *,
    whole_context: bool = True,
    prefix_context: bool = True,
) -> HostBatch:
    """Packs B rows on the host.

    Row i has context slots `row_slots[i]` (at least `prefix_lens[i] + len(new_token_ids[i])` long) and
    computes its new tokens at positions starting at `prefix_lens[i]`. `logits_offsets[i]` selects the
    new-token offsets whose logits are wanted (default: the last new token of each row). The slot lists
    of whole contexts and of cached prefixes can be skipped (left empty) when no kernel will read them.
    """
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    new_lens = np.fromiter((len(t) for t in new_token_ids), dtype=np.int64, count=len(new_token_ids))
    seq = prefix + new_lens
    qo_indptr = _indptr(new_lens)
    positions = np.arange(qo_indptr[-1], dtype=np.int64) - np.repeat(qo_indptr[:-1] - prefix, new_lens)
    if logits_offsets is None:
        logits = qo_indptr[1:] - 1
    else:
        logits = _concat(
            [np.asarray(o, dtype=np.int64) + start for o, start in zip(logits_offsets, qo_indptr)]
        )
    empty = _concat([])
    return HostBatch(
        input_ids=_concat([np.asarray(t, dtype=np.int64) for t in new_token_ids]),
        positions=positions,
        out_loc=_concat([slots[p:n] for slots, p, n in zip(row_slots, prefix, seq)]),
        kv_indices=_concat([s[:n] for s, n in zip(row_slots, seq)]) if whole_context else empty,
        prefix_kv_indices=_concat([s[:n] for s, n in zip(row_slots, prefix)]) if prefix_context else empty,
        logits_indices=logits,
        qo_indptr=qo_indptr,
        prefix_lens=prefix,
        seq_lens=seq,
        kv_indptr=_indptr(seq),
        prefix_kv_indptr=_indptr(prefix),
    )


def build_forward_batch(
    row_slots: Sequence[np.ndarray],
    new_token_ids: Sequence[np.ndarray],
    prefix_lens: Sequence[int],
    logits_offsets: Sequence[np.ndarray] | None,
    device: torch.device,
) -> ForwardBatch:
    """Packs B rows into one batch on `device` (arguments as in `pack_batch`)."""
    return upload_batch(pack_batch(row_slots, new_token_ids, prefix_lens, logits_offsets), device)


def upload_batch(host: HostBatch, device: torch.device) -> ForwardBatch:
    """Copies host metadata to `device` (one transfer per index dtype)."""
    wide = _to_device(
        [host.input_ids, host.positions, host.out_loc, host.kv_indices, host.prefix_kv_indices,
         host.logits_indices],
        torch.int64,
        device,
    )
    narrow = _to_device(
        [host.qo_indptr, host.prefix_lens, host.seq_lens, host.kv_indptr, host.prefix_kv_indptr],
        torch.int32,
        device,
    )
    return ForwardBatch(
        input_ids=wide[0],
        positions=wide[1],
        out_loc=wide[2],
        qo_indptr=narrow[0],
        prefix_lens=narrow[1],
        seq_lens=narrow[2],
        kv_indices=wide[3],
        kv_indptr=narrow[3],
        prefix_kv_indices=wide[4],
        prefix_kv_indptr=narrow[4],
        logits_indices=wide[5],
        qo_indptr_host=host.qo_indptr,
        seq_lens_host=host.seq_lens,
        max_new_len=host.max_new_len,
        max_kv_len=int(host.seq_lens.max(initial=0)),
    )
