"""Multi-GPU paths on 2 GPUs: data and tensor parallel over NCCL, a device map over 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from conftest import hf_greedy, hf_logits, random_ids
from test_data_parallel import check_two_replicas
from test_tensor_parallel import check_tensor_parallel

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.memory.placement import PlacedKVPool
from hf_radix.tiny import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

TWO_GPU_MAP = {
    "model.embed_tokens": 0,
    "model.rotary_emb": 0,
    "model.layers.0": 0,
    "model.layers.1": 1,
    "model.norm": 1,
    "lm_head": 1,
}


def test_data_parallel_over_nccl(tmp_path):
    check_two_replicas(tmp_path, "nccl")


def test_tensor_parallel_over_nccl(tmp_path):
    check_tensor_parallel(tmp_path, "nccl")


@pytest.mark.parametrize("attn_backend,page_size", [("torch", 1), ("triton", 1), ("triton", 4)])
def test_device_map_over_two_gpus(attn_backend: str, page_size: int):
    reference = tiny_model("llama").to("cuda:0")
    model = dispatch_model(tiny_model("llama"), device_map=TWO_GPU_MAP)
    runner = RadixBatchRunner(model, page_size=page_size, attn_backend=attn_backend, max_total_tokens=2048)
    runner.reset_cache()
    pool = runner.engine.pool
    assert isinstance(pool, PlacedKVPool)
    assert [pool.k_cache(i).device for i in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    gen = torch.Generator().manual_seed(2)
    shared = random_ids(gen, 37)
    prompts = [shared + random_ids(gen, n) for n in (3, 8, 13)] + [random_ids(gen, 9)]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference, prompt, 6)
    assert runner.stats.cached_tokens > 0
    continuation = random_ids(gen, 5)
    [(logprob, _)] = runner.loglikelihood([(shared, continuation)])
    logp = hf_logits(reference, shared + continuation).log_softmax(-1)
    expected = sum(float(logp[len(shared) - 1 + i, t]) for i, t in enumerate(continuation))
    assert logprob == pytest.approx(expected, abs=1e-3)
    with torch.inference_mode():
        ids = torch.tensor([prompts[1]], device="cuda:0")
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
            cache_implementation="radix", pad_token_id=0,
        )
    assert out[0, ids.shape[1] :].tolist() == hf_greedy(reference, prompts[1], 5)
    runner.check_integrity()
