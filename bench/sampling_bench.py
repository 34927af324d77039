"""GPU micro-benchmark of one sampling step: `Sampler.sample` against a plain argmax (greedy).

`--rows` requests, each with its own seed (temperature, top-p), over random `[rows, vocab]` logits; the
batch is staged once, then `--steps` steps are timed with CUDA events. Also reports the aten ops per step
(the kernel launches; the same for any batch). Run `python bench/sampling_bench.py [--json PATH]` on a GPU;
compare `sampled_ms` with a decode step's time (the goal: seeded sampling within 10% of a greedy step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_radix.sampling import Sampler, SamplingParams  # noqa: E402


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logits = torch.randn(args.rows, args.vocab, device="cuda", dtype=torch.bfloat16) * 4
    params = [SamplingParams(temperature=0.7, top_p=args.top_p, seed=i) for i in range(args.rows)]
    uids = list(range(args.rows))
    sampler = Sampler(logits.device)
    sampler.sample(logits, params, uids)
    with _CountOps() as ops:
        sampler.sample(logits, params, uids)
    result = {
        "rows": args.rows,
        "vocab": args.vocab,
        "top_p": args.top_p,
        "greedy_ms": _time_ms(lambda: logits.argmax(-1), args.steps),
        "sampled_ms": _time_ms(lambda: sampler.sample(logits, params, uids), args.steps),
        "ops_per_step": ops.count,
        "device": torch.cuda.get_device_name(),
        "command": "python bench/sampling_bench.py " + " ".join(sys.argv[1:]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
