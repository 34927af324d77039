"""Deterministic mode: the same requests under different configurations, and what the mode costs.

Part 1 (`identical_fraction`): 64 requests (8 groups of 8 sharing a prefix; half greedy, half seeded
sampling) and their log-likelihoods, under configurations that change everything but the requests: each
alone on an empty cache; in a batch of 256 with others; the batch reversed; after a warm-up that caches
their prefixes, with 256-token prefill chunks; pages of 16 in a pool small enough to evict, eagerly, without
overlap; and radix `generate` (the greedy ones, one at a time). A request counts as identical when its
tokens and its log-likelihood are bit-identical in every configuration (1.0 expected).

Part 2 (cost, deterministic time / default time, the median of 3 steady runs after a warm-up run):
`gsp_cost` on gsp-8x32 (bench/gsp.py: 8 groups x 32 prompts, 2,048-token shared prefix + 256-token
question, 64 new tokens) and `score_cost` on 5-shot-like scoring (bench/score_bench.py's workload).
Llama-3.1-8B shape, random bf16 weights, on a CUDA device. tests/test_deterministic_gpu.py runs part 1 on
a small model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timed, write_result  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402

REQUESTS, GROUPS = 64, 8
Outcome = tuple[list[int], float]  # a request's tokens and its log-likelihood


def workload(vocab: int, prefix_len: int, suffix_len: tuple[int, int], seed: int = 0):
    """The 64 prompts, 192 others, their sampling parameters and the 64 (context, continuation) pairs."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    def length() -> int:
        return int(torch.randint(suffix_len[0], suffix_len[1] + 1, (1,), generator=gen))

    prefixes = [ids(prefix_len) for _ in range(GROUPS)]
    prompts = [prefixes[i % GROUPS] + ids(length()) for i in range(REQUESTS)]
    others = [ids(prefix_len + length()) for _ in range(3 * REQUESTS)]
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i)
              for i in range(REQUESTS)]
    pairs = [(p, ids(8)) for p in prompts]
    return prompts, others, params, pairs


def _runner(model, **options) -> RadixBatchRunner:
    return RadixBatchRunner(model, deterministic=True, warm_up=False, **options)


def _run(runner: RadixBatchRunner, prompts, params, others, order) -> list[Outcome]:
    """The 64 requests (and `others`, greedy) in `order` over the 256; their tokens and log-likelihoods."""
    other = SamplingParams(max_new_tokens=16, ignore_eos=True)
    everyone = list(zip(prompts, params)) + [(p, other) for p in others]
    everyone = [everyone[i] for i in order]
    outs = runner.run([p for p, _ in everyone], [s for _, s in everyone], progress=False)
    tokens = {order[k]: o.token_ids for k, o in enumerate(outs)}
    return [list(tokens[i]) for i in range(len(prompts))]


def configurations(model, prompts, others, params, pairs, pool: int, small_pool: int) -> dict:
    """Each configuration's outcome of every request: {name: [(tokens, log-likelihood), ...]}."""
    n = len(prompts)
    base = dict(max_total_tokens=pool, max_running_requests=256)
    results: dict[str, list] = {}
    runner = _runner(model, **base)
    alone_tokens, alone_lp = [], []
    for p, s, pair in zip(prompts, params, pairs):
        runner.reset_cache()
        alone_tokens.append(list(runner.run([p], s, progress=False)[0].token_ids))
        runner.reset_cache()
        alone_lp.append(runner.loglikelihood([pair], progress=False)[0][0])
    results["alone"] = list(zip(alone_tokens, alone_lp))
    other_pairs = [(o, o[-8:]) for o in others]
    order = list(range(n + len(others)))
    interleaved = sorted(order, key=lambda i: (i % 4, i))  # the 64 spread among the others
    runner.reset_cache()
    front = len(other_pairs) // 3
    mixed = other_pairs[:front] + pairs + other_pairs[front:]
    lp = [x for x, _ in runner.loglikelihood(mixed, progress=False)]
    results["batch256"] = list(zip(_run(runner, prompts, params, others, interleaved), lp[front:front + n]))
    runner.reset_cache()
    lp = [x for x, _ in runner.loglikelihood(pairs[::-1], progress=False)][::-1]
    results["reversed"] = list(zip(_run(runner, prompts, params, others, interleaved[::-1]), lp))
    warm = _runner(model, **base, chunked_prefill_size=256)
    warm.reset_cache()
    warm.run([p[: len(p) - 3] for p in prompts], SamplingParams(max_new_tokens=1), progress=False)
    tokens = _run(warm, prompts, params, [], list(range(n)))
    lp = [x for x, _ in warm.loglikelihood(pairs, progress=False)]
    results["warm_cache_chunked"] = list(zip(tokens, lp))
    paged = _runner(model, page_size=16, max_total_tokens=small_pool, cuda_graph=False, overlap=False,
                    max_running_requests=256)
    tokens = _run(paged, prompts, params, others, order)
    lp = [x for x, _ in paged.loglikelihood(other_pairs + pairs, progress=False)][len(others):]
    results["page16_evict_eager"] = list(zip(tokens, lp))
    assert paged.engine.stats_dict()["evicted_tokens"] > 0, "the small pool evicted nothing"
    paged.check_integrity()
    results["generate"] = generate_greedy(model, prompts, params, pool)
    return results


def generate_greedy(model, prompts, params, pool: int) -> list[list[int] | None]:
    """Radix `generate`, one greedy request a call (None for the sampled ones: generate samples with
    transformers' own generator)."""
    hf_radix.configure(model, deterministic=True, page_size=1, max_total_tokens=pool)
    device = next(model.parameters()).device
    out: list[list[int] | None] = []
    for p, s in zip(prompts, params):
        if s.temperature:
            out.append(None)
            continue
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                             do_sample=False, cache_implementation="radix")
        out.append(gen[0, len(p):].tolist())
    return out


def identical(results: dict) -> list[bool]:
    """Per request: the same tokens and log-likelihood (bit for bit) in every configuration."""
    first = results["alone"]
    same = []
    for i, (tokens, lp) in enumerate(first):
        ok = all(r[i] == (tokens, lp) for name, r in results.items() if name != "generate")
        generated = results.get("generate", [None] * len(first))[i]
        same.append(ok and (generated is None or generated == tokens))
    return same


def _cost(model, device: str, make, work, runs: int = 3) -> dict:
    """Seconds of `work(runner)` with the mode off and on: the median of `runs` steady runs (each on an empty
    cache) after a warm-up run on other prompts (the first run)."""
    seconds: dict[bool, list[float]] = {}
    first: dict[bool, float] = {}
    for det in (False, True):
        runner = RadixBatchRunner(model, deterministic=det, max_total_tokens=200_000)
        first[det] = timed(lambda r=runner: work(r, make(1)), device)[0]
        seconds[det] = []
        for _ in range(runs):
            runner.reset_cache()
            seconds[det].append(timed(lambda r=runner: work(r, make(0)), device)[0])
        runner.check_integrity()
    default, det = (sorted(seconds[mode])[runs // 2] for mode in (False, True))
    return {"default_s": default, "deterministic_s": det, "cost": det / default,
            "default_runs_s": seconds[False], "deterministic_runs_s": seconds[True],
            "default_first_run_s": first[False], "deterministic_first_run_s": first[True]}


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--layers", type=int, help="model depth (default 32)")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    device = "cuda"
    torch.manual_seed(0)
    model = build_llama(False, device, layers=args.layers)
    vocab = model.config.vocab_size
    shape = dict(prefix_len=384, suffix_len=(16, 256))
    prompts, others, params, pairs = workload(vocab, **shape)
    setup_s, results = timed(
        lambda: configurations(model, prompts, others, params, pairs, 200_000, 8192), device)
    same = identical(results)
    result = {
        "config": {"model": "Llama-3.1-8B shape, random bf16 weights", "layers": args.layers or 32,
                   "device": torch.cuda.get_device_name(), **shape,
                   "requests": REQUESTS, "configurations": list(results)},
        "identical_fraction": sum(same) / len(same),
        "not_identical": [i for i, ok in enumerate(same) if not ok],
        "configurations_seconds": setup_s,
    }
    if not args.skip_cost:
        from gsp import make_prompts
        from score_bench import FULL, make_workload

        gsp_params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        gsp = _cost(model, device, lambda seed: make_prompts(8, 32, 2048, 256, vocab, True, seed),
                    lambda r, w: r.run(w, gsp_params, progress=False))
        score = _cost(model, device, lambda seed: make_workload(
            FULL["questions"], FULL["choices"], FULL["prefix_len"], FULL["question_len"], FULL["choice_len"],
            vocab, seed), lambda r, w: r.loglikelihood(w, progress=False))
        result.update(gsp=gsp, score=score, gsp_cost=gsp["cost"], score_cost=score["cost"])
    write_result(result, args.json)


if __name__ == "__main__":
    main()
