"""Warm starts: save/load round trips, refusals that change nothing, MRU loading into small pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fresh_model, random_ids

import hf_radix
from hf_radix import CacheFileError, RadixBatchRunner, SamplingParams
from hf_radix.tiny import tiny_config, tiny_model

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW)


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system, other = random_ids(gen, 33), random_ids(gen, 21)
    return [system + random_ids(gen, n) for n in (5, 9, 14)] + [other + random_ids(gen, 6), other]


def _runner(model=None, **options) -> RadixBatchRunner:
    options = {"attn_backend": "torch", "max_total_tokens": 1024, **options}
    return RadixBatchRunner(model if model is not None else fresh_model("llama"), **options)


def _snapshot(runner: RadixBatchRunner) -> tuple:
    """What a load must not change: every node's (path, slots), the free pages and the stats."""
    tree = runner.engine.manager.tree
    nodes = []
    for node in tree.nodes():
        path, n = [], node
        while n.parent is not None:
            path.append(n.key)
            n = n.parent
        nodes.append((np.concatenate(path[::-1]).tobytes(), node.value.tobytes()))
    return sorted(nodes), runner.engine.manager.num_free_pages, runner.engine.stats_dict()


def _saved(tmp_path, page_size: int = 1, seed: int = 0):
    runner = _runner(page_size=page_size)
    outs = runner.run(_prompts(seed), GREEDY)
    path = tmp_path / "cache.safetensors"
    info = runner.save_cache(path)
    assert info["tokens"] == runner.engine.manager.tree.size_info.total_size > 0
    return runner, outs, path


@pytest.mark.parametrize("page_size", [1, 4])
def test_round_trip_gives_full_hits_and_identical_outputs(tmp_path, page_size: int):
    runner, outs, path = _saved(tmp_path, page_size)
    rerun = runner.run(_prompts(), GREEDY)  # what a warm process reports: the original engine, run again
    fresh = _runner(page_size=page_size)
    info = fresh.load_cache(path)
    fresh.check_integrity()
    assert info["tokens"] == info["saved_tokens"] == runner.engine.manager.tree.size_info.total_size
    again = fresh.run(_prompts(), GREEDY)
    fresh.check_integrity()
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert [o.cached_tokens for o in again] == [o.cached_tokens for o in rerun]
    for prompt, out in zip(_prompts(), again):
        assert out.cached_tokens == (len(prompt) - 1) // page_size * page_size  # the whole matchable prompt


def test_generate_and_scoring_after_load(tmp_path):
    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=1024, attn_backend="torch")
    prompt = torch.tensor([_prompts()[0]])
    first = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache_implementation="radix")
    pairs = [(_prompts()[1], [7, 8, 9])]
    scores = _runner(model).loglikelihood(pairs)
    hf_radix.save_cache(model, tmp_path / "c.safetensors")

    other = fresh_model("llama")
    hf_radix.configure(other, max_total_tokens=1024, attn_backend="torch")
    hf_radix.load_cache(other, tmp_path / "c.safetensors")
    before = hf_radix.cache_stats(other)
    second = other.generate(prompt, max_new_tokens=NEW, do_sample=False, cache_implementation="radix")
    after = hf_radix.cache_stats(other)
    assert torch.equal(first, second)
    assert after["cached_tokens"] - before["cached_tokens"] == prompt.shape[1] - 1
    runner = _runner(other)
    assert runner.loglikelihood(pairs) == scores
    assert runner.stats.cached_tokens == len(pairs[0][0]) - 1  # all but the first scored position
    runner.check_integrity()


def _model_with(**overrides):
    torch.manual_seed(0)
    return transformers_model(tiny_config("llama", **overrides))


def transformers_model(config):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "other,options,message",
    [
        (lambda: tiny_model("llama", seed=1), {}, "other weights"),
        (lambda: tiny_model("mistral", seed=0), {}, "another model configuration"),
        (lambda: tiny_model("llama", seed=0).to(torch.float64), {}, "dtype"),
        (lambda: tiny_model("llama", seed=0), {"page_size": 2}, "page_size"),
        (lambda: _model_with(num_key_value_heads=4, head_dim=16), {}, "num_kv_heads"),
        (lambda: _model_with(num_hidden_layers=3, head_dim=16), {}, "num_layers"),
    ],
    ids=["weights", "architecture", "dtype", "page_size", "kv_heads", "layers"],
)
def test_mismatched_engine_is_refused_and_unchanged(tmp_path, other, options, message):
    _, _, path = _saved(tmp_path)
    target = _runner(other(), **options)
    target.run(_prompts(seed=5), GREEDY)
    before = _snapshot(target)
    with pytest.raises(CacheFileError, match=message):
        target.load_cache(path)
    assert _snapshot(target) == before
    target.check_integrity()


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    if how == "truncated":
        del data[-37:]
    elif how == "data":
        data[-5] ^= 0x40  # a byte of the last layer's values
    elif how == "tokens":
        data[8 + header_len + 3] ^= 0x01  # a byte of the first tree array
    elif how == "digest":
        marker = b'\\"k.0\\": \\"'
        at = data.index(marker) + len(marker) + 1
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    elif how == "header":
        data[12] = ord("}")
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "data", "tokens", "digest", "header", "empty"])
def test_damaged_file_is_refused_and_engine_unchanged(tmp_path, how: str):
    _, _, path = _saved(tmp_path)
    _damage(path, how)
    target = _runner()
    target.run(_prompts(seed=5), GREEDY)
    before = _snapshot(target)
    with pytest.raises(CacheFileError):
        target.load_cache(path)
    assert _snapshot(target) == before
    target.check_integrity()
    assert target.run(_prompts(seed=5), GREEDY)[0].error is None


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(CacheFileError):
        _runner().load_cache(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_pool_loads_the_most_recently_used_prefixes(tmp_path, page_size: int):
    gen = torch.Generator().manual_seed(3)
    old, recent = random_ids(gen, 40), random_ids(gen, 40)
    runner = _runner(page_size=page_size)
    runner.run([old], GREEDY)
    runner.run([recent], GREEDY)
    runner.save_cache(tmp_path / "c.safetensors")
    saved = runner.engine.manager.tree.size_info.total_size

    small = _runner(page_size=page_size, max_total_tokens=48)  # room for one conversation, not two
    info = small.load_cache(tmp_path / "c.safetensors")
    small.check_integrity()
    assert info["saved_tokens"] == saved and 40 <= info["tokens"] <= 48
    assert small.engine.manager.match(recent).cached_len == 39 // page_size * page_size
    assert small.engine.manager.match(old).cached_len <= 48 - 39 // page_size * page_size
    assert small.run([recent], GREEDY)[0].token_ids == runner.run([recent], GREEDY)[0].token_ids
    small.check_integrity()


def test_load_merges_into_a_warm_tree(tmp_path):
    runner, outs, path = _saved(tmp_path)
    runner.load_cache(path)  # every saved prefix is already there: all its pages come back
    runner.check_integrity()
    assert runner.engine.manager.tree.size_info.total_size == runner.save_cache(tmp_path / "b.st")["tokens"]
    assert [o.token_ids for o in runner.run(_prompts(), GREEDY)] == [o.token_ids for o in outs]


def test_save_and_load_are_refused_while_requests_run(tmp_path):
    runner, _, path = _saved(tmp_path)
    manager = runner.engine.manager
    handle = manager.match(_prompts()[0])
    manager.lock(handle)
    row = manager.open_row(handle)
    with pytest.raises(RuntimeError, match="running"):
        runner.save_cache(tmp_path / "other.safetensors")
    with pytest.raises(RuntimeError, match="running"):
        runner.load_cache(path)
    manager.cache_req(row, _prompts()[0], handle.cached_len, finished=True)
    runner.check_integrity()


def test_empty_cache_round_trip(tmp_path):
    runner = _runner()
    assert runner.save_cache(tmp_path / "e.safetensors")["tokens"] == 0
    fresh = _runner()
    assert fresh.load_cache(tmp_path / "e.safetensors")["tokens"] == 0
    fresh.check_integrity()


def _union_tokens(engine) -> int:
    """Tokens of every prefix either tier holds (each counted once)."""
    merged = hf_radix.memory.radix_tree.RadixPrefixCache(engine.page_size)
    for tree in (engine.manager.tree, engine.host_tier.tree):
        for node in tree.nodes():
            path, n = [], node
            while n.parent is not None:
                path.append(n.key)
                n = n.parent
            ids = np.concatenate(path[::-1])
            merged.insert_prefix(ids, np.arange(len(ids)))
    return merged.size_info.total_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_save_holds_the_host_tier_too(tmp_path, page_size: int):
    prompts = _prompts()
    runner = _runner(max_total_tokens=64, host_cache_tokens=512, page_size=page_size)
    outs = [runner.run([p], GREEDY)[0] for p in prompts]  # one at a time: earlier ones go to the host
    engine = runner.engine
    gpu_only = engine.manager.tree.size_info.total_size
    assert engine.host_tier.stored_tokens > 0 and _union_tokens(engine) > gpu_only
    info = runner.save_cache(tmp_path / "c.safetensors")
    assert info["tokens"] == _union_tokens(engine)
    runner.check_integrity()

    fresh = _runner(page_size=page_size)  # room for all of it on the GPU
    assert fresh.load_cache(tmp_path / "c.safetensors")["tokens"] == info["tokens"]
    fresh.check_integrity()
    again = [fresh.run([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert [o.cached_tokens for o in again] == [(len(p) - 1) // page_size * page_size for p in prompts]
    fresh.check_integrity()

    # a fresh engine like the first: the GPU takes the most recently used prefixes, the host tier all
    small = _runner(max_total_tokens=64, host_cache_tokens=512, page_size=page_size)
    loaded = small.load_cache(tmp_path / "c.safetensors")
    small.check_integrity()
    assert gpu_only <= loaded["tokens"] <= 64 and loaded["host_tokens"] == info["tokens"]
    last = prompts[-1]
    assert small.engine.manager.gpu_cached_len(last) == (len(last) - 1) // page_size * page_size
    again = [small.run([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert [o.cached_tokens for o in again] == [(len(p) - 1) // page_size * page_size for p in prompts]
    assert sum(o.host_cached_tokens for o in again) > 0
    small.check_integrity()


def test_a_host_tier_smaller_than_the_file_takes_the_most_recent_paths(tmp_path):
    runner, outs, path = _saved(tmp_path)
    target = _runner(max_total_tokens=64, host_cache_tokens=48)
    loaded = target.load_cache(path)
    target.check_integrity()
    assert loaded["tokens"] == 64 and 33 <= loaded["host_tokens"] <= 48 < loaded["saved_tokens"]
    assert [o.token_ids for o in target.run(_prompts(), GREEDY)] == [o.token_ids for o in outs]
    target.check_integrity()


@pytest.mark.parametrize("how", ["data", "truncated"])
def test_a_damaged_file_leaves_the_host_tier_as_it_was(tmp_path, how: str):
    _, _, path = _saved(tmp_path)
    _damage(path, how)
    target = _runner(max_total_tokens=64, host_cache_tokens=512)
    for prompt in _prompts(seed=5):
        target.run([prompt], GREEDY)
    tier = target.engine.host_tier
    before = _snapshot(target), tier.num_free_pages, tier.tree.size_info
    with pytest.raises(CacheFileError):
        target.load_cache(path)
    assert (_snapshot(target), tier.num_free_pages, tier.tree.size_info) == before
    target.check_integrity()


