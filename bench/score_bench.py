"""Few-shot multiple-choice scoring: hf_radix `loglikelihood` vs batched full-sequence transformers forwards.

Workload: 512 questions x 4 choices behind one shared ~1,500-token 5-shot prefix, ~100-token questions,
5-20-token choices (synthetic token ids); Llama-3.1-8B shape with random bf16 weights, built on the GPU.
The baseline is what lm-eval's "hf" backend does: padded batches of whole context+choice sequences,
log-softmax over every position, gather the choice tokens. Both run in this process; the log-likelihoods
are compared. `--tiny` runs a CPU-sized self-check in seconds.

    python bench/score_bench.py --json bench/results/score_bench_h200.json
    python bench/score_bench.py --tiny
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timed, write_result  # noqa: E402
from compile_log import CompileLog  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner  # noqa: E402

FULL = dict(questions=512, choices=4, prefix_len=1500, question_len=100, choice_len=(5, 20), hf_batch_size=16)
TINY = dict(questions=24, choices=4, prefix_len=300, question_len=40, choice_len=(2, 6), hf_batch_size=8)

Pair = tuple[list[int], list[int]]


def make_workload(questions: int, choices: int, prefix_len: int, question_len: int,
                  choice_len: tuple[int, int], vocab: int, seed: int) -> list[Pair]:
    """(context, choice) pairs: context = shared few-shot prefix + question; choices of random length."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(10, vocab, n).tolist()

    prefix = ids(prefix_len)
    pairs = []
    for _ in range(questions):
        context = prefix + ids(question_len)
        pairs += [(context, ids(int(rng.integers(choice_len[0], choice_len[1] + 1)))) for _ in range(choices)]
    return pairs


def padded_batches(pairs: list[Pair], batch_size: int):
    """lm-eval's "hf" batching: longest first, right-padded (context + choice)[:-1]; yields (pair
    indices, `[rows, width]` CPU ids)."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        inputs = [(pairs[i][0] + pairs[i][1])[:-1] for i in rows]
        ids = torch.zeros(len(rows), max(map(len, inputs)), dtype=torch.long)
        for r, seq in enumerate(inputs):
            ids[r, :len(seq)] = torch.tensor(seq)
        yield rows, ids


def hf_loglikelihood(model, pairs: list[Pair], batch_size: int, device: str) -> list[float]:
    """The lm-eval "hf" way: padded batches (`padded_batches`), log-softmax, gather the choice tokens."""
    model.config._attn_implementation = "sdpa"
    out = [0.0] * len(pairs)
    with torch.inference_mode():
        for rows, ids in padded_batches(pairs, batch_size):
            logp = model(input_ids=ids.to(device)).logits.log_softmax(-1)
            positions, targets, owner = [], [], []
            for r, i in enumerate(rows):
                context, choice = pairs[i]
                positions += [(r, len(context) - 1 + j) for j in range(len(choice))]
                targets += choice
                owner += [r] * len(choice)
            index = torch.tensor(positions, device=device)
            picked = logp[index[:, 0], index[:, 1], torch.tensor(targets, device=device)].float()
            owners = torch.tensor(owner, device=device)
            sums = torch.zeros(len(rows), device=device).index_add_(0, owners, picked)
            for i, value in zip(rows, sums.tolist()):
                out[i] = value
    return out


def reference_loglikelihood(model, pairs: list[Pair], device: str) -> list[float]:
    """One unpadded forward per pair, log-softmax in float32: the yardstick for both systems' rounding."""
    out = []
    with torch.inference_mode():
        for context, choice in pairs:
            ids = torch.tensor([(context + choice)[:-1]], device=device)
            logp = model(input_ids=ids).logits[0, len(context) - 1:].float().log_softmax(-1)
            out.append(logp[torch.arange(len(choice)), torch.tensor(choice, device=device)].sum().item())
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = parser_for(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: a self-check")
    parser.add_argument("--questions", type=int)
    parser.add_argument("--choices", type=int)
    parser.add_argument("--prefix-len", type=int, help="shared few-shot prefix tokens")
    parser.add_argument("--question-len", type=int)
    parser.add_argument("--hf-batch-size", type=int)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--max-total-tokens", type=int, help="KV pool size (default: 200,000 on GPU)")
    parser.add_argument("--attn-backend", default="auto")
    parser.add_argument("--check-questions", type=int, default=4,
                        help="questions also scored by unpadded float32-softmax forwards, as a yardstick")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    shape = dict(TINY if args.tiny else FULL)
    for key in ("questions", "choices", "prefix_len", "question_len", "hf_batch_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    model = build_llama(args.tiny, device)
    vocab = model.config.vocab_size
    pairs = make_workload(shape["questions"], shape["choices"], shape["prefix_len"], shape["question_len"],
                          shape["choice_len"], vocab, args.seed)
    pool = args.max_total_tokens or (16384 if args.tiny else 200_000)
    setup_s, runner = timed(
        lambda: RadixBatchRunner(model, page_size=args.page_size, max_total_tokens=pool,
                                 chunked_prefill_size=args.chunked_prefill_size,
                                 max_running_requests=args.max_running_requests,
                                 attn_backend=args.attn_backend),
        device,
    )

    # first run: the same workload shape with other tokens (building the runner compiled the kernels and
    # captured the graphs, timed as setup), then start from an empty cache
    warm = make_workload(shape["questions"], shape["choices"], shape["prefix_len"], shape["question_len"],
                         shape["choice_len"], vocab, args.seed + 1)
    captures_before = runner.model_runner.graph_captures()
    with CompileLog() as compiles:
        warmup_s, _ = timed(lambda: runner.loglikelihood(warm, progress=False), device)
    first_captures = {k: v - captures_before[k] for k, v in runner.model_runner.graph_captures().items()}
    hf_loglikelihood(model, warm[:shape["hf_batch_size"]], shape["hf_batch_size"], device)
    runner.reset_cache()

    before = hf_radix.cache_stats(model)
    radix_s, radix = timed(lambda: runner.loglikelihood(pairs, progress=False), device)
    after = hf_radix.cache_stats(model)
    runner.check_integrity()
    hf_s, hf = timed(lambda: hf_loglikelihood(model, pairs, shape["hf_batch_size"], device), device)
    checked = args.check_questions * shape["choices"]
    reference = np.array(reference_loglikelihood(model, pairs[:checked], device))

    radix_lp = np.array([lp for lp, _ in radix])
    diffs = np.abs(radix_lp - np.array(hf))
    per_q = shape["choices"]
    pick_radix = radix_lp.reshape(-1, per_q).argmax(1)
    pick_hf = np.array(hf).reshape(-1, per_q).argmax(1)
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    cached_tokens = after["cached_tokens"] - before["cached_tokens"]
    result = {
        "workload": {**shape, "pairs": len(pairs), "seed": args.seed},
        "config": {
            "model": "tiny llama fp32" if args.tiny else "Llama-3.1-8B shape, random bf16 weights",
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "page_size": args.page_size, "chunked_prefill_size": args.chunked_prefill_size,
            "max_running_requests": args.max_running_requests,
            "max_total_tokens": pool, "attn_backend": runner.engine.backend.name,
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "hf": {"seconds": hf_s, "tokens": sum(len(c) + len(x) - 1 for c, x in pairs)},
        "hf_radix": {
            "seconds": radix_s, "first_run_seconds": warmup_s, "first_run_over_steady": warmup_s / radix_s,
            "first_run_compiles": compiles.summary(), "first_run_captures": first_captures,
            "setup_seconds": setup_s, **{f"warm_up_{k}": v for k, v in runner.warm_up_times.items()},
            "forward_calls": after["forward_calls"] - before["forward_calls"],
            "computed_tokens": after["computed_tokens"] - before["computed_tokens"],
            "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        },
        "speedup": hf_s / radix_s,
        "check": {
            "max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "same_choice": float((pick_radix == pick_hf).mean()),
            "reference_pairs": checked,
            "hf_radix_vs_reference_max": float(np.abs(radix_lp[:checked] - reference).max()),
            "hf_vs_reference_max": float(np.abs(np.array(hf[:checked]) - reference).max()),
        },
    }
    print(f"{len(pairs)} (context, choice) pairs: {shape['questions']} questions x {per_q} choices, "
          f"{shape['prefix_len']}-token shared prefix, {shape['question_len']}-token questions; "
          f"{result['config']['model']} on {result['config']['device']}")
    print(f"{'system':<34}{'seconds':>10}{'tokens computed':>18}")
    baseline = f"HF batched forward (bs={shape['hf_batch_size']})"
    print(f"{baseline:<34}{hf_s:>10.2f}{result['hf']['tokens']:>18,}")
    ours = result["hf_radix"]
    print(f"{'hf_radix loglikelihood':<34}{radix_s:>10.2f}{ours['computed_tokens']:>18,}"
          f"   (hit rate {ours['hit_rate']:.1%}, {ours['forward_calls']} forwards; "
          f"first run {warmup_s:.2f}s = {warmup_s / radix_s:.2f}x steady; runner set-up {setup_s:.2f}s: "
          f"{runner.warm_up_times})")
    check = result["check"]
    print(f"speedup {result['speedup']:.1f}x; |hf_radix - HF| max {diffs.max():.2e}, "
          f"mean {diffs.mean():.2e}, "
          f"same argmax choice {check['same_choice']:.1%}; against unpadded float32-softmax forwards "
          f"({checked} pairs): hf_radix max {check['hf_radix_vs_reference_max']:.2e}, "
          f"HF batched max {check['hf_vs_reference_max']:.2e}")
    write_result(result, args.json, echo=False)
    return result


if __name__ == "__main__":
    main()
