"""On the GPU: the host tier's side-stream copies (no host sync, ordered before the next kernel) and
save/load give the outputs of an unbounded pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.memory.cache_manager import CacheManager
from hf_radix.memory.host_tier import HostTier
from hf_radix.memory.kv_pool import KVPool, KVShape
from hf_radix.tiny import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

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


def _on_device(values: np.ndarray) -> torch.Tensor:
    """A host array on the GPU without a host sync (pinned, non-blocking)."""
    return torch.from_numpy(values).pin_memory().to("cuda", non_blocking=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_host_tier_copies_never_sync_and_the_next_kernel_sees_them(page_size: int):
    """Evicting to host and copying back issue no host sync; work queued right after a copy back (as a
    forward or a graph replay would be) reads the restored K/V, and overwriting the evicted GPU pages right
    after the eviction does not reach the host copy."""
    shape = KVShape(num_layers=4, num_kv_heads=8, head_dim=128)
    tokens = 16384
    pool = KVPool(shape, tokens // page_size, page_size, torch.float16, "cuda")
    manager = CacheManager(tokens // page_size, page_size, device="cuda")
    tier = HostTier(pool, 2 * tokens, staging_pages=512 // page_size)  # several chunks per copy
    tier.attach(manager)
    n = tokens // 2
    ids = np.arange(n, dtype=np.int64) % 1000 + 3
    pages = manager.take_pages(n // page_size)
    slots = (pages[:, None] + np.arange(page_size)).reshape(-1)
    expected = (torch.arange(n, device="cuda") % 1024).half()  # exact in fp16
    for layer in range(shape.num_layers):
        pool.k_cache(layer)[torch.from_numpy(slots).cuda()] = (expected + layer)[:, None, None]
        pool.v_cache(layer)[torch.from_numpy(slots).cuda()] = (-expected - layer)[:, None, None]
    manager.tree.insert_prefix(ids, slots)
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        taken = manager.take_pages(manager.num_pages)  # evicts the prefix: copied out on the side stream
        pool.keys.fill_(-7.0)  # queued right after: must not reach the host copy
        pool.values.fill_(-7.0)
        manager.release_pages((taken[:, None] + np.arange(page_size)).reshape(-1))
        handle = manager.match(np.concatenate([ids, [1]]))  # copied back into fresh pages
        index = _on_device(handle.matched_indices())
        sums = torch.stack(
            [pool.k_cache(layer)[index].double().sum() for layer in range(shape.num_layers)]
            + [pool.v_cache(layer)[index].double().sum() for layer in range(shape.num_layers)]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert handle.cached_len == handle.restored_len == n
    base = float(expected.double().sum()) * shape.num_kv_heads * shape.head_dim
    per_layer = n * shape.num_kv_heads * shape.head_dim
    want = [base + layer * per_layer for layer in range(shape.num_layers)]
    assert sums.tolist() == want + [-w for w in want]
    manager.check_integrity()
