"""The capability check refuses what hf_radix cannot run exactly, before any forward; the run-time guard
catches a layer that bypasses the attention interface."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_model, random_ids
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams, UnsupportedModelError
from hf_radix.engine import _ENGINE_ATTR


def test_error_is_exported_and_a_value_error():
    assert issubclass(hf_radix.UnsupportedModelError, ValueError)
    err = UnsupportedModelError("FooForCausalLM", "a reason")
    assert "FooForCausalLM" in str(err) and "a reason" in str(err)


class _BiasedAttention(LlamaAttention):
    """Passes an argument the radix attention does not implement."""

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                   position_bias=None, **kwargs)


def _refused(model, match: str) -> None:
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedModelError, match=match):
        hf_radix.configure(model, max_total_tokens=64, attn_backend="torch")
    assert not calls and getattr(model, _ENGINE_ATTR, None) is None  # no forward, no pool


def test_unhandled_attention_argument_is_refused_naming_it():
    model = fresh_model("llama")
    model.model.layers[1].self_attn.__class__ = _BiasedAttention
    _refused(model, "_BiasedAttention passes position_bias")


def test_non_causal_attention_is_refused():
    model = fresh_model("llama")
    model.model.layers[0].self_attn.is_causal = False
    _refused(model, "not causal")


def test_multimodal_config_is_refused():
    model = fresh_model("llama")
    model.config.vision_config = {"hidden_size": 8}
    _refused(model, "multimodal")


def test_multimodal_inputs_to_generate_are_refused():
    model = fresh_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(UnsupportedModelError, match="pixel_values"):
        model.generate(ids, pixel_values=torch.zeros(1, 3, 8, 8), cache_implementation="radix",
                       max_new_tokens=1)


def test_a_layer_bypassing_the_interface_at_run_time_is_caught():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, max_total_tokens=256, attn_backend="torch")
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, **kwargs: (torch.zeros_like(hidden_states), None)
    prompt = random_ids(torch.Generator().manual_seed(2), 8)
    with pytest.raises(UnsupportedModelError, match="ran 1 times"):
        runner.run([prompt], SamplingParams(max_new_tokens=2))
    with pytest.raises(UnsupportedModelError, match="ran 1 times"):
        model.generate(torch.tensor([prompt]), max_new_tokens=2, cache_implementation="radix", pad_token_id=0)
    runner.check_integrity()
    del attn.forward  # the model is whole again: radix works, and plain forwards never went through the guard
    assert runner.run([prompt], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
    with torch.inference_mode():
        model(torch.tensor([prompt]))


def test_training_mode_dropout_is_refused():
    model = fresh_model("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    runner = RadixBatchRunner(model, max_total_tokens=256, attn_backend="torch")
    model.train()
    with pytest.raises(ValueError, match="eval mode"):
        runner.run([[5, 6, 7]], SamplingParams(max_new_tokens=1))
    model.eval()
    runner.check_integrity()
