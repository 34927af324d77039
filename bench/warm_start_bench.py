"""Warm start: 5-shot scoring in a fresh process after `load_cache` vs in a cold fresh process.

For each workload, a cold process builds the model (seeded random weights, so every process has the same),
warms the kernels up on other tokens, empties the cache, times its first `loglikelihood` run over the
workload and saves the cache; a second fresh process builds the same model, warms up, empties the cache,
loads the file and times the same first run. Workloads: "score_bench" (bench/score_bench.py's: 512
questions x 4 choices of 5-20 tokens behind a 1,500-token 5-shot prefix) and "letters" (the same with
one-token choices, as MMLU's " A"/" B"/" C"/" D"). Reported: first-run time ratio cold/warm, save and load
GB/s (K/V bytes; the file is read back from the page cache), and the largest log-likelihood difference.

    python bench/warm_start_bench.py --out bench/results/warm_start_h200.json
    python bench/warm_start_bench.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chat_bench import build_model  # noqa: E402
from score_bench import FULL, TINY, make_workload  # noqa: E402

from hf_radix import RadixBatchRunner  # noqa: E402

WORKLOADS = {"score_bench": {}, "letters": {"choice_len": (1, 1)}}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def phase(args) -> dict:
    """One fresh process: "cold" (time the first run, then save) or "warm" (load, then time the first run)."""
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = {**(TINY if args.tiny else FULL), **WORKLOADS[args.workload]}
    start = time.perf_counter()
    model = build_model(args, device)
    _sync(device)
    build_s = time.perf_counter() - start
    runner = RadixBatchRunner(model, page_size=args.page_size, max_total_tokens=args.max_total_tokens)
    workload = [shape[k] for k in ("questions", "choices", "prefix_len", "question_len", "choice_len")]
    vocab = model.config.vocab_size
    warm_up = [max(1, workload[0] // 4), *workload[1:]]  # same shapes, other tokens: compiles the kernels
    runner.loglikelihood(make_workload(*warm_up, vocab, args.seed + 1), progress=False)
    runner.reset_cache()
    pairs = make_workload(*workload, vocab, args.seed)
    out: dict = {"model_build_seconds": build_s}
    if args.phase == "warm":
        out["load"] = runner.load_cache(args.file)
        runner.check_integrity()
    before = runner.stats.prompt_tokens, runner.stats.cached_tokens
    _sync(device)
    start = time.perf_counter()
    scores = runner.loglikelihood(pairs, progress=False)
    _sync(device)
    out["first_run_seconds"] = time.perf_counter() - start
    out["prompt_tokens"] = runner.stats.prompt_tokens - before[0]
    out["cached_tokens"] = runner.stats.cached_tokens - before[1]
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    runner.check_integrity()
    if args.phase == "cold":
        out["save"] = runner.save_cache(args.file)
    out["scores"] = [s for s, _ in scores]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: a self-check")
    parser.add_argument("--layers", type=int, help="8B width with this many layers (a smaller shape)")
    parser.add_argument("--workloads", default="score_bench,letters")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, help="KV pool (default 200,000; tiny 16,384)")
    parser.add_argument("--dir", type=Path, help="where the cache files go (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    parser.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_total_tokens is None:
        args.max_total_tokens = 16384 if args.tiny else 200_000
    if args.phase:
        result = phase(args)
        print("RESULT " + json.dumps(result))
        return result

    directory = args.dir or Path(tempfile.mkdtemp(prefix="hf_radix_warm_"))
    passed = ["--page-size", str(args.page_size), "--max-total-tokens", str(args.max_total_tokens),
              "--seed", str(args.seed), *(["--tiny"] if args.tiny else []),
              *(["--layers", str(args.layers)] if args.layers else [])]
    results = {}
    for workload in args.workloads.split(","):
        file = directory / f"{workload}.safetensors"
        runs = {}
        for name in ("cold", "warm"):
            command = [sys.executable, __file__, *passed, "--phase", name, "--workload", workload,
                       "--file", str(file)]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode or not lines:
                raise RuntimeError(f"{name} phase failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            runs[name] = json.loads(lines[-1][len("RESULT ") :])
        file.unlink(missing_ok=True)
        cold, warm = runs["cold"], runs["warm"]
        diff = np.abs(np.array(cold.pop("scores")) - np.array(warm.pop("scores")))
        results[workload] = {
            "cold": cold, "warm": warm,
            "first_run_ratio": cold["first_run_seconds"] / warm["first_run_seconds"],
            "first_run_ratio_with_load": cold["first_run_seconds"]
            / (warm["first_run_seconds"] + warm["load"]["seconds"]),
            "save_gb_per_s": cold["save"]["gb_per_s"], "load_gb_per_s": warm["load"]["gb_per_s"],
            "cache_gb": cold["save"]["bytes"] / 1e9,
            "max_abs_logprob_diff": float(diff.max()),
        }
        r = results[workload]
        print(f"{workload:<12} cold {cold['first_run_seconds']:.2f}s  warm {warm['first_run_seconds']:.2f}s "
              f"(x{r['first_run_ratio']:.1f}; x{r['first_run_ratio_with_load']:.1f} with the load)  "
              f"save {r['save_gb_per_s']:.2f} GB/s  load {r['load_gb_per_s']:.2f} GB/s  "
              f"({r['cache_gb']:.2f} GB)  max |dlogp| {r['max_abs_logprob_diff']:.2e}")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    out = {
        "command": " ".join(["python", *sys.argv]),
        "config": {
            "model": "tiny llama fp32" if args.tiny else f"Llama-3.1-8B shape ({args.layers or 32} layers), "
                                                         "random bf16 weights",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "page_size": args.page_size, "max_total_tokens": args.max_total_tokens,
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "results": results,
        "goal": "first_run_ratio >= 5",
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
