"""On the GPU: the host tier's side-stream copies and save/load give the outputs of an unbounded pool."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.tiny import tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

GREEDY = SamplingParams(max_new_tokens=8)


def _conversations(count: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    system = random_ids(gen, 16)
    return [system + random_ids(gen, 40) for _ in range(count)]


def _revisit(runner: RadixBatchRunner, prompts, waves: int = 3) -> list:
    outs = []
    for _ in range(2):
        for first in range(0, len(prompts), len(prompts) // waves):
            outs += runner.run(prompts[first : first + len(prompts) // waves], GREEDY)
            runner.check_integrity()
    return outs


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_host_tier_on_gpu_matches_unbounded(page_size: int, cuda_graph: bool):
    prompts = _conversations()
    options = dict(attn_backend="triton", page_size=page_size, cuda_graph=cuda_graph, max_running_requests=8)
    unbounded = RadixBatchRunner(tiny_model("llama").cuda(), max_total_tokens=4096, **options)
    tiered = RadixBatchRunner(
        tiny_model("llama").cuda(), max_total_tokens=320, host_cache_tokens=4096, **options
    )
    assert tiered.engine.host_tier.keys.is_pinned() and tiered.engine.host_tier.values.is_pinned()
    reference, outs = _revisit(unbounded, prompts), _revisit(tiered, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert tiered.stats.hit_rate == unbounded.stats.hit_rate
    assert tiered.stats.host_cached_tokens > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_save_load_round_trip_on_gpu(tmp_path, page_size: int):
    prompts = _conversations(6)
    runner = RadixBatchRunner(tiny_model("llama").cuda(), max_total_tokens=4096, page_size=page_size)
    outs = runner.run(prompts, GREEDY)
    info = runner.save_cache(tmp_path / "c.safetensors")
    assert info["tokens"] > 0
    model = tiny_model("llama").cuda()
    fresh = RadixBatchRunner(model, max_total_tokens=4096, page_size=page_size)
    assert hf_radix.load_cache(model, tmp_path / "c.safetensors")["tokens"] == info["tokens"]
    fresh.check_integrity()
    again = fresh.run(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.cached_tokens == (len(p) - 1) // page_size * page_size for o, p in zip(again, prompts))
