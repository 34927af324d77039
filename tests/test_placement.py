"""Device-map models: the pool placed per layer on that layer's device; a dispatched model runs unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from accelerate import dispatch_model
from conftest import hf_greedy, hf_logits, random_ids
from model_matrix import tiny_matrix_model
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from hf_radix import RadixBatchRunner, SamplingParams, UnsupportedModelError
from hf_radix.cache_utils import RadixCache
from hf_radix.engine import EngineOptions, RadixEngine
from hf_radix.forward import tensor_parallel
from hf_radix.memory.kv_pool import CPU_DEFAULT_TOKENS, KVPool, KVShape
from hf_radix.memory.placement import (
    PlacedKVPool,
    batch_to,
    hidden_output_device,
    is_dispatched,
    layer_device,
    layer_devices,
    placed_pool_tokens,
)
from hf_radix.paged_attention.forward_batch import ForwardBatch
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


@pytest.fixture
def restore_verbosity():
    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


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


def _batch(prefix: int, new: int) -> ForwardBatch:
    """One row's forward batch on the CPU: `prefix` cached slots, then `new` tokens."""
    total = prefix + new
    i32 = dict(dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.arange(new), positions=torch.arange(prefix, total),
        out_loc=torch.arange(prefix, total),
        qo_indptr=torch.tensor([0, new], **i32), prefix_lens=torch.tensor([prefix], **i32),
        seq_lens=torch.tensor([total], **i32), kv_indices=torch.arange(total),
        kv_indptr=torch.tensor([0, total], **i32), prefix_kv_indices=torch.arange(prefix),
        prefix_kv_indptr=torch.tensor([0, prefix], **i32), logits_indices=torch.tensor([new - 1]),
        qo_indptr_host=np.array([0, new]), seq_lens_host=np.array([total]), max_new_len=new, max_kv_len=total,
    )


def test_batch_metadata_is_copied_once_per_device():
    batch = _batch(2, 3)
    moved = batch_to(batch, torch.device("meta"))
    assert moved.out_loc.device.type == "meta" and moved.kv_indices.device.type == "meta"
    assert moved.qo_indptr_host is batch.qo_indptr_host and moved.max_kv_len == batch.max_kv_len
    cache = RadixCache(SimpleNamespace(), batch)
    assert cache.batch_on(CPU) is batch
    meta = torch.device("meta")
    first = cache.batch_on(meta)
    assert first is cache.batch_on(meta) and first.out_loc.device == meta
    cache.batch = _batch(1, 1)
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


def _split_over_two_host_devices(model):
    """Layer 1 "on" cpu:0 (a distinct device to the placement, the same memory): a two-chunk pool."""
    model.model.layers[1]._hf_hook = _hook(torch.device("cpu", 0))
    return model


@pytest.mark.parametrize("page_size", [1, 4])
def test_mla_latent_pool_split_over_devices_matches_hf(page_size: int):
    reference = tiny_matrix_model("DeepseekV3")
    model = _split_over_two_host_devices(tiny_matrix_model("DeepseekV3"))
    runner = RadixBatchRunner(model, page_size=page_size, attn_backend="torch", max_total_tokens=512)
    pool = runner.engine.pool
    assert isinstance(pool, PlacedKVPool) and pool.shape.latent and len(pool.chunks) == 2
    gen = torch.Generator().manual_seed(5)
    shared = random_ids(gen, 13, vocab=reference.config.vocab_size)
    prompts = [shared + random_ids(gen, n, vocab=reference.config.vocab_size) for n in (2, 6, 3)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = runner.run(prompts[:1], params) + runner.run(prompts[1:], params)  # the later ones hit the cache
    assert [o.token_ids for o in outs] == [hf_greedy(reference, p, 4) for p in prompts]
    assert all(o.cached_tokens >= len(shared) - 1 for o in outs[1:])
    runner.check_integrity()


def test_host_tier_and_cache_files_refuse_a_pool_over_several_devices(tmp_path):
    model = _split_over_two_host_devices(tiny_model("llama"))
    with pytest.raises(NotImplementedError, match="host-memory tier .* split over several devices"):
        RadixEngine(model, EngineOptions(max_total_tokens=64, host_cache_tokens=64, attn_backend="torch"))
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=64)
    assert isinstance(runner.engine.pool, PlacedKVPool)
    runner.run([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2))
    with pytest.raises(NotImplementedError, match="save of the prefix cache .* split over several devices"):
        runner.save_cache(tmp_path / "cache.safetensors")
    with pytest.raises(NotImplementedError, match="load of the prefix cache .* split over several devices"):
        runner.load_cache(tmp_path / "cache.safetensors")
    assert not (tmp_path / "cache.safetensors").exists()
    runner.check_integrity()


def test_pool_warning_names_every_device_and_the_total_size(restore_verbosity):
    transformers.logging.set_verbosity_warning()
    model = _split_over_two_host_devices(tiny_model("llama"))
    with CaptureLogger(logging.get_logger()) as captured:
        engine = RadixEngine(model, EngineOptions(attn_backend="torch"))  # default-sized: a WARNING
    gib = engine.pool.nbytes / 2**30
    assert f"takes {gib:.2f} GiB of cpu + cpu:0 memory" in captured.out
    assert engine.pool.nbytes == sum(chunk.nbytes for chunk in engine.pool.chunks.values())
    engine.set_backends(EngineOptions(attn_backend="torch", store_backend="torch"))
    assert {chunk.store_backend for chunk in engine.pool.chunks.values()} == {"torch"}


def test_tensor_parallel_refuses_mla_latents(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "tp_group", lambda model: object())
    latent = KVShape(num_layers=2, num_kv_heads=1, head_dim=16, v_head_dim=8, latent=True)
    with pytest.raises(UnsupportedModelError, match="MLA layers .* tensor parallel"):
        tensor_parallel.local_kv_shape(tiny_model("llama"), latent)
