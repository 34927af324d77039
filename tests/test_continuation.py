"""The `past_key_values` a radix `generate` returns: continuation works through the prefix cache, and
anything else fails with the clear message before the model runs."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_model, random_ids

import hf_radix
from hf_radix.errors import OWN_CACHE_MESSAGE

GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("radix_again", [False, True])
def test_returned_past_key_values_continue_through_the_prefix_cache(radix_again: bool):
    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=512, attn_backend="torch")
    ids = torch.tensor([random_ids(torch.Generator().manual_seed(5), 20)])
    out = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True, cache_implementation="radix",
                         **GEN)
    engine = hf_radix.get_engine(model)
    cached_before = engine.stats.cached_tokens
    extra = {"cache_implementation": "radix"} if radix_again else {}
    got = model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=3, **extra, **GEN)
    want = model.generate(out.sequences, max_new_tokens=3, **GEN)
    assert torch.equal(got, want)
    assert engine.stats.cached_tokens - cached_before >= ids.shape[1]  # the conversation came from the tree
    engine.check_integrity()


def test_returned_past_key_values_in_a_plain_forward_fails_before_any_layer():
    model = fresh_model("llama")
    ids = torch.tensor([random_ids(torch.Generator().manual_seed(6), 10)])
    out = model.generate(ids, max_new_tokens=2, return_dict_in_generate=True, cache_implementation="radix",
                         **GEN)
    calls = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="keeps its own cache"):
        # the model's own name for the cache (`cache` in newer transformers: past_key_values warns there)
        model(out.sequences, **{hf_radix.get_engine(model).cache_kwarg: out.past_key_values})
    handle.remove()
    assert not calls
    assert OWN_CACHE_MESSAGE.startswith("cache_implementation='radix' keeps its own cache")
