"""GPU micro-benchmark of one sampling step: `Sampler.sample` (the Triton kernels) against a plain argmax.

For each `--rows`, requests each with its own seed (temperature, top-p, optionally top-k) over random
bf16 `[rows, vocab]` logits; the batch is staged once, then `--steps` steps are timed with CUDA events.
Reported per batch size: `greedy_ms` (argmax), `sampled_ms` (the kernels, every row seeded), `mixed_ms`
(every other row greedy), `top_k_ms` (also top-k 50, transformers' sampling default), `fp32_ms` (as
`sampled_ms` on fp32 logits), `torch_ms` (the sort-based torch path, kept as the CPU fallback), each CUDA
kernel of a step in launch order with its time (`launches`, `top_k_launches`: from the profiler) and their
count (`kernels_per_step`: the same at every batch size),
`torch_disagreeing_rows` (rows whose token differs from the torch path's: only where a token sits within
float rounding of the nucleus boundary, ~0) and `sampled_ms` as a share of a greedy decode step
(`--decode-step-ms`: the goal is within 10%). `tuning` times the kernels' configurations (digit bits,
columns per block and per program, warps) at the largest batch, top-p alone and with top-k 50.
Run `python bench/sampling_bench.py --json PATH` on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import parser_for, timer, write_result  # noqa: E402

from hf_radix.kernels.triton_sampling import sample_rows  # noqa: E402
from hf_radix.scheduling.sampling import Sampler, SamplingParams, sample_rows_torch  # noqa: E402


def _time_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    with timer(events=True) as t:
        for _ in range(steps):
            fn()
    return t.ms / steps


def _launch_breakdown(fn) -> list[dict]:
    """Each CUDA kernel of one call in launch order, with its device time (us), from the profiler."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    return [{"kernel": e.name, "us": e.time_range.elapsed_us()} for e in kernels]


def _staged_sampler(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[Sampler, object]:
    """A sampler with `params` staged (one call made), and its step."""
    sampler, uids = Sampler(logits.device), list(range(len(params)))
    sampler.sample(logits, params, uids)
    return sampler, lambda: sampler.sample(logits, params, uids)


def _kernel_args(sampler: Sampler) -> tuple[torch.Tensor, ...]:
    b = sampler._staged
    return b.inv_temperature, b.top_k, b.top_p, b.seed_keys, b.steps


def _one_size(rows: int, args: argparse.Namespace) -> dict:
    logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 4

    def params(top_k: int = -1) -> list[SamplingParams]:
        return [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k, seed=i)
                for i in range(rows)]

    sampler, step = _staged_sampler(logits, params())
    staged = _kernel_args(sampler)
    mixed = [p if i % 2 else SamplingParams() for i, p in enumerate(params())]
    result = {
        "rows": rows,
        "greedy_ms": _time_ms(lambda: logits.argmax(-1), args.steps),
        "sampled_ms": _time_ms(step, args.steps),
        "mixed_ms": _time_ms(_staged_sampler(logits, mixed)[1], args.steps),
        "top_k_ms": _time_ms(_staged_sampler(logits, params(top_k=50))[1], args.steps),
        "fp32_ms": _time_ms(_staged_sampler(logits.float(), params())[1], args.steps),
        "torch_ms": _time_ms(lambda: sample_rows_torch(logits, *staged), max(3, args.steps // 10)),
        "launches": _launch_breakdown(step),
        "greedy_kernels_per_step": len(_launch_breakdown(lambda: logits.argmax(-1))),
        "top_k_launches": _launch_breakdown(_staged_sampler(logits, params(top_k=50))[1]),
    }
    want = sample_rows_torch(logits, *staged)  # before the kernel advances the steps
    before = staged[-1].clone()
    got = sample_rows(logits, *staged)
    staged[-1].copy_(before)
    result["repeat_identical"] = bool(torch.equal(sample_rows(logits, *staged), got))  # no atomics: True
    result["torch_disagreeing_rows"] = int((want != got).sum())  # near the nucleus boundary only: ~0
    result["distinct_tokens"] = int(got.unique().numel())
    result["kernels_per_step"] = len(result["launches"])
    result["sampled_share_of_decode_step"] = result["sampled_ms"] / args.decode_step_ms
    return result


_CONFIGS = (  # digit_bits, block, chunk, num_warps; the first is sample_rows' default
    (4, 64, 2048, 1), (4, 256, 4096, 4), (4, 128, 4096, 2), (4, 64, 1024, 1), (4, 32, 1024, 1),
    (4, 64, 2048, 2), (4, 64, 4096, 1), (4, 128, 2048, 1), (2, 64, 2048, 1), (2, 128, 4096, 2),
)


def _tuning(rows: int, args: argparse.Namespace) -> list[dict]:
    logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 4
    out = []
    for top_k in (-1, 50):
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k, seed=i)
                  for i in range(rows)]
        staged = _kernel_args(_staged_sampler(logits, params)[0])
        for digit_bits, block, chunk, warps in _CONFIGS:
            fn = functools.partial(sample_rows, logits, *staged, top_k_rows=top_k > 0, digit_bits=digit_bits,
                                   block=block, chunk=chunk, num_warps=warps)
            out.append(dict(top_k=top_k, digit_bits=digit_bits, block=block, chunk=chunk, num_warps=warps,
                            ms=_time_ms(fn, args.steps)))
    return out


def main() -> None:
    ap = parser_for(__doc__)
    ap.add_argument("--rows", type=str, default="8,64,256", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--decode-step-ms", type=float, default=13.0, help="a greedy decode step (gsp-8x32)")
    args = ap.parse_args()
    sizes = [int(r) for r in args.rows.split(",")]
    result = {
        "vocab": args.vocab,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "decode_step_ms": args.decode_step_ms,
        "sizes": [_one_size(rows, args) for rows in sizes],
        "tuning": _tuning(max(sizes), args),
        "device": torch.cuda.get_device_name(),
    }
    write_result(result, args.json)


if __name__ == "__main__":
    main()
