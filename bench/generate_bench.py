"""generate(cache_implementation="radix") against the default cache: a long shared few-shot prefix, batch 1.

Workload (H200): Llama-3.1-8B shape with random bf16 weights; every prompt is the same 4,096-token few-shot
prefix + its own 64-token question; questions run one after another, radix and default alternating, in one
process. Measured per question, median over the questions (warm-up and a priming call come first):

  (a) time to first token: a whole `generate(max_new_tokens=1)` call           goal: radix >= 12x faster
  (b) a whole call with 4 new tokens                                           goal: radix >= 6.5x faster
  (c) one decode step at a 4K context: (t(max_new_tokens=65) - t(1)) / 64      goal: radix within 10%

`first_call_s` is the first call of each kind in the process (on another prefix): for radix it includes
the engine's warm-up (every graph captured, eager kernels compiled; `warm_up_s` splits it), which the
first radix generate on a model runs once. `cold_ttft_s` is the priming call that computes the prefix.

    python bench/generate_bench.py --json bench/results/generate_bench_h200.json
    python bench/generate_bench.py --tiny            # CPU self-check: tiny model, seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, generate_device, generate_parser, timed, timer, write_result  # noqa: E402

import hf_radix  # noqa: E402

SIZES = dict(prefix=4096, question=64, questions=20)  # unless given; --tiny: TINY_SIZES
TINY_SIZES = dict(prefix=256, question=16, questions=3)
GOALS = {"ttft_speedup": 12.0, "call4_speedup": 6.5, "decode_ratio_max": 1.10, "state_check_max": 0.01}


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, float]:
    """The benchmark model built directly on `device`; returns it and the seconds it took."""
    with timer(device) as t:
        model = build_llama(tiny, device, dtype)
    return model, t.seconds


def time_state_check(model: torch.nn.Module, engine, repeats: int = 2000) -> list[float]:
    """Seconds of the model-state check a radix call starts with (engine lookup + sync), unchanged model."""
    out = []
    for _ in range(repeats):
        with timer(sync=False) as t, engine.lock:
            hf_radix.get_engine(model).sync_model_state()
        out.append(t.seconds)
    return out


def distinct_questions(gen: torch.Generator, count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` random questions whose first tokens all differ (so each matches exactly the shared prefix)."""
    firsts = torch.randperm(vocab - 2, generator=gen)[:count] + 2
    rest = torch.randint(2, vocab, (count, length - 1), generator=gen)
    return [[int(f), *r.tolist()] for f, r in zip(firsts, rest, strict=True)]


def run(args: argparse.Namespace) -> dict:
    device = generate_device(args, SIZES, TINY_SIZES)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    model, init_s = build_model(args.tiny, device, dtype)
    pool = dict(max_total_tokens=args.max_total_tokens) if args.max_total_tokens else dict(mem_fraction=0.5)
    engine = hf_radix.configure(
        model, page_size=args.page_size, attn_backend=args.attn_backend, cuda_graph=not args.no_cuda_graph,
        fused_ops=not args.no_fused_ops, **pool,
    )
    vocab = model.config.vocab_size

    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, vocab, (args.prefix,), generator=gen).tolist()
    n = args.questions
    questions = distinct_questions(gen, 3 * n + 4, args.question, vocab)
    q_a, q_b, q_c = questions[:n], questions[n:2 * n], questions[2 * n:3 * n]
    warm_other, prime = questions[3 * n:3 * n + 2], questions[3 * n + 2]
    other_prefix = torch.randint(2, vocab, (args.prefix,), generator=gen).tolist()

    def call(ids: list[int], new: int, radix: bool) -> torch.Tensor:
        extra = dict(cache_implementation="radix") if radix else {}
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), device=device,
                                                                              dtype=torch.long),
                max_new_tokens=new, do_sample=False, **extra,
            )
        return out[0, len(ids):]

    # warm-up: kernels, allocator, Triton compilation; on another prefix so nothing measured is cached by it
    first = {}
    for radix in (False, True):
        for i, q in enumerate(warm_other):
            for new in (1, 4, 3):
                elapsed, _ = timed(lambda q=q, new=new, r=radix: call(other_prefix + q, new, r), device)
                if i == 0 and new == 1:
                    first[radix] = elapsed
    # priming: the first call with the shared prefix computes it (the radix cold start)
    cold = {radix: timed(lambda r=radix: call(prefix + prime, 1, r), device)[0] for radix in (False, True)}
    if args.profile:
        return profile(device, lambda q, new, r: call(prefix + q, new, r), q_a, q_b, args.trace_dir)
    computed_before = engine.stats.computed_tokens

    times: dict[str, dict[str, list[float]]] = {"default": {}, "radix": {}}
    agree = 0
    for part, qs, new in (("ttft", q_a, 1), ("call4", q_b, 4), ("call65", q_c, 65)):
        for name in times:
            times[name][part] = []
        for q in qs:
            outs = {}
            for name, radix in (("default", False), ("radix", True)):
                elapsed, outs[name] = timed(lambda q=q, new=new, r=radix: call(prefix + q, new, r), device)
                times[name][part].append(elapsed)
            if part == "call4":
                agree += int(torch.equal(outs["default"], outs["radix"]))
    engine.check_integrity()
    check_s = time_state_check(model, engine)

    med = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in times.items()}
    decode = {name: (m["call65"] - m["ttft"]) / 64 for name, m in med.items()}
    ratios = {
        "ttft_speedup": med["default"]["ttft"] / med["radix"]["ttft"],
        "call4_speedup": med["default"]["call4"] / med["radix"]["call4"],
        "decode_ratio": decode["radix"] / decode["default"],
        "state_check_of_call4": statistics.median(check_s) / med["radix"]["call4"],
    }
    stats = hf_radix.cache_stats(model)
    core = engine.model_runner
    return {
        "config": {
            "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shape (random weights)",
            "dtype": str(dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "prefix_tokens": args.prefix,
            "question_tokens": args.question,
            "questions_per_part": n,
            "page_size": args.page_size,
            "attn_backend": engine.backend.name,
            "radix_cuda_graphs": core.has_graphs,
            "fused_norm_rope_in_graphs": core.has_graphs and core.fused_ops,
            "default_attention": "sdpa",
            "pool_tokens": engine.pool_tokens,
            "model_init_s": init_s,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "first_call_s": {"default": first[False], "radix": first[True]},
        "warm_up_s": core.warm_up_times,
        "graph_reserve_gib": engine.graph_reserve / 2**30,
        "cold_ttft_s": {"default": cold[False], "radix": cold[True]},
        "median_s": med,
        "decode_step_s": decode,
        "ratios": ratios,
        "goals": GOALS,
        "goals_met": {
            "ttft_speedup": ratios["ttft_speedup"] >= GOALS["ttft_speedup"],
            "call4_speedup": ratios["call4_speedup"] >= GOALS["call4_speedup"],
            "decode_ratio": ratios["decode_ratio"] <= GOALS["decode_ratio_max"],
            "state_check": ratios["state_check_of_call4"] <= GOALS["state_check_max"],
        },
        "state_check_us": {
            "median": statistics.median(check_s) * 1e6, "p90": statistics.quantiles(check_s, n=10)[-1] * 1e6,
            "tensors_tracked": engine.state.num_tensors,
            "what": "get_engine + sync_model_state, as a call does",
        },
        "call4_greedy_agreement": agree / n,
        "radix_tokens_computed_in_measured_calls": engine.stats.computed_tokens - computed_before,
        "cache_stats": stats,
        "graph_replays": core.has_graphs and {
            "decode": core.decode_graphs.replays, "extend": core.extend_graphs.replays
        },
        "raw_s": times,
    }


def profile(device: torch.device, call: Callable, q_a: list[list[int]], q_b: list[list[int]],
            trace_dir: Path | None) -> dict:
    """Where the time of TTFT calls and short generations goes: Python (cProfile), GPU kernels, and
    (with `trace_dir`) Chrome traces of whole calls, host and device on one timeline."""
    import cProfile
    import io
    import pstats

    for radix, name in ((False, "default"), (True, "radix")):
        for q, new in ((q_a[0], 1), (q_b[0], 17)):
            stats = cProfile.Profile()
            with timer(device):
                stats.enable()
                call(q, new, radix)
            stats.disable()
            out = io.StringIO()
            pstats.Stats(stats, stream=out).sort_stats("tottime").print_stats(18)
            print(f"\n===== {name}, max_new_tokens={new}: Python, by own time =====")
            print("\n".join(out.getvalue().splitlines()[:40]))
            out = io.StringIO()
            pstats.Stats(stats, stream=out).sort_stats("cumulative").print_stats("hf_radix|generation", 30)
            print(f"\n===== {name}, max_new_tokens={new}: hf_radix and generate, by cumulative time =====")
            print("\n".join(out.getvalue().splitlines()[:50]))
        for q, new in ((q_a[1], 1), (q_b[1], 9)):
            with torch.profiler.profile() as prof, timer(device):
                call(q, new, radix)
            print(f"\n===== {name}, max_new_tokens={new}: kernels and ops by GPU time =====")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
            print(f"\n===== {name}, max_new_tokens={new}: ops by host time (launch costs, syncs) =====")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            if trace_dir is not None:
                trace_dir.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(trace_dir / f"{name}_new{new}.json"))
    return {"profile": True}


def print_table(result: dict) -> None:
    med, decode, ratios = result["median_s"], result["decode_step_s"], result["ratios"]
    goals, cfg = result["goals"], result["config"]
    print(f"\n{cfg['model']} {cfg['dtype']} on {cfg['device']}: prefix {cfg['prefix_tokens']} + question "
          f"{cfg['question_tokens']}, {cfg['questions_per_part']} questions, median")
    rows = [
        ("time to first token", med["default"]["ttft"], med["radix"]["ttft"], ratios["ttft_speedup"],
         f">= {goals['ttft_speedup']:g}x faster"),
        ("call, 4 new tokens", med["default"]["call4"], med["radix"]["call4"], ratios["call4_speedup"],
         f">= {goals['call4_speedup']:g}x faster"),
        ("decode step at 4K", decode["default"], decode["radix"], 1 / ratios["decode_ratio"],
         f"radix/default <= {goals['decode_ratio_max']:.2f}"),
    ]
    print(f"{'':22s}{'default ms':>12s}{'radix ms':>12s}{'speedup':>10s}   goal")
    for name, d, r, s, goal in rows:
        print(f"{name:22s}{d * 1e3:12.2f}{r * 1e3:12.2f}{s:9.2f}x   {goal}")
    cold, first = result["cold_ttft_s"], result["first_call_s"]
    print(f"first call in the process: default {first['default'] * 1e3:.1f} ms, radix "
          f"{first['radix'] * 1e3:.1f} ms (engine warm-up {result['warm_up_s']})")
    print(f"cold first call (prefix computed): default {cold['default'] * 1e3:.1f} ms, "
          f"radix {cold['radix'] * 1e3:.1f} ms; goals met: {result['goals_met']}")
    check = result["state_check_us"]
    print(f"model-state check at each call: {check['median']:.1f} us median "
          f"({check['tensors_tracked']} tensors), "
          f"{ratios['state_check_of_call4']:.2%} of a 4-token call (goal <= {goals['state_check_max']:.0%})")


def main(argv: list[str] | None = None) -> dict:
    parser = generate_parser(__doc__)
    parser.add_argument("--prefix", type=int, default=None, help="shared prefix tokens (4096; tiny: 256)")
    parser.add_argument("--question", type=int, default=None, help="question tokens (64; tiny: 16)")
    parser.add_argument("--questions", type=int, default=None, help="questions per part (20; tiny: 3)")
    parser.add_argument("--profile", action="store_true", help="print where the time goes instead of timing")
    parser.add_argument("--trace-dir", type=Path, default=None, help="with --profile: write Chrome traces")
    parser.add_argument("--no-fused-ops", action="store_true", help="graphs keep HF's own norm/rope kernels")
    args = parser.parse_args(argv)
    result = run(args)
    if args.profile:
        return result
    print_table(result)
    write_result(result, args.json, echo=False)
    return result


if __name__ == "__main__":
    main()
