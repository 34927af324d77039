"""Slot lists from the device page table in one Triton launch: runs of the flat table, concatenated.

`forward_batch.gather_contexts` defines the result (its torch form takes six launches: arange,
searchsorted, two gathers, an add and a copy). Here one program copies a block of one run: run `i`
covers entries `indptr[i] <= k < indptr[i + 1]` of the result, and entry `k` reads `flat_slots[bases[i] + k]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION

BLOCK = 1024  # entries a program copies


@triton.jit
def _gather_runs_kernel(flat_slots, bases, indptr, out, BLOCK: tl.constexpr):
    run = tl.program_id(0)
    start = tl.load(indptr + run)
    end = tl.load(indptr + run + 1)
    offs = start + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
    base = tl.load(bases + run)
    slots = tl.load(flat_slots + base + offs, mask=mask)
    tl.store(out + offs, slots.to(tl.int64), mask=mask)


def gather_runs(
    flat_slots: torch.Tensor, bases: torch.Tensor, indptr: torch.Tensor, longest: int, out: torch.Tensor
) -> torch.Tensor:
    """Writes every run (one a `bases` entry; `longest` the longest run's length) into `out` (int64);
    returns it."""
    runs = bases.shape[0]
    if runs > 0 and longest > 0:
        _gather_runs_kernel[(runs, triton.cdiv(longest, BLOCK))](
            flat_slots, bases, indptr, out, BLOCK=BLOCK, enable_fp_fusion=FP_FUSION
        )
    return out
