"""The cache follows the model's state: every radix call after a change equals plain transformers on the
changed model, through the runner, radix `generate` and scoring, and the change is counted and logged."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fresh_model
from state_checks import NEW, assert_matches_hf, prompts

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.errors import TrainingModeError
from hf_radix.model_state import BASE_NAMESPACE, ModelState


def _adamw_steps(model, fused: bool) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
    ids = torch.tensor([prompts(1)[0]])
    model.train()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _load_other(model) -> None:
    model.load_state_dict(fresh_model("llama", seed=7).state_dict())


def _edit_in_place(model) -> None:
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)


def _replace_parameter(model) -> None:
    proj = model.model.layers[1].self_attn.v_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach() * 0.5)


def _swap_storage(model) -> None:
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.data = weight.detach() + 0.25  # no version bump: the address changes


CHANGES = {
    "adamw": lambda m: _adamw_steps(m, fused=False),
    "adamw_fused": lambda m: _adamw_steps(m, fused=True),  # fused kernels bump no version counter
    "load_state_dict": _load_other,
    "no_grad_edit": _edit_in_place,
    "new_parameter": _replace_parameter,
    "data_assignment": _swap_storage,
}


PAGE_SIZES = {"adamw": 1, "adamw_fused": 4, "load_state_dict": 4, "no_grad_edit": 1, "new_parameter": 1,
              "data_assignment": 4}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_entry_point_follows_a_weight_change(change, caplog):
    page_size = PAGE_SIZES[change]
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, page_size=page_size)
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["tree_tokens"] > 0
    CHANGES[change](model)
    with caplog.at_level("INFO", logger="hf_radix"):
        assert_matches_hf(model, runner)
    stats = hf_radix.cache_stats(model)
    assert stats["invalidations"] == 1 and stats["invalidated_tokens"] > 0
    assert "computed under another model state" in caplog.text
    assert_matches_hf(model, runner)  # the new state's prefixes are reused again: no second drop
    assert hf_radix.cache_stats(model)["invalidations"] == 1


def test_training_loop_evaluating_between_steps():
    """AdamW steps between radix calls, as an evaluation inside a training loop makes them."""
    model = fresh_model("llama")
    runner = RadixBatchRunner(model)
    for step in range(3):
        assert_matches_hf(model, runner)
        _adamw_steps(model, fused=step % 2 == 1)
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["invalidations"] == 3


def test_unchanged_model_keeps_its_cache():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model)
    runner.run(prompts(), SamplingParams(max_new_tokens=NEW))
    copy.deepcopy(torch.nn.Linear(2, 2))  # modules built elsewhere in the process change nothing here
    _ = model.state_dict()
    outs = runner.run(prompts(), SamplingParams(max_new_tokens=NEW))
    assert all(o.cached_tokens > 0 for o in outs)
    assert hf_radix.cache_stats(model)["invalidations"] == 0


def test_dtype_move_builds_a_new_pool():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model)
    assert_matches_hf(model, runner)
    model.to(torch.float64)
    assert_matches_hf(model, runner)
    assert hf_radix.get_engine(model).pool.dtype == torch.float64
    assert hf_radix.cache_stats(model)["invalidations"] == 1


def test_config_change_builds_a_new_engine():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model)
    engine = runner.engine
    runner.run(prompts(), SamplingParams(max_new_tokens=NEW))
    model.config.rms_norm_eps = 1e-3  # read at build time by the norms: K/V unchanged, still a new state
    runner.run(prompts(), SamplingParams(max_new_tokens=NEW))
    assert runner.engine is not engine and engine.closed
    assert hf_radix.cache_stats(model)["invalidations"] == 1


def test_state_check_reports_what_changed():
    model = fresh_model("llama")
    state = ModelState(model)
    assert state.check().stale is None and state.check().namespace is BASE_NAMESPACE
    _edit_in_place(model)
    check = state.check()
    assert "model.layers.0.self_attn.k_proj.weight changed" in check.stale and not check.moved
    assert state.check().stale is None
    _swap_storage(model)
    check = state.check()
    assert check.stale and check.moved
    model.model.extra = torch.nn.Linear(2, 2)
    assert "added" in state.check().stale
    del model.model.extra
    _replace_parameter(model)
    assert "replaced or removed" in state.check().stale


def test_inference_mode_weights_are_tracked_without_versions():
    with torch.inference_mode():
        model = fresh_model("llama")
    state = ModelState(model)
    assert state.check().stale is None
    model.model.norm.weight = torch.nn.Parameter(torch.ones(64))
    assert state.check().stale is not None


def _dropout_model():
    config = fresh_model("llama").config
    config.attention_dropout = 0.1
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_training_mode_with_dropout_is_refused_by_the_runner():
    model = _dropout_model().train()
    runner = RadixBatchRunner(model)
    with pytest.raises(TrainingModeError, match=r"model.eval\(\)"):
        runner.run(prompts(), SamplingParams(max_new_tokens=NEW))
    model.eval()
    assert_matches_hf(model, runner)


def test_training_mode_generate_runs_plain_generate():
    model = _dropout_model().train()
    prompt = torch.tensor([prompts()[0]])
    results = []
    for cache in (None, "radix", "radix"):
        torch.manual_seed(3)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 cache_implementation=cache)
        results.append(out.tolist())
    assert results[0] == results[1] == results[2]
    assert hf_radix.cache_stats(model)["requests"] == 0  # nothing went through the prefix cache


def test_training_mode_without_dropout_uses_the_cache():
    model = fresh_model("llama").train()  # tiny Llama: attention_dropout 0, no dropout layers
    runner = RadixBatchRunner(model)
    assert_matches_hf(model, runner)
    assert hf_radix.cache_stats(model)["cached_tokens"] > 0
