"""Device-map models: the pool placed per layer on that layer's device; a dispatched model runs unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import dispatch_model
from conftest import hf_greedy, hf_logits, random_ids

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.cache_utils import RadixCache
from hf_radix.forward_batch import build_forward_batch
from hf_radix.kv_pool import CPU_DEFAULT_TOKENS, KVPool, KVShape
from hf_radix.placement import (
    PlacedKVPool,
    batch_to,
    hidden_output_device,
    is_dispatched,
    layer_device,
    layer_devices,
    placed_pool_tokens,
)
from hf_radix.tiny import tiny_model

CPU, FAKE_GPU = torch.device("cpu"), torch.device("cuda", 1)  # the fake device is only named, never used
LAYER_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


def _hook(device) -> SimpleNamespace:
    return SimpleNamespace(execution_device=device)  # what placement reads of accelerate's AlignDevicesHook


def test_layer_devices_follow_accelerate_hooks():
    model = tiny_model("llama")
    assert not is_dispatched(model)
    assert layer_devices(model, 2, CPU) == [CPU, CPU]
    model.model.layers[1]._hf_hook = _hook(FAKE_GPU)
    model.model.norm._hf_hook = SimpleNamespace(hooks=[_hook("cuda:1")])  # a SequentialHook
    assert is_dispatched(model)
    assert layer_devices(model, 2, CPU) == [CPU, FAKE_GPU]
    assert layer_devices(model, 3, CPU) == [CPU, FAKE_GPU, CPU]  # a layer not found: the default
    assert hidden_output_device(model, CPU) == FAKE_GPU


def test_placed_pool_keeps_each_layer_on_its_device():
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4)
    pool = PlacedKVPool(shape, 4, 2, torch.float32, layer_devices=["cpu", "meta", "cpu"])
    assert [pool.k_cache(i).device.type for i in range(3)] == ["cpu", "meta", "cpu"]
    assert pool.k_cache(0).shape == (8, 2, 4) and pool.num_slots == 8 and pool.device == CPU
    assert len(pool.chunks) == 2 and pool.chunks[CPU].shape.num_layers == 2
    assert pool.nbytes == 2 * 3 * 8 * 2 * 4 * 4
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    loc = torch.tensor([5, 1, 6])
    pool.store_kv(k, v, loc, 2)
    assert torch.equal(pool.k_cache(2)[loc], k) and torch.equal(pool.v_cache(2)[loc], v)
    assert not pool.k_cache(0).any()  # layer 2 shares the CPU chunk with layer 0, not its storage
    pool.store_kv(k.to("meta"), v.to("meta"), loc.to("meta"), 1)  # layer 1 writes on its own device
    pool.copy_slots(np.array([5, 6]), np.array([2, 3]))
    assert torch.equal(pool.k_cache(2)[2:4], k[[0, 2]])
    with layer_device(pool, 1), layer_device(KVPool(shape, 1, 1, torch.float32, "cpu"), 0):
        pass  # non-CUDA devices need no guard; a plain pool none at all


def test_placed_pool_size_is_the_tightest_device():
    shape = KVShape(num_layers=4, num_kv_heads=2, head_dim=4)
    assert placed_pool_tokens(shape, torch.float32, [CPU] * 4, 1, 96, 0.9) == 96
    assert placed_pool_tokens(shape, torch.float32, [CPU, CPU, torch.device("meta")] * 2, 1, None, 0.9) == (
        CPU_DEFAULT_TOKENS
    )
    with pytest.raises(ValueError, match="mismatch|layer devices"):
        PlacedKVPool(shape, 2, 1, torch.float32, [CPU])


def test_batch_metadata_is_copied_once_per_device():
    batch = build_forward_batch([np.arange(5)], [np.array([3, 4, 5])], [2], None, CPU)
    moved = batch_to(batch, torch.device("meta"))
    assert moved.out_loc.device.type == "meta" and moved.kv_indices.device.type == "meta"
    assert moved.qo_indptr_host is batch.qo_indptr_host and moved.max_kv_len == batch.max_kv_len
    cache = RadixCache(SimpleNamespace(), batch)
    assert cache.batch_on(CPU) is batch
    meta = torch.device("meta")
    first = cache.batch_on(meta)
    assert first is cache.batch_on(meta) and first.out_loc.device == meta
    cache.batch = build_forward_batch([np.arange(2)], [np.array([7])], [1], None, CPU)
    assert cache.batch_on(meta) is not first and cache.batch_on(meta).num_tokens == 1


@pytest.mark.parametrize("page_size,chunk", [(1, 8192), (4, 7)])
def test_dispatched_model_runs_unchanged(page_size: int, chunk: int):
    reference = tiny_model("llama")
    model = dispatch_model(tiny_model("llama"), device_map=LAYER_MAP, force_hooks=True)
    assert is_dispatched(model)
    runner = RadixBatchRunner(
        model, page_size=page_size, chunked_prefill_size=chunk, attn_backend="torch", max_total_tokens=1024
    )
    runner.reset_cache()
    engine = runner.engine
    assert isinstance(engine.pool, KVPool) and engine.single_device  # a map onto one device: one buffer
    # Two chunks on the host: "cpu:0" and "cpu" are distinct devices to the placement, the same memory.
    engine.pool = PlacedKVPool(
        engine.pool.shape, engine.pool.num_pages, page_size, torch.float32, [CPU, torch.device("cpu", 0)]
    )
    assert len(engine.pool.chunks) == 2 and not engine.single_device
    gen = torch.Generator().manual_seed(1)
    shared = random_ids(gen, 21)
    prompts = [shared + random_ids(gen, n) for n in (2, 5, 9)] + [shared[:9]]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference, prompt, 5)
    assert runner.stats.cached_tokens > 0
    context, continuation = shared, random_ids(gen, 4)
    [(logprob, _)] = runner.loglikelihood([(context, continuation)])
    logp = hf_logits(reference, context + continuation).log_softmax(-1)
    expected = sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))
    assert logprob == pytest.approx(expected, abs=1e-4)
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
            cache_implementation="radix", pad_token_id=0,
        )
    assert out[0, ids.shape[1] :].tolist() == hf_greedy(reference, prompts[0], 4)
    runner.check_integrity()
