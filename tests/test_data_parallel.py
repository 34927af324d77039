"""Data parallel over 2 gloo processes: same outputs as one process, each shared prefix on one replica."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_processes import run_ranks

from hf_radix import RadixBatchRunner, RequestError, SamplingParams
from hf_radix.integrations.routing import CacheAwareRouter
from hf_radix.tiny import tiny_model

OPTIONS = {"attn_backend": "torch", "max_total_tokens": 2048}
GROUPS, PER_GROUP, PREFIX = 4, 4, 40
BAD = 2 * PER_GROUP + 1  # index of the request that must fail alone


def _workload():
    gen = torch.Generator().manual_seed(7)
    groups = [random_ids(gen, PREFIX) for _ in range(GROUPS)]
    prompts, group_of = [], []
    for j in range(PER_GROUP):  # interleaved, so the router (not the input order) must keep groups together
        for g, prefix in enumerate(groups):
            prompts.append(prefix + random_ids(gen, 3 + j))
            group_of.append(g)
    prompts[BAD] = prompts[BAD][:-1] + [10_000]  # outside the vocabulary
    pairs = [(groups[g][:30], random_ids(gen, 4)) for g in range(GROUPS) for _ in range(2)]
    return prompts, group_of, pairs


def _params():
    return SamplingParams(max_new_tokens=5, ignore_eos=True)


def _summary(outs) -> list:
    return [[o.prompt_token_ids, o.token_ids, o.finish_reason, o.error is not None] for o in outs]


def _edit(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)


def _replica(rank: int, device: torch.device) -> dict:
    from hf_radix.integrations.data_parallel import DataParallelRunner

    prompts, _, pairs = _workload()
    runner = DataParallelRunner(tiny_model("llama").to(device), **OPTIONS)
    outs = runner.run(prompts, _params())
    routes = runner.last_routes
    scores = runner.loglikelihood(pairs)
    rolling = runner.loglikelihood_rolling(prompts[:2])
    runner.check_integrity()
    replicas = runner.replica_stats  # before the calls below, which score more pairs
    stats = [runner.stats.prompt_tokens, runner.stats.cached_tokens, runner.stats.requests]
    errors, kept = [], None
    try:  # ranks given different inputs: refused on every rank, before any forward
        runner.run([[5 + rank, 6, 7]], _params())
    except ValueError as exc:
        errors.append(str(exc))
    try:  # a bad pair fails alone, reported on every rank (the error policy of one replica)
        runner.loglikelihood([pairs[0], ([5, 6], []), pairs[1]])
    except RequestError as exc:
        errors.append(str(exc))
        kept = [exc.results[0], exc.results[2]]
    returned = runner.loglikelihood([pairs[0], ([5, 6], [])], errors="return")
    runner.check_integrity()
    _edit(runner.local.model)  # every replica's weights change: their caches and the router's record drop
    after_edit = _summary(runner.run(prompts, _params()))
    runner.check_integrity()
    return {
        "after_edit": after_edit,
        "invalidations": runner.engine.stats.invalidations,
        "outs": _summary(outs),
        "scores": scores,
        "rolling": rolling,
        "routes": routes,
        "replicas": replicas,
        "stats": stats,
        "errors": errors,
        "kept": kept,
        "returned": returned,
    }


def test_two_replicas_match_one_process(tmp_path):
    check_two_replicas(tmp_path, "gloo")


def check_two_replicas(tmp_path, backend: str) -> None:
    """Two replicas (gloo on CPU, NCCL on 2 GPUs) against one process on the same device kind."""
    prompts, group_of, pairs = _workload()
    device = "cuda" if backend == "nccl" else "cpu"
    single = RadixBatchRunner(tiny_model("llama").to(device), **OPTIONS)
    outs = single.run(prompts, _params())
    run_stats = (single.stats.prompt_tokens, single.stats.cached_tokens)
    scores = single.loglikelihood(pairs)
    rolling = single.loglikelihood_rolling(prompts[:2])
    single.check_integrity()
    assert outs[BAD].error is not None and all(o.error is None for i, o in enumerate(outs) if i != BAD)

    engine_counts = (single.engine.stats.prompt_tokens, single.engine.stats.cached_tokens)
    runner_counts = [single.stats.prompt_tokens, single.stats.cached_tokens]
    _edit(single.model)
    after_edit = single.run(prompts, _params())
    assert single.engine.stats.invalidations == 1

    ranks = run_ranks(tmp_path, backend, _replica)

    for result in ranks:
        assert result["outs"] == _summary(outs)  # same tokens; the bad request fails alone
        assert [lp for lp, _ in result["scores"]] == pytest.approx([lp for lp, _ in scores], abs=1e-5)
        assert [greedy for _, greedy in result["scores"]] == [greedy for _, greedy in scores]
        assert result["rolling"] == pytest.approx(rolling, abs=1e-4)
        assert result["errors"][0].startswith("DataParallelRunner: the ranks were given different inputs")
        assert "(index 1): context and continuation must both be non-empty" in result["errors"][1]
        assert [lp for lp, _ in result["kept"]] == pytest.approx([lp for lp, _ in scores[:2]], abs=1e-5)
        assert result["returned"][1] is None
        assert result["returned"][0][0] == pytest.approx(scores[0][0], abs=1e-5)
        assert result["after_edit"] == _summary(after_edit) and result["invalidations"] == 1
    assert ranks[0]["replicas"] == ranks[1]["replicas"] and ranks[0]["stats"] == ranks[1]["stats"]

    routes = ranks[0]["routes"]
    for g in range(GROUPS):  # each group (one shared prefix) went to exactly one replica; both are used
        assert len({r for r, grp in zip(routes, group_of) if grp == g}) == 1
    assert set(routes) == {0, 1}
    replicas = ranks[0]["replicas"]
    generation = [r["engine"] for r in replicas]  # the engine counters after scoring as well
    assert all(r["cached_tokens"] > 0 and r["requests"] > 0 for r in replicas)
    # Summed over the replicas, exactly as many prompt tokens were served from cache as on one process:
    # no shared prefix was computed twice.
    dp_prompt = sum(e["prompt_tokens"] for e in generation)
    dp_cached = sum(e["cached_tokens"] for e in generation)
    assert (dp_prompt, dp_cached) == engine_counts
    assert run_stats[1] > 0
    assert ranks[0]["stats"][:2] == runner_counts


def test_router_keeps_prefix_groups_and_balances():
    gen = torch.Generator().manual_seed(3)
    prefixes = [random_ids(gen, 50) for _ in range(6)]
    prompts = [p + random_ids(gen, 5) for p in prefixes for _ in range(8)]  # group by group
    routes = CacheAwareRouter(2).route(prompts)
    groups = [set(routes[i * 8 : (i + 1) * 8]) for i in range(6)]
    assert all(len(g) == 1 for g in groups)
    assert sorted(routes).count(0) == sorted(routes).count(1)
    # Across calls, the replica holding a prefix gets its later prompts.
    router = CacheAwareRouter(2)
    first = router.route(prompts[::8])
    assert router.route([p + [9] for p in prompts[::8]]) == first


def test_router_balance_threshold_splits_a_hot_prefix():
    gen = torch.Generator().manual_seed(4)
    hot = random_ids(gen, 100)
    prompts = [hot + random_ids(gen, 20) for _ in range(40)]  # work: 100 + 40 * 20 = 900 tokens
    assert set(CacheAwareRouter(2, balance_abs_threshold=10**9).route(prompts)) == {0}
    split = CacheAwareRouter(2, balance_abs_threshold=0, balance_rel_threshold=1.0).route(prompts)
    # replica 0 takes the hot prefix up to its fair share (450 tokens: 120 + 16 * 20), then replica 1
    # computes it once more and the two share the rest
    assert split[:17] == [0] * 17 and split[17] == 1 and 17 <= split.count(0) <= 23


def test_router_forgets_beyond_capacity():
    router = CacheAwareRouter(1, capacity_tokens=[30])
    a, c = list(range(2, 27)), list(range(200, 225))
    router.route([a, c])  # the pool holds 30 tokens: `a`, least recently used, is forgotten
    assert router.trees[0].size_info.total_size <= 30
    assert router.trees[0].match_prefix(a).cached_len == 0
    assert router.trees[0].match_prefix(c).cached_len == len(c)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=12), max_size=30), st.integers(1, 4))
def test_router_is_deterministic(prompts, replicas):
    routes = CacheAwareRouter(replicas, balance_abs_threshold=8).route(prompts)
    assert routes == CacheAwareRouter(replicas, balance_abs_threshold=8).route(prompts)
    assert len(routes) == len(prompts) and all(0 <= r < replicas for r in routes)
