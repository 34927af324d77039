"""GPU micro-benchmark of one sampling step: `Sampler.sample` (the Triton kernels) against a plain argmax.

For each `--rows`, requests each with its own seed (temperature, top-p, optionally top-k) over random
bf16 `[rows, vocab]` logits; the batch is staged once, then `--steps` steps are timed with CUDA events.
Reported per batch size: `greedy_ms` (argmax), `sampled_ms` (the kernels, every row seeded, top-p: no
top-k search launched), `sampled_host_ms` (the host's part of that step: launching), `mixed_ms` (every
other row greedy), `top_k_ms` (also top-k 50, transformers' sampling default), `fp32_ms` (as
`sampled_ms` on fp32 logits), `torch_ms` (the sort-based torch path, kept as the CPU fallback), the CUDA
kernels launched per step (`kernels_per_step`, `top_k_kernels_per_step`, from the profiler: the same at
every batch size), `kernel_us` / `fp32_kernel_us` (GPU time of one sampled step per kernel),
`torch_disagreeing_rows` (rows whose token differs from the torch path's: only where a token sits within
float rounding of the nucleus boundary, ~0; also `top_k_` and `fp32_`), `repeat_identical` and
`sampled_ms` as a share of a greedy decode step (`--decode-step-ms`, or `--gsp-json`'s GPU + host time
per step: the goal is within 10%). `tuning` times the kernels' configurations (digit bits, columns per
block and per program, warps) at the largest batch, top-p alone and with top-k 50, each with its
`torch_disagreeing_rows` and `repeat_identical`.
Run `python bench/sampling_bench.py --json PATH [--gsp-json bench/results/gsp_h200.json]` on a GPU."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_result  # noqa: E402

from hf_radix.kernels.triton_sampling import sample_rows  # noqa: E402
from hf_radix.sampling import Sampler, SamplingParams, SamplingRows, sample_rows_torch  # noqa: E402


def _time_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _host_ms(fn, steps: int) -> float:
    """Host time of one call of `fn` (launching only: the GPU is not waited for until the end)."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - started
    torch.cuda.synchronize()
    return 1e3 * host / steps


def _kernels(fn) -> dict[str, float]:
    """GPU microseconds of one call of `fn`, per kernel name (the count of launches: `_launches`)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
            times["launches"] = times.get("launches", 0) + 1
    return times


def _launches(fn) -> int:
    return int(_kernels(fn).get("launches", 0))


def _staged_sampler(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[Sampler, object]:
    """A sampler with `params` staged (one call made), and its step."""
    sampler, uids = Sampler(logits.device), list(range(len(params)))
    sampler.sample(logits, params, uids)
    return sampler, lambda: sampler.sample(logits, params, uids)


def _exactness(logits: torch.Tensor, rows: SamplingRows, **config: int) -> dict:
    """The kernels under `config` against the torch path at the rows' current steps (restored after)."""
    want = sample_rows_torch(logits, rows)
    before = rows.steps.clone()
    got = sample_rows(logits, rows, **config)
    rows.steps.copy_(before)
    again = sample_rows(logits, rows, **config)
    rows.steps.copy_(before)
    return {
        "repeat_identical": bool(torch.equal(again, got)),  # no atomics: True
        "torch_disagreeing_rows": int((want != got).sum()),  # near the nucleus boundary only: ~0
        "distinct_tokens": int(got.unique().numel()),
    }


def _one_size(rows: int, args: argparse.Namespace) -> dict:
    logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 4

    def params(top_k: int = -1) -> list[SamplingParams]:
        return [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k, seed=i)
                for i in range(rows)]

    sampler, step = _staged_sampler(logits, params())
    staged = sampler._staged.rows
    mixed = [p if i % 2 else SamplingParams() for i, p in enumerate(params())]
    top_k_sampler, top_k_step = _staged_sampler(logits, params(top_k=50))
    fp32_logits = logits.float()
    fp32_sampler, fp32_step = _staged_sampler(fp32_logits, params())
    kernel_us = _kernels(step)
    result = {
        "rows": rows,
        "greedy_ms": _time_ms(lambda: logits.argmax(-1), args.steps),
        "sampled_ms": _time_ms(step, args.steps),
        "sampled_host_ms": _host_ms(step, args.steps),
        "mixed_ms": _time_ms(_staged_sampler(logits, mixed)[1], args.steps),
        "top_k_ms": _time_ms(top_k_step, args.steps),
        "fp32_ms": _time_ms(fp32_step, args.steps),
        "torch_ms": _time_ms(lambda: sample_rows_torch(logits, staged), max(3, args.steps // 10)),
        "kernels_per_step": int(kernel_us.pop("launches")),
        "top_k_kernels_per_step": _launches(top_k_step),
        "greedy_kernels_per_step": _launches(lambda: logits.argmax(-1)),
        "kernel_us": kernel_us,  # GPU time of one sampled step per kernel
        "fp32_kernel_us": {k: v for k, v in _kernels(fp32_step).items() if k != "launches"},
    }
    result.update(_exactness(logits, staged))
    for name, case, other in (("top_k", logits, top_k_sampler), ("fp32", fp32_logits, fp32_sampler)):
        disagreeing = _exactness(case, other._staged.rows)["torch_disagreeing_rows"]
        result[f"{name}_torch_disagreeing_rows"] = disagreeing
    result["sampled_share_of_decode_step"] = result["sampled_ms"] / args.decode_step_ms
    return result


_CONFIGS = (  # digit_bits, block, chunk, num_warps; the first is sample_rows' default
    (4, 256, 4096, 8), (4, 256, 4096, 4), (4, 256, 2048, 4), (4, 128, 4096, 8), (4, 128, 2048, 4),
    (4, 256, 2048, 8), (4, 256, 8192, 16), (4, 512, 8192, 16), (4, 128, 1024, 2), (2, 256, 4096, 8),
    (8, 256, 4096, 8), (8, 128, 2048, 4),
)


def _tuning(rows: int, args: argparse.Namespace) -> list[dict]:
    """Each configuration timed at `rows` rows (top-p alone, and with top-k 50), with its exactness."""
    logits = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 4
    out = []
    for top_k in (-1, 50):
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k, seed=i)
                  for i in range(rows)]
        staged = _staged_sampler(logits, params)[0]._staged.rows
        for digit_bits, block, chunk, warps in _CONFIGS:
            config = dict(digit_bits=digit_bits, block=block, chunk=chunk, num_warps=warps)
            exact = _exactness(logits, staged, **config)

            def fn(staged=staged, config=config):
                return sample_rows(logits, staged, **config)

            out.append(dict(top_k=top_k, **config, ms=_time_ms(fn, args.steps),
                            repeat_identical=exact["repeat_identical"],
                            torch_disagreeing_rows=exact["torch_disagreeing_rows"]))
    return out


def _decode_step_ms(args: argparse.Namespace) -> tuple[float, str]:
    """The greedy decode step to compare with: `--decode-step-ms`, or GPU + host per step of `--gsp-json`."""
    if args.gsp_json is None:
        return args.decode_step_ms, "--decode-step-ms"
    shared = json.loads(args.gsp_json.read_text())["shared"]
    return shared["decode_step_gpu_ms"] + shared["decode_step_host_ms"], f"{args.gsp_json}: shared gpu + host"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=str, default="8,64,256", help="comma-separated batch sizes")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--decode-step-ms", type=float, default=13.0, help="a greedy decode step (gsp-8x32)")
    ap.add_argument("--gsp-json", type=Path, default=None,
                    help="a gsp result (bench/results/gsp_h200.json): its step's GPU + host time replaces "
                    "--decode-step-ms")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-tuning", action="store_true", help="the default configuration only")
    args = ap.parse_args()
    sizes = [int(r) for r in args.rows.split(",")]
    args.decode_step_ms, source = _decode_step_ms(args)
    _one_size(max(sizes), args)  # compiles, and brings the clocks up before anything is timed
    print("warmed up", flush=True)
    result = {
        "vocab": args.vocab,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "decode_step_ms": args.decode_step_ms,
        "decode_step_source": source,
        "sizes": [_one_size(rows, args) for rows in sizes],
        "tuning": [] if args.no_tuning else _tuning(max(sizes), args),
        "device": torch.cuda.get_device_name(),
    }
    write_result(result, args.json)


if __name__ == "__main__":
    main()
