"""The capability check refuses what hf_radix cannot run exactly, before any forward; the run-time guard
catches a layer that bypasses the attention interface."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import fresh_model, random_ids
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams, UnsupportedModelError
from hf_radix.capability import check_model
from hf_radix.engine import ENGINE_ATTR


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
    assert not calls and getattr(model, ENGINE_ATTR, None) is None  # no forward, no pool


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
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        runner.run([[5, 6, 7]], SamplingParams(max_new_tokens=1))
    model.eval()
    runner.check_integrity()


def _tiny(config_class: str, **kwargs) -> torch.nn.Module:
    ids = dict(vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config = getattr(transformers, config_class)(**ids, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_attention_outside_the_interface_is_named_as_such_not_recurrent_or_multimodal():
    """GPT-Neo (attention modules without layer_idx) and MPT (an attn_config sub-config) are plain attention
    models whose attention bypasses the interface; the refusal says exactly that."""
    gpt_neo = _tiny("GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=4,
                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64)
    mpt = _tiny("MptConfig", d_model=32, n_heads=4, n_layers=2, max_seq_len=64)
    interface = "computes attention itself, not through transformers' attention interface"
    for model, cls in ((gpt_neo, "GPTNeoSelfAttention"), (mpt, "MptAttention")):
        with pytest.raises(UnsupportedModelError) as info:
            check_model(model)
        assert info.value.reason == f"{cls} {interface}"
        _refused(model, cls)


def test_alibi_position_bias_is_refused():
    """ALiBi Falcon: from 5.25 its attention calls the interface, with the bias added to the mask."""
    falcon = _tiny("FalconConfig", hidden_size=32, num_attention_heads=4, num_hidden_layers=2, alibi=True)
    _refused(falcon, "ALiBi position bias")


def test_decoder_sub_configs_and_attention_wrappers_are_not_refused():
    """DBRX: attn_config / ffn_config describe its decoder, and DbrxNormAttentionNorm wraps an attention
    module that calls the interface (exactness: the architecture matrix)."""
    dbrx = _tiny("DbrxConfig", d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1})
    assert check_model(dbrx).attention_layers == 2


def test_sub_configs_are_refused_as_multimodal_only_when_they_name_a_modality(monkeypatch):
    model = fresh_model("llama")
    config_class = type(model.config)
    monkeypatch.setattr(config_class, "sub_configs", {"vq_config": transformers.PretrainedConfig})
    _refused(model, r"multimodal \(vq_config\)")
    monkeypatch.setattr(config_class, "sub_configs", {"patcher_config": transformers.PretrainedConfig})
    _refused(model, r"made of several models \(patcher_config\)")


def test_hybrid_model_is_refused_where_state_layers_bypass_the_cache_api(monkeypatch):
    """On a transformers whose state layers reach into their cache's layers (5.17), the state pool would
    never see them: refused before any forward."""
    from hf_radix import capability
    from hf_radix.hybrid_layers import FAMILIES, tiny_configs, tiny_hybrid_model

    name = next((n for n in ("qwen3_5", "nemotron_h", "lfm2") if n in FAMILIES and n in tiny_configs()), None)
    if name is None or not hasattr(transformers, tiny_configs()[name][1]):
        pytest.skip("no hybrid family in this transformers")
    monkeypatch.setattr(capability, "cache_state_api", lambda: False)
    _refused(tiny_hybrid_model(name), "bypass the Cache methods")



def test_hybrid_state_code_replaced_by_hub_kernels_is_refused(monkeypatch):
    """`kernelize` (transformers >= 5.25 with `kernels`) gives a kernel function an instance-level forward:
    one that takes the cache, or a whole state mixer replaced, may keep the states itself and is refused; a
    kernel that only computes (a convolution) is not."""
    from hf_radix import capability
    from hf_radix.hybrid_layers import state_mixers, tiny_hybrid_model

    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("no Qwen3.5 in this transformers")

    class ConvForward(torch.nn.Module):  # what kernels makes of a function: forward(self, *its parameters)
        kernel_layer_name = "causal_conv1d_forward"

        def forward(self, conv1d, hidden_states, cache, layer_idx, activation=None):
            return hidden_states

    class ConvFn(torch.nn.Module):
        kernel_layer_name = "causal_conv1d_fn"

        def forward(self, hidden_states, weight, bias=None, activation=None):
            return hidden_states

    monkeypatch.setattr(capability, "cache_state_api", lambda: True)  # 5.17: else refused for that first
    model = tiny_hybrid_model("qwen3_5")
    mixer = next(iter(state_mixers(model).values()))
    funcs = {"causal_conv1d_fn": ConvFn(), "causal_conv1d_forward": ConvForward()}
    monkeypatch.setattr(mixer, "_kernel_funcs", funcs, raising=False)
    funcs["causal_conv1d_fn"].forward = lambda *args, **kwargs: args[0]
    check_model(model)
    funcs["causal_conv1d_forward"].forward = lambda *args, **kwargs: args[1]
    _refused(model, r"hub kernels \(causal_conv1d_forward: kernelize")
    del funcs["causal_conv1d_forward"]
    monkeypatch.setattr(type(mixer), "kernel_layer_name", type(mixer).__name__, raising=False)
    mixer.forward = lambda *args, **kwargs: args[0]
    _refused(model, rf"hub kernels \({type(mixer).__name__}: kernelize")
