"""Where the time of a steady scoring run and of gsp decode steps goes: GPU kernels and host Python.

Prints torch.profiler tables (by GPU time) and cProfile tables (by own time) for one steady run of a
smaller scoring workload (the score_bench shape, fewer questions) and for a short gsp run (8 groups x 32
prompts, 2,048-token prefixes, 16 new tokens), Llama-3.1-8B shape, random bf16 weights. `--part decode`
profiles decode steps alone: the gsp prompts are cached by a first run, so a run of 64 new tokens computes
one prompt token a row and then decodes. `--hybrid` profiles bench/hybrid.py's Qwen3.5-shaped model (9B,
random bf16) with that benchmark's runner options instead; `--deterministic` the Llama in deterministic mode.

    python bench/profile_runs.py [--part score|gsp|decode|both] [--questions 128] [--hybrid]
        [--deterministic] [--json PATH]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybrid  # noqa: E402
from common import build_llama, measure, parser_for, timer, write_result  # noqa: E402
from score_bench import make_workload  # noqa: E402

from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402


def profiled(name: str, fn, walls: dict) -> None:
    """Runs `fn` once under cProfile and once under torch.profiler, after a warm run and a timed one (its
    first and steady wall times go into `walls`)."""
    timing = measure(fn, warmup=1, repeats=1, device="cuda")
    walls[name] = timing.summary()
    print(f"\n##### {name}: steady wall {timing.median_s:.3f} s (first {timing.first_s:.3f} s)")
    stats = cProfile.Profile()
    stats.enable()
    with timer("cuda"):
        fn()
    stats.disable()
    out = io.StringIO()
    pstats.Stats(stats, stream=out).sort_stats("tottime").print_stats(25)
    print(f"===== {name}: Python by own time =====")
    print("\n".join(out.getvalue().splitlines()[:45]))
    with torch.profiler.profile() as prof, timer("cuda"):
        fn()
    print(f"===== {name}: ops by GPU time =====")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    print(f"===== {name}: ops by host time (launches, graph launches, copies) =====")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--part", default="both", choices=["score", "gsp", "decode", "both"])
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--hybrid", action="store_true", help="the Qwen3.5-shaped model of bench/hybrid.py")
    parser.add_argument("--deterministic", action="store_true", help="the runner in deterministic mode")
    args = parser.parse_args()
    if args.hybrid:
        model = hybrid.build_model(False, "cuda", None)
        runner = RadixBatchRunner(model, **hybrid.RUNNER_OPTIONS)
    else:
        model = build_llama(False, "cuda")
        runner = RadixBatchRunner(model, max_total_tokens=200_000, max_running_requests=256,
                                  deterministic=args.deterministic)
    vocab = model.config.vocab_size
    walls: dict = {}
    if args.part in ("score", "both"):
        pairs = make_workload(args.questions, 4, 1500, 100, (5, 20), vocab, 0)

        def score() -> None:
            runner.reset_cache()
            runner.loglikelihood(pairs, progress=False)

        profiled(f"scoring {len(pairs)} pairs", score, walls)
    if args.part in ("gsp", "decode", "both"):
        gen = torch.Generator().manual_seed(0)
        prompts = []
        for _ in range(8):
            prefix = torch.randint(10, vocab, (2048,), generator=gen).tolist()
            prompts += [prefix + torch.randint(10, vocab, (256,), generator=gen).tolist() for _ in range(32)]
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)

        def gsp() -> None:
            runner.reset_cache()
            runner.run(prompts, params, progress=False)

        if args.part == "decode":
            runner.run(prompts, SamplingParams(max_new_tokens=1), progress=False)
            decode_params = SamplingParams(max_new_tokens=64, ignore_eos=True)
            profiled("gsp-8x32 decode, prompts cached, 64 new tokens",
                     lambda: runner.run(prompts, decode_params, progress=False), walls)
        else:
            profiled("gsp-8x32, 16 new tokens", gsp, walls)
    write_result({"wall_s": walls}, args.json, echo=False)


if __name__ == "__main__":
    main()
