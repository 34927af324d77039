"""GRPO-style RL rollouts through `generate`: the default cache against cache_implementation="radix".

Workload (H200): Llama-3.1-8B shape with random bf16 weights; 64 prompts of 256 random tokens (no prefix
shared between prompts: their first tokens all differ), 8 samples each (`num_return_sequences=8`: one
call, 64 prompts -> 512 rows), exactly 256 new tokens a row (EOS unset, `min_new_tokens` = new tokens),
top-p sampling (do_sample, top_p=0.9, temperature 1.0, top_k off), seeded. Both kinds run the same
prompts and seeds in one process: plain `generate` (sdpa attention, HF's dynamic cache) and the same call
with `cache_implementation="radix"`, which computes each prompt once and the 8 samples share its K/V.

Each kind's first call in the process (`first_call_s`, on prompts of its own) is reported beside the steady
calls (median of `--repeats`, the two kinds alternating, fresh prompts each repeat). For radix the first
call includes the engine's warm-up (every graph captured, eager kernels compiled; `warm_up_s` splits it).
The radix cache is reset before every radix call (an RL step follows a weight update, which invalidates
it; and no call finds an earlier call's prompts). Peak GPU memory is per call (`torch.cuda` allocator):
radix's includes its pre-allocated pool and graphs, HF's standalone figure is weights + what the call adds.

    python bench/rl_rollouts.py --json bench/results/rl_rollouts_h200.json
    python bench/rl_rollouts.py --tiny --json /tmp/rl_tiny.json     # CPU self-check: tiny model, seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, generate_device, generate_parser, say, timer, write_result  # noqa: E402

import hf_radix  # noqa: E402

GIB = 2**30
SIZES = dict(prompts=64, prompt_len=256, new_tokens=256)  # unless given; --tiny: TINY_SIZES
TINY_SIZES = dict(prompts=4, prompt_len=32, new_tokens=16)


def distinct_prompts(gen: torch.Generator, count: int, length: int, vocab: int) -> torch.Tensor:
    """`count` random prompts of `length` tokens (ids >= 2), first tokens all different: no shared prefix."""
    firsts = torch.randperm(vocab - 2, generator=gen)[:count] + 2
    rest = torch.randint(2, vocab, (count, length - 1), generator=gen)
    return torch.cat([firsts[:, None], rest], dim=1)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * dtype_bytes


def run(args: argparse.Namespace) -> dict:
    device = generate_device(args, SIZES, TINY_SIZES)
    cuda = device.type == "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    with timer(device) as t:
        model = build_llama(args.tiny, device, dtype)
    init_s = t.seconds
    weights_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    rows = args.prompts * args.samples
    pool = dict(max_total_tokens=args.max_total_tokens) if args.max_total_tokens else dict(mem_fraction=0.5)
    engine = hf_radix.configure(
        model, page_size=args.page_size, attn_backend=args.attn_backend, cuda_graph=not args.no_cuda_graph,
        cuda_graph_max_batch=args.graph_max_batch or rows, **pool,
    )
    core = engine.model_runner
    pool_bytes = engine.pool_tokens * kv_bytes_per_token(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    # prompts: one set for each kind's first call, then one set per steady repeat (shared by both kinds)
    first_prompts = {kind: distinct_prompts(gen, args.prompts, args.prompt_len, vocab)
                     for kind in ("hf", "radix")}
    attention = model.config._attn_implementation

    def call(ids: torch.Tensor, radix: bool, seed: int) -> tuple[float, dict, torch.Tensor]:
        """One rollout call: seconds, memory, and the generated tokens (on the host)."""
        ids = ids.to(device)
        extra = dict(cache_implementation="radix") if radix else {}
        if radix:
            engine.reset_cache()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) if cuda else 0
        torch.manual_seed(seed)
        with timer(device) as t, torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens, do_sample=True, top_p=args.top_p, top_k=args.top_k,
                temperature=args.temperature, num_return_sequences=args.samples, **extra,
            )
        elapsed = t.seconds
        if out.shape != (rows, args.prompt_len + args.new_tokens):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {rows} rows x "
                               f"{args.prompt_len + args.new_tokens} tokens")
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        memory = {"peak_gib": peak / GIB, "resident_before_gib": resident / GIB,
                  "added_by_call_gib": (peak - resident) / GIB}
        new = out[:, args.prompt_len:].cpu()
        del out
        kind = "radix" if radix else "hf"
        say(f"{kind}: {elapsed:.2f} s, {rows * args.new_tokens / elapsed:.0f} tok/s, "
            f"peak {memory['peak_gib']:.1f} GiB")
        return elapsed, memory, new

    # first call of each kind in the process: cold (HF: cuBLAS and allocator; radix: the engine's warm-up)
    first_s, first_mem = {}, {}
    for kind, radix in (("hf", False), ("radix", True)):
        first_s[kind], first_mem[kind], _ = call(first_prompts[kind], radix, args.seed)
    computed_before = engine.stats.computed_tokens
    stats_before = hf_radix.cache_stats(model)
    shared_before = core.shared_prefix_steps
    replays_before = core.has_graphs and core.decode_graphs.replays

    times: dict[str, list[float]] = {"hf": [], "radix": []}
    mems: dict[str, list[dict]] = {"hf": [], "radix": []}
    agreement: list[float] = []
    for r in range(args.repeats):
        if r and sum(times["hf"]) + sum(times["radix"]) > args.budget_s:
            say(f"time budget ({args.budget_s:.0f} s) spent: {r} repeats of {args.repeats}")
            break
        prompts = distinct_prompts(gen, args.prompts, args.prompt_len, vocab)
        outs = {}
        for kind, radix in (("hf", False), ("radix", True)):
            elapsed, mem, outs[kind] = call(prompts, radix, args.seed + 1 + r)
            times[kind].append(elapsed)
            mems[kind].append(mem)
        agreement.append((outs["hf"] == outs["radix"]).float().mean().item())
    engine.check_integrity()

    med = {kind: statistics.median(v) for kind, v in times.items()}
    generated = rows * args.new_tokens
    stats = hf_radix.cache_stats(model)
    measured = {key: stats[key] - stats_before[key] for key in ("requests", "prompt_tokens", "cached_tokens",
                                                                "computed_tokens", "generated_tokens")}
    peak = {kind: max(m["peak_gib"] for m in v) for kind, v in mems.items()}
    return {
        "config": {
            "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shape (random weights)",
            "dtype": str(dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_len,
            "samples_per_prompt": args.samples,
            "rows": rows,
            "new_tokens": args.new_tokens,
            "sampling": {"do_sample": True, "top_p": args.top_p, "top_k": args.top_k,
                         "temperature": args.temperature, "seed": args.seed},
            "eos_token_id": model.generation_config.eos_token_id,
            "min_new_tokens": args.new_tokens,
            "repeats": len(times["hf"]),
            "radix_cache_reset_before_each_call": True,
            "page_size": args.page_size,
            "attn_backend": engine.backend.name,
            "radix_cuda_graphs": core.has_graphs,
            "radix_graph_max_batch": core.max_graph_batch,
            "default_attention": attention,
            "pool_tokens": engine.pool_tokens,
            "pool_gib": pool_bytes / GIB,
            "weights_gib": weights_bytes / GIB,
            "kv_gib_per_call": {  # K/V a call holds at its end: HF every row's, radix each prompt once
                "hf": rows * (args.prompt_len + args.new_tokens) * kv_bytes_per_token(model) / GIB,
                "radix": (args.prompts * args.prompt_len + rows * args.new_tokens) * kv_bytes_per_token(model)
                / GIB,
            },
            "model_init_s": init_s,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "first_call_s": first_s,
        "warm_up_s": core.warm_up_times,
        "graph_reserve_gib": engine.graph_reserve / GIB,
        "median_s": med,
        "raw_s": times,
        "generated_tok_s": {kind: generated / t for kind, t in med.items()},
        "first_call_generated_tok_s": {kind: generated / t for kind, t in first_s.items()},
        "speedup": med["hf"] / med["radix"],
        "first_call_speedup": first_s["hf"] / first_s["radix"],
        "peak_memory_gib": peak,
        "peak_memory_standalone_gib": {  # radix: everything resident is its own (weights, pool, graphs)
            "hf": weights_bytes / GIB + max(m["added_by_call_gib"] for m in mems["hf"]),
            "radix": peak["radix"],
        },
        "first_call_memory": first_mem,
        "memory_per_call": mems,
        "sampled_token_agreement": agreement,  # same seeds and sampler: equal until the logits differ
        "cache_stats": stats,
        "cache_stats_steady_calls": measured,
        "radix_tokens_computed_in_steady_calls": engine.stats.computed_tokens - computed_before,
        "shared_prefix_steps": core.shared_prefix_steps - shared_before,
        "decode_graph_replays": core.has_graphs and core.decode_graphs.replays - replays_before,
    }


def print_table(result: dict) -> None:
    cfg, med, tok = result["config"], result["median_s"], result["generated_tok_s"]
    first, peak = result["first_call_s"], result["peak_memory_standalone_gib"]
    print(f"\n{cfg['model']} {cfg['dtype']} on {cfg['device']}: {cfg['prompts']} prompts x "
          f"{cfg['prompt_tokens']} tokens x {cfg['samples_per_prompt']} samples, {cfg['new_tokens']} new "
          f"tokens, median of {cfg['repeats']}")
    print(f"{'':8s}{'first s':>10s}{'steady s':>10s}{'tok/s':>10s}{'peak GiB':>10s}")
    for kind in ("hf", "radix"):
        print(f"{kind:8s}{first[kind]:10.2f}{med[kind]:10.2f}{tok[kind]:10.0f}{peak[kind]:10.1f}")
    stats = result["cache_stats_steady_calls"]
    print(f"speedup HF/radix {result['speedup']:.2f}x (first calls {result['first_call_speedup']:.2f}x); "
          f"radix steady calls: {stats['cached_tokens']:,} of {stats['prompt_tokens']:,} prompt tokens "
          "cached")


def main(argv: list[str] | None = None) -> dict:
    parser = generate_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per call (64; tiny: 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (256; tiny: 32)")
    parser.add_argument("--samples", type=int, default=8, help="num_return_sequences")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (256; tiny: 16)")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0, help="0: off (pure top-p)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="steady calls of each kind (median)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="start no further repeat once the steady calls have taken this long")
    parser.add_argument("--graph-max-batch", type=int, default=None,
                        help="decode graphs up to this many rows (default: the call's rows)")
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except Exception:
        write_result({"error": traceback.format_exc(), "complete": False}, args.json, echo=False)
        raise
    print_table(result)
    write_result(result, args.json, echo=False)
    return result


if __name__ == "__main__":
    main()
