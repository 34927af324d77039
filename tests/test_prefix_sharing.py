"""Radix `generate` computes a prefix that rows of one call share, and the cache does not hold, once
(`integrations/prefix_sharing.py`): the plan alone, then dense and hybrid models whose tokens and every
step's logits equal plain transformers while the engine's statistics show the prefix computed once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fresh_model, random_ids

import hf_radix
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_model
from hf_radix.integrations.prefix_sharing import MIN_SAVED, leader_targets

PAD = 0
NEW = 4


def _plan(prompts: list[list[int]], computed: list[int], page_size: int) -> dict[int, int]:
    arrays = {b: np.array(p) for b, p in enumerate(prompts)}
    return leader_targets(arrays, dict(enumerate(computed)), page_size).targets


def test_the_plan_picks_one_leader_per_run_up_to_what_its_followers_share() -> None:
    gen = torch.Generator().manual_seed(0)
    shared = random_ids(gen, 100)
    prompts = [shared + random_ids(gen, 10) for _ in range(6)]
    first = min(range(6), key=lambda b: np.array(prompts[b]).tobytes())
    assert _plan(prompts, [0] * 6, 1) == {first: 100}
    assert _plan(prompts, [0] * 6, 16) == {first: 96}  # whole pages
    assert _plan(prompts, [100] * 6, 1) == {}  # cached already
    assert MIN_SAVED > 100 and _plan(prompts[:2], [0, 0], 1) == {}  # one follower saves too little
    # a second run, sharing a longer prefix among its rows, gets its own leader
    other = random_ids(gen, 200)
    prompts += [other + random_ids(gen, 5) for _ in range(3)]
    plan = _plan(prompts, [0] * 9, 1)
    assert sorted(plan.values()) == [100, 200] and first in plan
    # the leader is the row that saves the others most: here one of the longer prompts, short of its end
    assert _plan([shared + shared, shared + shared + shared[:9]] * 2, [0] * 4, 1) in ({1: 208}, {3: 208})
    # a row sharing half the prefix with the others does not shorten what they share
    half = shared[:50] + random_ids(gen, 5)
    assert _plan([half, *prompts[:6]], [0] * 7, 1) == {1 + first: 100}


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _both(model, prompts: list[list[int]], **kwargs) -> dict:
    """Plain then radix generate: equal sequences and step logits; the radix call's statistics."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in _left_pad(prompts))
    kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                  return_dict_in_generate=True, output_logits=True) | kwargs
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    before = hf_radix.cache_stats(model)
    got = model.generate(ids, attention_mask=mask, cache_implementation="radix", **kwargs)
    after = hf_radix.cache_stats(model)
    assert torch.equal(got.sequences, ref.sequences)
    for mine, theirs in zip(got.logits, ref.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4 if device.type == "cpu" else 2e-3, rtol=0)
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    assert engine.manager.num_rows == 0
    return {key: after[key] - before[key] for key in ("computed_tokens", "cached_tokens", "prompt_tokens")}


def _prompts(seed: int, shared_len: int) -> list[list[int]]:
    """Five prompts on one shared prefix, one on half of it, one on nothing, duplicates of two of them."""
    gen = torch.Generator().manual_seed(seed)
    shared = random_ids(gen, shared_len, vocab=90)
    prompts = [shared + random_ids(gen, n, vocab=90) for n in (5, 9, 3, 12, 7)]
    prompts += [shared[: shared_len // 2] + random_ids(gen, 6, vocab=90), random_ids(gen, 11, vocab=90)]
    return prompts + prompts[1:3]


def _check_computed_once(stats: dict, prompts: list[list[int]], shared_len: int, page_size: int) -> None:
    shared = shared_len // page_size * page_size
    saved = 4 * shared + (shared_len // 2) // page_size * page_size  # four followers and the half-sharer
    decode = len(prompts) * (NEW - 1)
    duplicates = sum(len(p) for p in prompts[-2:])
    assert stats["computed_tokens"] <= sum(map(len, prompts)) - duplicates - saved + decode
    assert stats["cached_tokens"] >= saved + duplicates


@pytest.mark.parametrize(("arch", "page_size", "chunk"), [("llama", 1, None), ("qwen2", 4, 64)])
def test_dense_rows_sharing_a_prefix_compute_it_once(arch: str, page_size: int, chunk: int | None) -> None:
    model = fresh_model(arch)
    hf_radix.configure(model, max_total_tokens=4096, page_size=page_size, attn_backend="torch")
    prompts = _prompts(1, 120)
    stats = _both(model, prompts, prefill_chunk_size=chunk)
    _check_computed_once(stats, prompts, 120, page_size)
    again = _both(model, prompts)  # a second call hits every prompt up to its last page boundary
    tails = sum(len(p) - (len(p) - 1) // page_size * page_size for p in prompts[:-2])  # (duplicates: none)
    assert again["computed_tokens"] == tails + len(prompts) * (NEW - 1)


def test_a_call_that_fits_only_with_its_prefix_shared_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight rows on a 300-token prefix need 8 x (300 + tail + new) slots computed per row, more than the
    pool holds; computed once, the prefix leaves room: the call runs (exact). Without sharing it is refused
    before any forward, with advice, and the cache stays consistent."""
    from hf_radix.integrations import prefix_sharing

    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=1024, page_size=4, attn_backend="torch")
    gen = torch.Generator().manual_seed(3)
    shared = random_ids(gen, 300, vocab=90)
    prompts = [shared + random_ids(gen, 10 + b, vocab=90) for b in range(8)]
    stats = _both(model, prompts)
    assert stats["computed_tokens"] < 300 + 8 * (20 + NEW)
    hf_radix.reset_cache(model)
    monkeypatch.setattr(prefix_sharing, "MIN_SAVED", 10**9)  # no round pays: every row computes the prefix
    ids, mask = _left_pad(prompts)
    with pytest.raises(ValueError, match="KV-cache slots"):
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                       cache_implementation="radix")
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    assert engine.manager.num_rows == 0


@pytest.mark.slow
@pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API")
@pytest.mark.parametrize(("family", "page_size", "chunk"), [("qwen3_5", 1, None), ("nemotron_h", 16, 48),
                                                            ("lfm2", 4, None)])
def test_hybrid_rows_sharing_a_prefix_compute_it_once(family: str, page_size: int, chunk: int | None) -> None:
    """The leader's forwards end at the branch point (a snapshot point); the others re-open on it."""
    model = tiny_hybrid_model(family)
    hf_radix.configure(model, max_total_tokens=2048, page_size=page_size)
    prompts = _prompts(2, 100)
    _check_computed_once(_both(model, prompts, prefill_chunk_size=chunk), prompts, 100, page_size)
    assert hf_radix.get_engine(model).manager.tree.snapshot_slots()  # the snapshots the followers read


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_rows_sharing_a_prefix_compute_it_once_on_gpu(family: str) -> None:
    """On the GPU (Triton attention, decode graphs; the hybrid's state layers on their GPU paths), fp32."""
    if family == "qwen3_5" and not cache_state_api():
        pytest.skip("this transformers' state layers bypass the Cache API")
    model = (tiny_hybrid_model(family) if family == "qwen3_5" else fresh_model(family)).cuda()
    hf_radix.configure(model, max_total_tokens=4096, page_size=16, attn_backend="triton")
    prompts = _prompts(3, 100)
    _check_computed_once(_both(model, prompts), prompts, 100, 16)


@pytest.mark.parametrize("failing", [1, 2])
def test_an_error_in_a_sharing_round_or_after_it_releases_everything(failing: int) -> None:
    """A forward that raises in the leader's round (1) or in generate's own step after the others re-opened
    (2): every row and lock is released, the engine stays consistent, and the next call is exact."""
    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=4096, page_size=4, attn_backend="torch")
    prompts = _prompts(4, 120)
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == failing:
            raise RuntimeError("raised inside a forward")

    handle = model.model.layers[-1].register_forward_hook(hook)
    ids, mask = _left_pad(prompts)
    with pytest.raises(RuntimeError, match="inside a forward"):
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                       cache_implementation="radix")
    handle.remove()
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    assert engine.manager.num_rows == 0 and engine.manager.tree.size_info.protected_size == 0
    _both(model, prompts)
