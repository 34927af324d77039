"""Multi-turn chat through the runner with a small GPU pool: host tier vs an unbounded pool vs no tier.

Workload: 256 conversations x 4 turns behind one shared system prompt; each turn adds a user message and
a 64-token answer (greedy, EOS ignored), and the next turn's prompt is the whole history. Conversations
come back in waves (`--wave` per `run` call), so a conversation returns after the others have used the
pool. The small pool holds a quarter of all final histories; the host tier holds all of them.
Llama-3.1-8B shape with random bf16 weights on the GPU (`--layers` for a shallower model of the same
width); `--tiny` is a CPU self-check.

    python bench/chat_bench.py --out bench/results/chat_bench_h200.json
    python bench/chat_bench.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA_8B, build_llama  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402

FULL = dict(conversations=256, turns=4, system_len=256, user_len=128, answer_len=64, wave=32)
TINY = dict(conversations=16, turns=3, system_len=12, user_len=10, answer_len=6, wave=4)


def build_model(args, device: str) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    if args.tiny or args.layers is None:
        return build_llama(args.tiny, device)
    config = transformers.LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": args.layers})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def chat(runner: RadixBatchRunner, shape: dict, vocab: int, seed: int, device: str) -> dict:
    """Runs the whole workload; returns time, hit rates and every answer."""
    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, shape["system_len"]).tolist()
    histories = [list(system) for _ in range(shape["conversations"])]
    params = SamplingParams(max_new_tokens=shape["answer_len"], ignore_eos=True)
    answers: list[list[int]] = []
    stats = runner.stats
    before = (stats.prompt_tokens, stats.cached_tokens, stats.host_cached_tokens)
    per_turn = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(shape["turns"]):
        turn_start, turn_before = time.perf_counter(), (stats.prompt_tokens, stats.cached_tokens)
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
        _sync(device)
        prompt = stats.prompt_tokens - turn_before[0]
        per_turn.append({"seconds": time.perf_counter() - turn_start,
                         "hit_rate": (stats.cached_tokens - turn_before[1]) / prompt})
    seconds = time.perf_counter() - start
    prompt, cached, host = (now - was for now, was in zip(
        (stats.prompt_tokens, stats.cached_tokens, stats.host_cached_tokens), before))
    return {
        "seconds": seconds, "prompt_tokens": prompt, "cached_tokens": cached, "host_cached_tokens": host,
        "gpu_cached_tokens": cached - host, "hit_rate": cached / prompt, "per_turn": per_turn,
        "answers": answers,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: a self-check")
    parser.add_argument("--layers", type=int, help="8B width with this many layers (a smaller shape)")
    for key in FULL:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int)
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="small pool / all final histories")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--configs", default="unbounded,host_tier,no_tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args(argv)

    shape = dict(TINY if args.tiny else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    model = build_model(args, device)
    vocab = model.config.vocab_size
    final = shape["system_len"] + shape["turns"] * (shape["user_len"] + shape["answer_len"])
    all_histories = shape["conversations"] * final
    small = int(all_histories * args.pool_fraction)
    configs = {
        "unbounded": dict(max_total_tokens=all_histories + 4096, host_cache_tokens=0),
        "host_tier": dict(max_total_tokens=small, host_cache_tokens=all_histories + 4096),
        "no_tier": dict(max_total_tokens=small, host_cache_tokens=0),
    }
    results: dict = {}
    for name in args.configs.split(","):
        runner = RadixBatchRunner(model, page_size=args.page_size, max_running_requests=shape["wave"],
                                  **configs[name])
        warm = dict(shape, conversations=shape["wave"], turns=1)
        chat(runner, warm, vocab, args.seed + 1, device)  # compiles kernels and captures graphs
        runner.reset_cache()
        results[name] = chat(runner, shape, vocab, args.seed, device)
        runner.check_integrity()
        results[name]["engine"] = hf_radix.cache_stats(model)
        print(f"{name:<10} {results[name]['seconds']:8.2f}s  hit rate {results[name]['hit_rate']:.3f}  "
              f"(host {results[name]['host_cached_tokens']:,} of {results[name]['cached_tokens']:,} cached)")
        del runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    summary = {}
    if "unbounded" in results:
        ref = results["unbounded"]
        for name, res in results.items():
            same = [a == b for a, b in zip(res["answers"], ref["answers"])]
            res["same_answers_as_unbounded"] = float(np.mean(same))
            summary[name] = {"hit_rate_vs_unbounded": res["hit_rate"] / ref["hit_rate"],
                             "time_vs_unbounded": res["seconds"] / ref["seconds"]}
        print(json.dumps(summary, indent=1))
    for res in results.values():
        del res["answers"]
    out = {
        "command": " ".join(["python", *sys.argv]),
        "workload": {**shape, "all_history_tokens": all_histories, "small_pool_tokens": small},
        "config": {
            "model": "tiny llama fp32" if args.tiny else f"Llama-3.1-8B shape ({args.layers or 32} layers), "
                                                         "random bf16 weights",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "page_size": args.page_size, "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "results": results,
        "summary": summary,
        "goals": "host_tier: hit_rate_vs_unbounded >= 0.9 and time_vs_unbounded <= 1.2",
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
