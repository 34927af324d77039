"""The token ids of a generate call's rows: each row's prompt, then the tokens each step adds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class RowTokens:
    """Every row's tokens in one growable int64 array (row `b` holds `length(b)` tokens from column 0).

    A step's new tokens land for all rows in one vectorized write; rows are read as views (`row`), which
    the tree and the step metadata take without conversion.
    """

    def __init__(self, prompts: Sequence[np.ndarray], room: int = 16):
        self.lens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        width = int(self.lens.max(initial=0)) + max(room, 1)
        self._ids = np.zeros((len(prompts), width), dtype=np.int64)
        for b, prompt in enumerate(prompts):
            self._ids[b, : len(prompt)] = prompt
        self._rows = np.arange(len(prompts))[:, None]

    def length(self, b: int) -> int:
        return int(self.lens[b])

    def row(self, b: int) -> np.ndarray:
        """Row `b`'s tokens (a view: appends add columns past it and never change it)."""
        return self._ids[b, : self.lens[b]]

    def append(self, new: np.ndarray) -> None:
        """Adds `new[b]` (`[rows, k]`) after each row's tokens."""
        k = new.shape[1]
        need = int(self.lens.max(initial=0)) + k
        if need > self._ids.shape[1]:
            grown = np.zeros((len(self.lens), max(need, 2 * self._ids.shape[1])), dtype=np.int64)
            grown[:, : self._ids.shape[1]] = self._ids
            self._ids = grown
        self._ids[self._rows, self.lens[:, None] + np.arange(k)] = new
        self.lens += k


def host_inputs(
    ids: torch.Tensor | None, mask: torch.Tensor | None, fresh: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The new positions' ids (int64) and attention mask (bool) on the host: one copy when both are on
    one device (each copy from a GPU waits for it)."""
    mask = None if mask is None else mask[:, -fresh:]
    if ids is not None and mask is not None and ids.device == mask.device and ids.shape == mask.shape:
        both = torch.stack([ids.long(), mask.long()]).cpu().numpy()
        return both[0], both[1].astype(bool)
    host_ids = None if ids is None else ids.long().cpu().numpy()
    return host_ids, None if mask is None else mask.cpu().numpy().astype(bool)
