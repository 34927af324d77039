"""GPU tests of the metadata path: a CPU and a CUDA page table holding the same rows, to compare."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from hf_radix.memory.page_table import PageTable


class TwinTables(NamedTuple):
    tables: list[PageTable]  # on the CPU, on CUDA
    rows: np.ndarray  # the same five rows in both
    lens: np.ndarray  # each row's context written so far
    contexts: list[np.ndarray]  # each row's 60 slots: the first `lens` written, then free to write
    tokens: np.ndarray  # each row's next token, set on the device


def cpu_and_cuda_tables(gen: np.random.Generator, first_token: int = 0) -> TwinTables:
    """Two page tables (4,096 slots, rows of 64) with five rows each: random context slots, the first 40
    written, and a next token in ``[first_token, 1000)`` a row."""
    tables = [PageTable(4096, device, scratch_slot=4096, width=64) for device in ("cpu", "cuda")]
    rows = np.array([[t.open() for _ in range(5)] for t in tables][0])
    lens = gen.integers(3, 40, 5)
    contexts = [gen.permutation(4096)[:60] for _ in rows]
    tokens = gen.integers(first_token, 1000, 5)
    for table in tables:
        for row, context in zip(rows, contexts):
            table.write_row(int(row), 0, context[:40])
        table.set_next_tokens(torch.as_tensor(rows, device=table.device),
                              torch.as_tensor(tokens, device=table.device))
    return TwinTables(tables, rows, lens, contexts, tokens)
