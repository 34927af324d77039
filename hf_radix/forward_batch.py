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


def build_forward_batch(
    row_slots: Sequence[np.ndarray],
    new_token_ids: Sequence[np.ndarray],
    prefix_lens: Sequence[int],
    logits_offsets: Sequence[np.ndarray] | None,
    device: torch.device,
) -> ForwardBatch:
    """Packs B rows into one batch.

    Row i has context slots `row_slots[i]` (at least `prefix_lens[i] + len(new_token_ids[i])` long) and
    computes its new tokens at positions starting at `prefix_lens[i]`. `logits_offsets[i]` selects the
    new-token offsets whose logits are wanted (default: the last new token of each row).
    """
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    new_lens = np.fromiter((len(t) for t in new_token_ids), dtype=np.int64, count=len(new_token_ids))
    seq = prefix + new_lens
    qo_indptr = _indptr(new_lens)
    positions = np.arange(qo_indptr[-1], dtype=np.int64) - np.repeat(qo_indptr[:-1] - prefix, new_lens)
    kv = [slots[:n] for slots, n in zip(row_slots, seq)]
    prefix_kv = [slots[:n] for slots, n in zip(row_slots, prefix)]
    out_loc = [slots[p:n] for slots, p, n in zip(row_slots, prefix, seq)]
    if logits_offsets is None:
        logits = qo_indptr[1:] - 1
    else:
        logits = _concat(
            [np.asarray(o, dtype=np.int64) + start for o, start in zip(logits_offsets, qo_indptr)]
        )

    wide = _to_device(
        [
            _concat([np.asarray(t, dtype=np.int64) for t in new_token_ids]),
            positions,
            _concat(out_loc),
            _concat(kv),
            _concat(prefix_kv),
            logits,
        ],
        torch.int64,
        device,
    )
    narrow = _to_device([qo_indptr, prefix, seq, _indptr(seq), _indptr(prefix)], torch.int32, device)
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
        qo_indptr_host=qo_indptr,
        seq_lens_host=seq,
        max_new_len=int(new_lens.max(initial=0)),
        max_kv_len=int(seq.max(initial=0)),
    )
