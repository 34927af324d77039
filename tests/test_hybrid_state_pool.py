"""StatePool: slot bookkeeping, copies, host round trip, and the state shapes of each hybrid family."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.hybrid_layers import (
    NO_PREFIX_REUSE,
    REFUSED_FAMILIES,
    StateKindSpec,
    StateLayerSpec,
    cache_state_api,
    probe_state_specs,
    refusal_reason,
    state_specs,
    tiny_hybrid_model,
)
from hf_radix.memory.state_pool import StateBatch, StatePool, StatePoolError

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]

warnings.filterwarnings("ignore")

SPECS = [
    StateLayerSpec(0, (StateKindSpec("conv", (6, 4), torch.float32),
                       StateKindSpec("recurrent", (2, 3, 5), torch.float32))),
    StateLayerSpec(2, (StateKindSpec("conv", (6, 3), torch.bfloat16),)),
]


def test_bytes_per_slot_counts_every_state():
    pool = StatePool(SPECS, num_slots=5)
    assert pool.bytes_per_slot == 6 * 4 * 4 + 128 + 48  # 120 and 36 bytes, each padded to 16
    assert pool.nbytes == 6 * pool.bytes_per_slot  # and the scratch slot
    assert pool.layer_ids == [0, 2]
    assert pool.tensors[(2, "conv")].dtype == torch.bfloat16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=40))
def test_alloc_free_match_a_model(ops):
    pool = StatePool(SPECS, num_slots=7)
    held: list[int] = []
    for do_alloc, n in ops:
        if do_alloc:
            if n > pool.num_free:
                with pytest.raises(StatePoolError):
                    pool.alloc(n)
                continue
            got = pool.alloc(n)
            assert len(set(got)) == n and not set(got) & set(held)
            assert all(0 <= s < 7 for s in got)
            held += got
        elif held:
            give, held = held[:n], held[n:]
            pool.free(give)
            with pytest.raises(StatePoolError):
                pool.free(give[:1])  # double free
        assert pool.num_used == len(held) and pool.num_free == 7 - len(held)
        pool.check_integrity()


def test_alloc_zeroes_and_copy_slots_copies_every_layer():
    pool = StatePool(SPECS, num_slots=4)
    a, b = pool.alloc(2)
    for t in pool.tensors.values():
        t[a].normal_()
    pool.copy_slot(a, b)
    for t in pool.tensors.values():
        assert torch.equal(t[a], t[b])
    pool.free([b])
    (c,) = pool.alloc(1)
    assert all(not t[c].any() for t in pool.tensors.values())
    (d,) = pool.alloc(1, zero=False)
    assert d not in (a, c)


def test_state_dict_round_trip_and_layout_check():
    pool = StatePool(SPECS, num_slots=3)
    a, b = pool.alloc(2)
    for t in pool.tensors.values():
        t[a].uniform_()
    saved = pool.state_dict([a])
    pool.load_state_dict([b], saved)
    for t in pool.tensors.values():
        assert torch.equal(t[a], t[b])
    with pytest.raises(ValueError):
        pool.load_state_dict([b], {k: v for k, v in saved.items() if k != "0.conv"})
    with pytest.raises(ValueError):
        pool.load_state_dict([b], {k: v.double() for k, v in saved.items()})


def test_state_batch_conv_window_semantics():
    spec = [StateLayerSpec(0, (StateKindSpec("conv", (2, 4), torch.float32),))]
    pool = StatePool(spec, num_slots=2)
    slots = pool.alloc(2)
    x = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    fresh = StateBatch(pool, slots, has_previous=False)
    assert fresh.get_conv_state(0) is None
    full = fresh.update_conv_state(x, 0, conv_kernel_size=4)  # shorter than the kernel: zero padded
    assert full.shape == (2, 2, 4) and not full[..., 0].any()
    fresh.flush()
    cont = StateBatch(pool, slots, has_previous=True)
    y = torch.ones(2, 2, 2)
    full = cont.update_conv_state(y, 0)
    assert torch.equal(full[..., :4], torch.cat([torch.zeros(2, 2, 1), x], -1))  # the saved window in front
    cont.flush()
    assert torch.equal(pool.tensors[(0, "conv")][torch.tensor(slots)], torch.cat([x[..., 1:], y], -1))
    with pytest.raises(ValueError):
        cont.update_conv_state(y, 0, conv_kernel_size=3)


SUPPORTED = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "granitemoehybrid", "falcon_h1", "bamba",
             "jamba", "lfm2", "lfm2_moe", "mamba", "mamba2", "falcon_mamba"]


@pytest.mark.parametrize("name", SUPPORTED)
def test_state_specs_match_what_transformers_caches(name):
    model = tiny_hybrid_model(name)
    assert state_specs(model) == probe_state_specs(model)
    assert state_specs(model.to(torch.bfloat16)) == probe_state_specs(model)


@pytest.mark.parametrize("name", sorted(REFUSED_FAMILIES))
def test_refused_families_say_why(name):
    with pytest.raises(ValueError, match="not the Cache|not in the Cache"):
        state_specs(tiny_hybrid_model(name))


def test_refusal_reasons():
    assert refusal_reason("qwen3_5_text") is None and refusal_reason("bamba") is None
    for name in (*REFUSED_FAMILIES, *NO_PREFIX_REUSE):
        assert refusal_reason(name)
    assert "initial" in refusal_reason("jamba") or "cannot start" in refusal_reason("jamba")
