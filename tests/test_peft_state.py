"""PEFT adapters are namespaces of the prefix cache: each adapter set keeps its own prefixes, switching
back hits, merges drop the cache, and every call equals plain transformers on the model as it is."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_model
from state_checks import NEW, assert_matches_hf, prompts

import hf_radix
from hf_radix import CacheFileError, RadixBatchRunner, SamplingParams

peft = pytest.importorskip("peft")


def _lora_model():
    model = fresh_model("llama")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**config), adapter_name="first")
    torch.manual_seed(2)
    wrapped.add_adapter("second", peft.LoraConfig(**config))
    return wrapped.eval()


def _cached(runner: RadixBatchRunner) -> list[int]:
    return [o.cached_tokens for o in runner.run(prompts(), SamplingParams(max_new_tokens=NEW))]


def test_adapters_first_second_first_compute_the_prefix_once_each():
    model = _lora_model()
    runner = RadixBatchRunner(model)
    shared = len(prompts()[0]) - 3  # the prefix all three prompts share
    for adapter, first_hit in (("first", False), ("second", False), ("first", True), ("second", True)):
        model.set_adapter(adapter)
        cached = _cached(runner)
        assert (cached[0] >= shared) == first_hit, (adapter, cached)
        assert_matches_hf(model, runner)
    stats = hf_radix.cache_stats(model)
    assert stats["invalidations"] == 0


def test_disabled_adapters_are_the_base_models_namespace():
    model = _lora_model()
    runner = RadixBatchRunner(model)
    base = fresh_model("llama")
    base_runner = RadixBatchRunner(base)
    expected = [o.token_ids for o in base_runner.run(prompts(), SamplingParams(max_new_tokens=NEW))]
    with model.disable_adapter():
        assert [o.token_ids for o in runner.run(prompts(), SamplingParams(max_new_tokens=NEW))] == expected
        assert_matches_hf(model, runner)
        assert _cached(runner)[0] > 0
    model.set_adapter("first")
    assert _cached(runner)[0] == 0  # the adapter's own namespace: nothing of the base model's is read
    assert_matches_hf(model, runner)


def test_merge_and_unmerge_drop_the_cache():
    model = _lora_model()
    runner = RadixBatchRunner(model)
    assert_matches_hf(model, runner)
    model.base_model.merge_adapter()
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 1
    model.base_model.unmerge_adapter()
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 2


def test_training_one_adapter_drops_the_cache():
    model = _lora_model()
    runner = RadixBatchRunner(model)
    assert_matches_hf(model, runner)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([prompts(1)[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 1


def test_adding_an_adapter_keeps_the_other_namespaces():
    model = _lora_model()
    runner = RadixBatchRunner(model)
    _cached(runner)
    torch.manual_seed(3)
    model.add_adapter("third", peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    assert _cached(runner)[0] > 0  # adapter "first" is still active: its prefixes are still valid
    model.set_adapter("third")
    assert _cached(runner)[0] == 0
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 0


def test_cache_files_record_the_adapter_set(tmp_path):
    model = _lora_model()
    runner = RadixBatchRunner(model)
    _cached(runner)
    path = tmp_path / "a.safetensors"
    runner.save_cache(path)
    runner.reset_cache()
    model.set_adapter("second")
    with pytest.raises(CacheFileError, match="adapters"):
        runner.load_cache(path)
    model.set_adapter("first")
    assert runner.load_cache(path)["tokens"] > 0
    assert _cached(runner)[0] > 0
    assert_matches_hf(model, runner)
    runner.reset_cache()
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["first"].weight.add_(0.5)
    with pytest.raises(CacheFileError, match="other weights"):
        runner.load_cache(path)
    runner.check_integrity()


def test_host_tier_keeps_each_adapter_sets_prefixes():
    """Prefixes evicted to the host tier come back only into their own adapter set's namespace."""
    model = _lora_model()
    runner = RadixBatchRunner(model, max_total_tokens=48, host_cache_tokens=1024)
    shared = prompts()
    first = [o.token_ids for o in runner.run(shared, SamplingParams(max_new_tokens=NEW))]
    model.set_adapter("second")
    second = runner.run(shared, SamplingParams(max_new_tokens=NEW))  # evicts the first set's prefixes
    assert second[0].cached_tokens == 0
    model.set_adapter("first")
    again = runner.run(shared, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in again] == first
    assert again[0].host_cached_tokens > 0  # copied back from the host tier, the first set's own copy
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 0
