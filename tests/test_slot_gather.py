"""The one-launch slot-list gather (`kernels.triton_slots`) against `gather_contexts`' torch form.

Runs of the flat page table (empty runs, runs longer than a program's block, int32 slots) concatenated
into int64: under the Triton interpreter on the CPU, compiled for sm90, and on a GPU when there is one.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from interpreter import interpreter_test, report_checks

from hf_radix.paged_attention import forward_batch
from hf_radix.paged_attention.forward_batch import gather_contexts


def _case(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, list]:
    """A random table (int32 slots) and rows: flat slots, bases, int32 indptr, total, longest, expected."""
    gen = np.random.default_rng(seed)
    rows_in_table, width = int(gen.integers(2, 6)), int(gen.choice([8, 40, 2600]))
    slots = gen.integers(0, 2**31 - 1, size=rows_in_table * width).astype(np.int32)
    count = int(gen.integers(1, 7))
    rows = gen.integers(0, rows_in_table, size=count)
    lengths = gen.integers(0, width + 1, size=count)
    lengths[gen.random(count) < 0.3] = 0  # empty runs
    indptr = np.r_[0, np.cumsum(lengths)]
    want = np.concatenate([slots.reshape(-1, width)[r, :n] for r, n in zip(rows, lengths, strict=True)])
    return (torch.from_numpy(slots).to(device), torch.from_numpy(rows * width - indptr[:-1]).to(device),
            torch.from_numpy(indptr.astype(np.int32)).to(device), int(indptr[-1]), int(lengths.max()),
            want.astype(np.int64).tolist())


def _check_matches(device: str = "cpu") -> dict:
    """Every case: the kernel's list (into `out`, the rest of `out` untouched) is the expected one."""
    from hf_radix.kernels.triton_slots import gather_runs

    bad = []
    for seed in range(24):
        flat, bases, indptr, total, longest, want = _case(seed, device)
        out = torch.full((total + 5,), -1, dtype=torch.int64, device=device)
        got = gather_runs(flat, bases, indptr, longest, out[:total])
        if got.tolist() != want or out[total:].ne(-1).any():
            bad.append(seed)
    return {"ok": not bad, "bad_seeds": bad}


def _check_dispatch() -> dict:
    """`gather_contexts` takes the kernel under the interpreter, and its result equals the torch form's."""
    flat, bases, indptr, total, longest, want = _case(3)
    via_kernel = gather_contexts(flat, bases, indptr, total, longest).tolist()
    forward_batch.triton_runs_on = lambda tensor: False
    via_torch = gather_contexts(flat, bases, indptr, total, longest).tolist()
    return {"ok": via_kernel == want == via_torch}


CHECKS = {"kernel_matches_the_runs": _check_matches, "gather_contexts_dispatch": _check_dispatch}
# the kernel alone: no transformers version changes it (run once, on the newest)
test_gather_kernel_under_the_interpreter = pytest.mark.slow(interpreter_test(__file__, CHECKS))


@pytest.mark.parametrize("seed", range(6))
def test_torch_form_matches_the_runs(seed: int):
    flat, bases, indptr, total, longest, want = _case(seed)
    assert gather_contexts(flat, bases, indptr, total, longest).tolist() == want


@pytest.mark.slow
def test_gather_kernel_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_radix.kernels import FP_FUSION
    from hf_radix.kernels.triton_slots import BLOCK, _gather_runs_kernel

    signature = {"flat_slots": "*i32", "bases": "*i64", "indptr": "*i32", "out": "*i64", "BLOCK": "constexpr"}
    compiled = triton.compile(ASTSource(_gather_runs_kernel, signature, constexprs={"BLOCK": BLOCK}),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "enable_fp_fusion": FP_FUSION})  # as launched
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gather_kernel_matches_the_runs_on_gpu():
    result = _check_matches("cuda")
    assert result["ok"], result


if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)
