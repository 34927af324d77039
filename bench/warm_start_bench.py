"""Warm start: 5-shot scoring in a fresh process after `load_cache` vs in a cold fresh process.

For each workload, a cold process builds the model (seeded random weights, so every process has the same),
warms the kernels up on other tokens, empties the cache, times its first `loglikelihood` run over the
workload and saves the cache; a second fresh process builds the same model, warms up, empties the cache,
loads the file and times the same first run. Workloads: "score_bench" (bench/score_bench.py's: 512
questions x 4 choices of 5-20 tokens behind a 1,500-token 5-shot prefix) and "letters" (the same with
one-token choices, as MMLU's " A"/" B"/" C"/" D"). Reported: first-run time ratio cold/warm (goal >= 5),
the same counting the load, save and load GB/s (K/V bytes; the file is read back from the page cache),
and the largest log-likelihood difference (0: the same numbers). `--tiny` runs every step (both fresh
processes included) on the CPU. Each workload is one part: the JSON is rewritten after each, and a part
that fails is recorded there while the others still run.

    python bench/warm_start_bench.py --json bench/results/warm_start_h200.json
    python bench/warm_start_bench.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ResultFile, bench_device, model_arguments, parser_for, say, seeded_model, timer  # noqa: E402
from score_bench import FULL, TINY, make_workload  # noqa: E402

from hf_radix import RadixBatchRunner  # noqa: E402

WORKLOADS = {"score_bench": {}, "letters": {"choice_len": (1, 1)}}
RESULT = "RESULT "


def phase(args) -> dict:
    """One fresh process: "cold" (time the first run, then save) or "warm" (load, then time the first run)."""
    device = bench_device(args)
    shape = {**(TINY if args.tiny else FULL), **WORKLOADS[args.workload]}
    with timer(device) as t:
        model = seeded_model(args, device)
    out: dict = {"model_build_seconds": t.seconds}
    say(f"{args.phase}: model built in {out['model_build_seconds']:.1f}s")
    runner = RadixBatchRunner(model, page_size=args.page_size, max_total_tokens=args.max_total_tokens)
    workload = [shape[k] for k in ("questions", "choices", "prefix_len", "question_len", "choice_len")]
    vocab = model.config.vocab_size
    warm_up = [max(1, workload[0] // 4), *workload[1:]]  # same shapes, other tokens: compiles the kernels
    runner.loglikelihood(make_workload(*warm_up, vocab, args.seed + 1), progress=False)
    runner.reset_cache()
    say(f"{args.phase}: warmed up")
    pairs = make_workload(*workload, vocab, args.seed)
    if args.phase == "warm":
        out["load"] = runner.load_cache(args.file)
        runner.check_integrity()
        say(f"{args.phase}: loaded {out['load']['tokens']:,} tokens in {out['load']['seconds']:.2f}s")
    before = runner.stats.prompt_tokens, runner.stats.cached_tokens
    with timer(device) as t:
        scores = runner.loglikelihood(pairs, progress=False)
    out["first_run_seconds"] = t.seconds
    out["prompt_tokens"] = runner.stats.prompt_tokens - before[0]
    out["cached_tokens"] = runner.stats.cached_tokens - before[1]
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"]
    say(f"{args.phase}: first run {out['first_run_seconds']:.2f}s, hit rate {out['hit_rate']:.3f}")
    runner.check_integrity()
    if args.phase == "cold":
        out["save"] = runner.save_cache(args.file)
        say(f"{args.phase}: saved {out['save']['tokens']:,} tokens in {out['save']['seconds']:.2f}s")
    out["scores"] = [s for s, _ in scores]
    return out


def run_phase(command: list[str], name: str, timeout: float) -> dict:
    """Runs one phase in a fresh process, echoing its output as it comes; returns its RESULT line."""
    with timer(sync=False) as t:
        result = watch(command, name, timeout)
    result["process_seconds"] = t.seconds
    return result


def watch(command: list[str], name: str, timeout: float) -> dict:
    """Runs `command`, echoing its output prefixed with `name`, killed after `timeout` seconds."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    killed = threading.Event()
    deadline = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
    deadline.start()
    tail: list[str] = []
    result = None
    try:
        for line in proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                continue
            print(f"  {name} | {line}", end="", flush=True)
            tail = [*tail[-40:], line]
        proc.wait()
    finally:
        deadline.cancel()
        proc.kill()
    if proc.returncode or result is None:
        why = f"killed after {timeout:.0f}s" if killed.is_set() else f"exit status {proc.returncode}"
        raise RuntimeError(f"{name} process failed ({why}):\n{''.join(tail)}")
    return result


def compare(cold: dict, warm: dict) -> dict:
    diff = np.abs(np.array(cold.pop("scores")) - np.array(warm.pop("scores")))
    return {
        "cold": cold,
        "warm": warm,
        "first_run_ratio": cold["first_run_seconds"] / warm["first_run_seconds"],
        "first_run_ratio_with_load": cold["first_run_seconds"]
        / (warm["first_run_seconds"] + warm["load"]["seconds"]),
        "save_gb_per_s": cold["save"]["gb_per_s"],
        "load_gb_per_s": warm["load"]["gb_per_s"],
        "cache_gb": cold["save"]["bytes"] / 1e9,
        "max_abs_logprob_diff": float(diff.max()) if len(diff) else 0.0,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = model_arguments(parser_for(__doc__))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--max-total-tokens", type=int, help="KV pool (default 200,000; tiny 16,384)")
    parser.add_argument("--dir", type=Path, help="where the cache files go (default: a temporary directory)")
    parser.add_argument("--phase-timeout", type=float, default=240.0,
                        help="seconds one fresh process may take")
    parser.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_total_tokens is None:
        args.max_total_tokens = 16384 if args.tiny else 200_000
    if args.phase:
        result = phase(args)
        print(RESULT + json.dumps(result), flush=True)
        return result
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")

    file = ResultFile(args.json, args, max_total_tokens=args.max_total_tokens, goal="first_run_ratio >= 5")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="hf_radix_warm_"))
    directory.mkdir(parents=True, exist_ok=True)
    passed = ["--page-size", str(args.page_size), "--max-total-tokens", str(args.max_total_tokens),
              "--seed", str(args.seed), *(["--tiny"] if args.tiny else []),
              *(["--layers", str(args.layers)] if args.layers else [])]
    for workload in workloads:
        cache = directory / f"{workload}.safetensors"
        with file.part(workload):
            try:
                runs = {}
                for name in ("cold", "warm"):
                    command = [sys.executable, __file__, *passed, "--phase", name, "--workload", workload,
                               "--file", str(cache)]
                    runs[name] = run_phase(command, f"{workload} {name}", args.phase_timeout)
            finally:
                cache.unlink(missing_ok=True)
            r = file.data["results"][workload] = compare(runs["cold"], runs["warm"])
            say(f"{workload:<12} cold {r['cold']['first_run_seconds']:.2f}s  warm "
                f"{r['warm']['first_run_seconds']:.2f}s (x{r['first_run_ratio']:.1f}; "
                f"x{r['first_run_ratio_with_load']:.1f} with the load)  save {r['save_gb_per_s']:.2f} GB/s  "
                f"load {r['load_gb_per_s']:.2f} GB/s  ({r['cache_gb']:.2f} GB)  "
                f"max |dlogp| {r['max_abs_logprob_diff']:.2e}")
    return file.finish()


if __name__ == "__main__":
    main()
