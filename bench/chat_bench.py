"""Multi-turn chat through the runner with a small GPU pool: host tier vs an unbounded pool vs no tier.

Workload: 256 conversations x 4 turns behind one shared system prompt; each turn adds a user message and
a 64-token answer (greedy, EOS ignored), and the next turn's prompt is the whole history. Conversations
come back in waves (`--wave` per `run` call), so a conversation returns after the others have used the
pool. The small pool holds a quarter of all final histories; the host tier holds all of them.
Llama-3.1-8B shape with random bf16 weights on the GPU (`--layers` for a shallower model of the same
width); `--tiny` is a CPU self-check of every step. Each configuration is one part: the JSON is rewritten
after each, and a part that fails is recorded there while the others still run.

    python bench/chat_bench.py --json bench/results/chat_bench_h200.json
    python bench/chat_bench.py --tiny
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ResultFile, bench_device, model_arguments, parser_for, say, seeded_model, timer  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402

FULL = dict(conversations=256, turns=4, system_len=256, user_len=128, answer_len=64, wave=32)
TINY = dict(conversations=16, turns=3, system_len=12, user_len=10, answer_len=6, wave=4)
CONFIGS = ("unbounded", "host_tier", "no_tier")


def chat(runner: RadixBatchRunner, shape: dict, vocab: int, seed: int, device: str, label: str) -> dict:
    """Runs the whole workload; returns time, hit rates and every answer."""
    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, shape["system_len"]).tolist()
    histories = [list(system) for _ in range(shape["conversations"])]
    params = SamplingParams(max_new_tokens=shape["answer_len"], ignore_eos=True)
    answers: list[list[int]] = []
    stats = runner.stats
    before = (stats.prompt_tokens, stats.cached_tokens, stats.host_cached_tokens)
    per_turn = []
    with timer(device) as whole:
        for turn in range(shape["turns"]):
            per_turn.append(one_turn(runner, shape, histories, answers, params, rng, vocab, device))
            say(f"{label} turn {turn + 1}/{shape['turns']}: {per_turn[-1]['seconds']:.2f}s, "
                f"hit rate {per_turn[-1]['hit_rate']:.3f}")
    seconds = whole.seconds
    prompt, cached, host = (now - was for now, was in zip(
        (stats.prompt_tokens, stats.cached_tokens, stats.host_cached_tokens), before))
    return {
        "seconds": seconds, "prompt_tokens": prompt, "cached_tokens": cached, "host_cached_tokens": host,
        "gpu_cached_tokens": cached - host, "hit_rate": cached / prompt, "per_turn": per_turn,
        "answers": answers,
    }


def one_turn(runner: RadixBatchRunner, shape: dict, histories: list[list[int]], answers: list[list[int]],
             params: SamplingParams, rng: np.random.Generator, vocab: int, device: str) -> dict:
    """One turn of every conversation, in waves: each history gets a user message and the answer."""
    stats = runner.stats
    turn_before = (stats.prompt_tokens, stats.cached_tokens)
    with timer(device) as t:
        for history in histories:
            history += rng.integers(10, vocab, shape["user_len"]).tolist()
        for first in range(0, len(histories), shape["wave"]):
            wave = histories[first : first + shape["wave"]]
            outs = runner.run([list(h) for h in wave], params, progress=False)
            for history, out in zip(wave, outs):
                if out.error:
                    raise RuntimeError(out.error)
                history += out.token_ids
                answers.append(out.token_ids)
    prompt = stats.prompt_tokens - turn_before[0]
    return {"seconds": t.seconds, "hit_rate": (stats.cached_tokens - turn_before[1]) / prompt}


def summarize(results: dict) -> dict:
    """Each configuration against the unbounded pool: hit rate, time and answers (when both finished)."""
    ref = results.get("unbounded")
    if ref is None:
        return {}
    summary = {}
    for name, res in results.items():
        same = [a == b for a, b in zip(res["answers"], ref["answers"])]
        summary[name] = {"hit_rate_vs_unbounded": res["hit_rate"] / ref["hit_rate"],
                         "time_vs_unbounded": res["seconds"] / ref["seconds"],
                         "same_answers_as_unbounded": float(np.mean(same)) if same else None}
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = model_arguments(parser_for(__doc__))
    for key in FULL:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="small pool / all final histories")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)

    shape = dict(TINY if args.tiny else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    final = shape["system_len"] + shape["turns"] * (shape["user_len"] + shape["answer_len"])
    all_histories = shape["conversations"] * final
    small = int(all_histories * args.pool_fraction)
    configs = {  # 256 x 1,024 tokens: the host tier's pinned buffers are a power of two (no round-up)
        "unbounded": dict(max_total_tokens=all_histories + 4096, host_cache_tokens=0),
        "host_tier": dict(max_total_tokens=small, host_cache_tokens=all_histories),
        "no_tier": dict(max_total_tokens=small, host_cache_tokens=0),
    }
    names = args.configs.split(",")
    unknown = set(names) - set(configs)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    file = ResultFile(
        args.json, args,
        workload={**shape, "all_history_tokens": all_histories, "small_pool_tokens": small},
        goals="host_tier: hit_rate_vs_unbounded >= 0.9 and time_vs_unbounded <= 1.2",
    )
    device = bench_device(args)
    say(f"{shape['conversations']} conversations x {shape['turns']} turns, final history {final} tokens; "
        f"small pool {small:,} of {all_histories:,} tokens; {device}")
    model = seeded_model(args, device)
    vocab = model.config.vocab_size
    results: dict = {}  # with the answers, for the summary
    for name in names:
        with file.part(name):
            runner = RadixBatchRunner(model, page_size=args.page_size, max_running_requests=shape["wave"],
                                      **configs[name])
            warm = dict(shape, conversations=shape["wave"], turns=1)
            chat(runner, warm, vocab, args.seed + 1, device, f"{name} warm-up")  # kernels and graphs
            runner.reset_cache()
            result = chat(runner, shape, vocab, args.seed, device, name)
            runner.check_integrity()
            result["engine"] = hf_radix.cache_stats(model)
            results[name] = result
            file.data["results"][name] = {k: v for k, v in result.items() if k != "answers"}
            file.data["summary"] = summarize(results)
            say(f"{name:<10} {result['seconds']:8.2f}s  hit rate {result['hit_rate']:.3f}  "
                f"(host {result['host_cached_tokens']:,} of {result['cached_tokens']:,} cached)")
        runner = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, row in file.data.get("summary", {}).items():
        say(f"{name:<10} hit rate x{row['hit_rate_vs_unbounded']:.3f} of unbounded, "
            f"time x{row['time_vs_unbounded']:.3f}, same answers {row['same_answers_as_unbounded']:.3f}")
    return file.finish()


if __name__ == "__main__":
    main()
