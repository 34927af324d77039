"""The key mechanism of hybrid prefix caching: a prefix's state saved in a StatePool slot and restored
later (into other running slots, batched with rows restored from other snapshots) continues exactly
like plain transformers on the whole prompt (fp32, atol 1e-5), through chunked prefill and decode.

Attention K/V here stay in transformers' own DynamicCache layers; only the states go through the pool.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from hf_radix.hybrid_layers import cache_state_api, state_specs, tiny_hybrid_model
from hf_radix.memory.state_pool import StateBatch, StateCacheMixin, StatePool

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]

warnings.filterwarnings("ignore")
ATOL = 1e-5
P, L = 7, 16  # prefix length, prompt length


class PooledStateCache(StateCacheMixin, DynamicCache):
    """A DynamicCache whose state layers live in a StatePool (the test's stand-in for RadixCache)."""

    def __init__(self, config, batch: StateBatch):
        super().__init__(config=config)
        self.state_batch = batch


def _forward(model, ids, cache, start):
    pos = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True, position_ids=pos)
    cache.state_batch.flush()
    return out.logits


def _kv(cache):
    return {i: (layer.keys.clone(), layer.values.clone()) for i, layer in enumerate(cache.layers)
            if isinstance(layer, CacheLayerMixin) and layer.keys is not None}


def _prefix_snapshot(model, pool, ids):
    """Run the prefix in a running slot, save it to a snapshot slot, free the running slot."""
    (run,) = pool.alloc(1)
    cache = PooledStateCache(model.config, StateBatch(pool, [run], has_previous=False))
    _forward(model, ids[:, :P], cache, 0)
    (snap,) = pool.alloc(1, zero=False)
    pool.copy_slot(run, snap)
    # The running slot moves on (another suffix), which must not touch the snapshot.
    cache.state_batch = StateBatch(pool, [run], has_previous=True)
    _forward(model, torch.randint(3, 90, (1, 3)), cache, P)
    pool.free([run])
    return snap, {i: (k[..., :P, :], v[..., :P, :]) for i, (k, v) in _kv(cache).items()}


FAMILIES = ["qwen3_5", "qwen3_next", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "lfm2", "mamba2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_restored_snapshots_continue_exactly(name):
    model = tiny_hybrid_model(name)
    pool = StatePool(state_specs(model), num_slots=6)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, 90, (3, L), generator=g)  # three different prompts, different prefixes
    with torch.no_grad():
        full = model(input_ids=prompts, use_cache=False, position_ids=torch.arange(L).expand(3, -1)).logits

    snaps, kvs = zip(*(_prefix_snapshot(model, pool, prompts[i: i + 1]) for i in range(3)))
    rows = [2, 0]  # restore out of order, into fresh running slots
    running = pool.alloc(len(rows), zero=False)
    pool.copy_slots([snaps[r] for r in rows], running)

    cache = PooledStateCache(model.config, StateBatch(pool, running, has_previous=True))
    for layer_idx in kvs[0]:
        k = torch.cat([kvs[r][layer_idx][0] for r in rows])
        v = torch.cat([kvs[r][layer_idx][1] for r in rows])
        cache.layers[layer_idx].update(k, v)

    ids = prompts[rows]
    got, pos = [], P
    for chunk in (3, 4, 1, 1):  # chunked prefill of the suffix, then decode-sized steps
        cache.state_batch = StateBatch(pool, running, has_previous=True)
        got.append(_forward(model, ids[:, pos: pos + chunk], cache, pos))
        pos += chunk
    got = torch.cat(got, 1)
    torch.testing.assert_close(got, full[rows, P:pos], atol=ATOL, rtol=0)

    # The snapshots are untouched by the continuation: restoring again gives the same first logits.
    again = pool.alloc(1, zero=False)
    pool.copy_slots([snaps[1]], again)
    cache = PooledStateCache(model.config, StateBatch(pool, again, has_previous=True))
    for layer_idx, (k, v) in kvs[1].items():
        cache.layers[layer_idx].update(k, v)
    first = _forward(model, prompts[1:2, P: P + 2], cache, P)
    torch.testing.assert_close(first, full[1:2, P: P + 2], atol=ATOL, rtol=0)

    # And the states matter: the same continuation from an empty state is far off.
    pool.zero_slots(again)
    cache = PooledStateCache(model.config, StateBatch(pool, again, has_previous=True))
    for layer_idx, (k, v) in kvs[1].items():
        cache.layers[layer_idx].update(k, v)
    off = _forward(model, prompts[1:2, P: P + 2], cache, P)
    assert (off - full[1:2, P: P + 2]).abs().max() > 30 * ATOL, (off - full[1:2, P: P + 2]).abs().max()
    pool.free(running + again + list(snaps))
    pool.check_integrity()
    assert pool.num_used == 0


@pytest.mark.parametrize("name", ["qwen3_5", "bamba", "lfm2"])
def test_fresh_row_with_zero_slot_batches_with_a_continuing_row(name):
    """A row starting a sequence (zeroed slot) in a batch that continues another row's state."""
    model = tiny_hybrid_model(name)
    pool = StatePool(state_specs(model), num_slots=4)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, 90, (1, 2 * P), generator=g)
    b = torch.randint(3, 90, (1, P), generator=g)
    with torch.no_grad():
        full_a = model(input_ids=a, use_cache=False, position_ids=torch.arange(2 * P)[None]).logits
        full_b = model(input_ids=b, use_cache=False, position_ids=torch.arange(P)[None]).logits
    snap, kv = _prefix_snapshot(model, pool, a)
    running = pool.alloc(2)  # row 1's slot stays zero: an empty sequence
    pool.copy_slots([snap], running[:1])
    cache = PooledStateCache(model.config, StateBatch(pool, running, has_previous=True))
    for layer_idx, (k, v) in kv.items():  # row 1 has no K/V: its attention must not see row 0's
        zk, zv = torch.zeros_like(k), torch.zeros_like(v)
        cache.layers[layer_idx].update(torch.cat([k, zk]), torch.cat([v, zv]))
    mask = torch.ones(2, 2 * P, dtype=torch.long)
    mask[1, :P] = 0
    pos = torch.stack([torch.arange(P, 2 * P), torch.arange(P)])
    with torch.no_grad():
        out = model(input_ids=torch.cat([a[:, P:], b]), cache=cache, use_cache=True, position_ids=pos,
                    attention_mask=mask)
    cache.state_batch.flush()
    torch.testing.assert_close(out.logits[0], full_a[0, P:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[1], full_b[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_5", "bamba"])
def test_padding_inside_a_continuation_chunk_is_not_exact(name):
    """Why a hybrid forward cannot pad rows: padded steps after a non-zero state move the state."""
    model = tiny_hybrid_model(name)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False, position_ids=torch.arange(12)[None]).logits
        cache = model(input_ids=ids[:, :8], position_ids=torch.arange(8)[None], use_cache=True).cache
        x = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[:, 8:]], 1)  # 2 pads, then 4 tokens
        mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 2), torch.ones(1, 4)], 1).long()
        out = model(input_ids=x, cache=cache, attention_mask=mask, use_cache=True,
                    position_ids=torch.tensor([[8, 8, 8, 9, 10, 11]])).logits
    assert (out[:, 2:] - full[:, 8:]).abs().max() > 1e-3
