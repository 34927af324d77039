"""gsp-8x32: groups of prompts sharing a system prompt, hf_radix vs plain HF `generate`, same process.

8 groups x 32 prompts; prompt = group system prompt (2,048 tokens) + unique question (256 tokens);
64 new tokens each, greedy, EOS ignored. Llama-3.1-8B shape with random bf16 weights. Also a zero-reuse
workload (unrelated prompts of the same length). Building the runner warms it up (Triton compiles and every
CUDA-graph capture, timed separately: `setup`); the first run (the shared workload with other tokens) is
reported next to the steady one, and each decode step's host time (schedule + launch) and GPU time.
`--tiny` runs a CPU-sized self-check.

`--generate` adds the key `generate`: the shared workload through radix `generate` (batches of `--hf-batch`,
at most 64, rows; the cache emptied before each variant), with the prefix a call's rows share computed once
(`integrations/prefix_sharing.py`) and, for comparison, with that off (every row computes it).

`--groups16` adds a second part under the key `groups16`: 16 groups x 16 prompts, 1,024-token system
prompt + 512-token question, 128 new tokens (same measurements; its own warm-up run first). Each part
records `shared_prefix_steps`: decode steps whose attention read each group's prefix once (shared-prefix
attention, the engine's counter), so a run shows it was on; `--no-shared-prefix` turns it off (A/B).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timed, timer, write_result  # noqa: E402
from compile_log import CompileLog  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402
from hf_radix.integrations import prefix_sharing  # noqa: E402


def make_prompts(
    groups: int, per_group: int, system_len: int, question_len: int, vocab: int, shared: bool, seed: int = 0
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(groups):
        system = torch.randint(10, vocab, (system_len,), generator=gen).tolist()
        for _ in range(per_group):
            own = system if shared else torch.randint(10, vocab, (system_len,), generator=gen).tolist()
            prompts.append(own + torch.randint(10, vocab, (question_len,), generator=gen).tolist())
    return prompts


def run_hf(
    model, prompts: list[list[int]], new_tokens: int, batch_size: int, device: str
) -> tuple[float, list]:
    """Plain generate, static batches (prompts are equal-length so no padding), sdpa attention."""
    model.config._attn_implementation = "sdpa"
    outs = []
    with timer(device) as t, torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.extend(out[:, ids.shape[1] :].tolist())
    return t.seconds, outs


def step_summary(runner: RadixBatchRunner, since: int) -> dict:
    """Median host and GPU milliseconds of the decode steps recorded after the first `since`: the host's
    whole loop iteration (waits excluded), and of it scheduling + launching the step alone."""
    times = runner.step_times
    host, launch, gpu = times.host_s[since:], times.launch_s[since:], times.gpu_s[since:]
    return {
        "decode_steps": len(host),
        "decode_step_host_ms": 1e3 * statistics.median(host) if host else None,
        "decode_step_launch_host_ms": 1e3 * statistics.median(launch) if launch else None,
        "decode_step_gpu_ms": 1e3 * statistics.median(gpu) if gpu else None,
    }


def run_radix(runner: RadixBatchRunner, prompts, new_tokens: int, device: str) -> tuple[float, list]:
    runner.reset_cache()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    elapsed, outs = timed(lambda: runner.run(prompts, params, progress=False), device)
    runner.check_integrity()
    return elapsed, outs


def prefill_check(model, runner: RadixBatchRunner, prompts, device: str) -> float:
    """Max |log-prob difference| of each prompt's last token: hf_radix prefill vs HF's own forward."""
    worst = 0.0
    with torch.inference_mode():
        for prompt in prompts:
            logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0, -2].float()
            ref = logits.log_softmax(-1)[prompt[-1]].item()
            got, _ = runner.loglikelihood([(prompt[:-1], prompt[-1:])], progress=False)[0]
            worst = max(worst, abs(got - ref))
    return worst


def generate_part(model, runner: RadixBatchRunner, prompts: list[list[int]], new_tokens: int, batch: int,
                  hf_s: float, device: str) -> dict:
    """`--generate`: the prompts through radix `generate`, prefix sharing on and off (each from empty)."""
    default = prefix_sharing.MIN_SAVED
    out = {}
    for name, min_saved in (("shared_once", default), ("per_row", sys.maxsize)):
        prefix_sharing.MIN_SAVED = min_saved  # sys.maxsize: no round ever pays
        runner.reset_cache()
        before = hf_radix.cache_stats(model)["computed_tokens"]
        with timer(device) as t, torch.inference_mode():
            for i in range(0, len(prompts), batch):
                ids = torch.tensor(prompts[i : i + batch], device=device)
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                               cache_implementation="radix")
        computed = hf_radix.cache_stats(model)["computed_tokens"] - before
        out[name] = {"radix_generate_s": t.seconds, "speedup": hf_s / t.seconds, "computed_tokens": computed}
    prefix_sharing.MIN_SAVED = default
    return {"batch": batch, "hf_generate_s": hf_s, **out}


def shared_part(model, runner: RadixBatchRunner, shape: tuple[int, int, int, int, int], hf_batch: int,
                device: str) -> dict:
    """The shared-prefix workload of one shape (groups, per group, system, question, new tokens): a first
    run with other tokens, the steady run, then plain HF generate on the same prompts."""
    groups, per_group, system_len, question_len, new_tokens = shape
    vocab = model.config.vocab_size
    core = runner.model_runner
    shared = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True)
    # warm-up: the same workload with other tokens, so kernels are compiled and the CUDA graphs of its
    # batch shapes captured (one-time costs of a process, reported as the first run)
    warm = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True, seed=2)
    shared_before = core.shared_prefix_steps
    captures_before = core.graph_captures()
    with CompileLog() as compiles:
        first_run_s, _ = run_radix(runner, warm, new_tokens, device)
    first_run_shared = core.shared_prefix_steps - shared_before
    captures = {k: v - captures_before[k] for k, v in core.graph_captures().items()}
    run_hf(model, shared[:2], 2, 2, device)

    steps_before = len(runner.step_times.host_s)
    shared_before = core.shared_prefix_steps
    radix_s, radix_outs = run_radix(runner, shared, new_tokens, device)
    shared_steps = core.shared_prefix_steps - shared_before
    steps = step_summary(runner, steps_before)
    stats = runner.stats
    hf_s, hf_outs = run_hf(model, shared, new_tokens, hf_batch, device)
    agree = statistics.mean(
        sum(a == b for a, b in zip(o.token_ids, h)) / new_tokens for o, h in zip(radix_outs, hf_outs)
    )
    unique_tokens = groups * system_len + len(shared) * question_len
    return {
        "workload": f"gsp-{groups}x{per_group}",
        "system_len": system_len,
        "question_len": question_len,
        "new_tokens": new_tokens,
        "radix_s": radix_s,
        "radix_first_run_s": first_run_s,
        "first_run_over_steady": first_run_s / radix_s,
        "first_run_compiles": compiles.summary(),
        "first_run_captures": captures,
        **steps,
        "shared_prefix_steps": shared_steps,
        "shared_prefix_steps_first_run": first_run_shared,
        "hf_generate_s": hf_s,
        "speedup": hf_s / radix_s,
        "hit_rate": sum(o.cached_tokens for o in radix_outs) / sum(len(p) for p in shared),
        "radix_output_tok_s": len(shared) * new_tokens / radix_s,
        "hf_output_tok_s": len(shared) * new_tokens / hf_s,
        "prompt_tokens": sum(len(p) for p in shared),
        "unique_prompt_tokens": unique_tokens,
        "greedy_token_agreement": agree,
        "roofline_floor_s": unique_tokens * 2 * 8.0e9 / 790e12 + new_tokens * 16e9 / 4.3e12,
        "runner_stats": repr(stats),
    }


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized self-check")
    parser.add_argument("--hf-batch", type=int, default=128)
    parser.add_argument("--skip-zero-reuse", action="store_true")
    parser.add_argument("--groups16", action="store_true", help="also the 16x16 variant (key groups16)")
    parser.add_argument("--generate", action="store_true", help="also through radix generate (key generate)")
    parser.add_argument("--no-overlap", action="store_true", help="read each step's tokens before the next")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--no-shared-prefix", action="store_true", help="per-row decode attention only")
    args = parser.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.tiny:
        main_shape, g16_shape, hf_batch = (2, 4, 48, 8, 4), (4, 2, 32, 16, 4), 4
    else:
        main_shape, g16_shape, hf_batch = (8, 32, 2048, 256, 64), (16, 16, 1024, 512, 128), args.hf_batch
    groups, per_group, system_len, question_len, new_tokens = main_shape
    model = build_llama(args.tiny, device)
    vocab = model.config.vocab_size
    setup_s, runner = timed(lambda: RadixBatchRunner(
        model,
        max_total_tokens=200_000 if device == "cuda" else 4096,
        mem_fraction=0.4,
        chunked_prefill_size=8192,
        overlap=not args.no_overlap,
        cuda_graph=not args.no_cuda_graph,
        profile=device == "cuda",
        shared_prefix=not args.no_shared_prefix,
    ), device)
    results: dict = {
        "workload": f"gsp-{groups}x{per_group}",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "system_len": system_len,
        "question_len": question_len,
        "new_tokens": new_tokens,
        "attn_backend": runner.engine.backend.name,
        "pool_tokens": runner.engine.manager.num_pages * runner.engine.page_size,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "overlap": not args.no_overlap,
        "cuda_graph": runner.model_runner.has_graphs,
        "shared_prefix": runner.model_runner.shared_prefix,
        "setup": {"runner_s": setup_s, **{f"warm_up_{k}": v for k, v in runner.warm_up_times.items()}},
    }
    results["shared"] = shared_part(model, runner, main_shape, hf_batch, device)
    print(json.dumps(results["shared"], indent=1))
    if not args.skip_zero_reuse:
        unrelated = make_prompts(groups, per_group, system_len, question_len, vocab, shared=False, seed=1)
        shared_before = runner.model_runner.shared_prefix_steps
        radix_s, _ = run_radix(runner, unrelated, new_tokens, device)
        hf_s, _ = run_hf(model, unrelated, new_tokens, hf_batch, device)
        results["zero_reuse"] = {
            "radix_s": radix_s, "hf_generate_s": hf_s, "speedup": hf_s / radix_s,
            "shared_prefix_steps": runner.model_runner.shared_prefix_steps - shared_before,
        }
        print(json.dumps(results["zero_reuse"], indent=1))
    if args.generate:
        shared = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True)
        # calls of at most 64 rows: with the sharing off (the comparison) every row computes its whole prompt
        results["generate"] = generate_part(model, runner, shared, new_tokens, min(hf_batch, 64),
                                            results["shared"]["hf_generate_s"], device)
        print(json.dumps(results["generate"], indent=1))
    if args.groups16:
        results["groups16"] = shared_part(model, runner, g16_shape, hf_batch, device)
        print(json.dumps(results["groups16"], indent=1))
    shared = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True)
    results["prefill_logprob_max_abs_diff"] = prefill_check(model, runner, shared[:4], device)
    print("prefill log-prob max abs diff vs HF:", results["prefill_logprob_max_abs_diff"])
    print(f"\n{'workload':<14}{'hf_radix s':>12}{'HF generate s':>15}{'ratio':>8}{'shared steps':>14}")
    for name in ("shared", "zero_reuse", "groups16"):
        if name in results:
            r = results[name]
            print(f"{name:<14}{r['radix_s']:>12.2f}{r['hf_generate_s']:>15.2f}{r['speedup']:>8.2f}"
                  f"{r['shared_prefix_steps']:>14}")
    write_result(results, args.json, echo=False)
    print(hf_radix.cache_stats(model))


if __name__ == "__main__":
    main()
