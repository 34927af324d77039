"""One options type: every `EngineOptions` field is taken by `configure`, `RadixBatchRunner` and the lm-eval
model_args (strings converted to its type); other names are refused with the list; docs/options.md is its
table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import fresh_model

import hf_radix
from hf_radix import EngineOptions, RadixBatchRunner, SamplingParams
from hf_radix.kernels import triton_runs_on
from hf_radix.options import options_table
from hf_radix.tiny import tiny_tokenizer

# a value other than the default for each field, valid on the CPU (a new field must be added here)
NON_DEFAULT = {
    "page_size": 4,
    "max_total_tokens": 128,
    "mem_fraction": 0.5,
    "attn_backend": "torch",
    "store_backend": "torch",
    "cuda_graph": False,
    "cuda_graph_max_batch": 8,
    "fused_ops": False,
    "warm_up": False,
    "shared_prefix": False,
    "shared_prefix_mode": "fold",
    "host_cache_tokens": 64,
    "host_cache_gb": 0.001,
    "state_slots": 32,
    "state_snapshot_interval": 512,
    "deterministic": True,
}
FIELDS = [f.name for f in dataclasses.fields(EngineOptions)]
RUNNER_ONLY = ("cuda_graph", "warm_up")  # taken by the runner for itself (as before), not set on the engine
# valid where Triton runs (CUDA, or the interpreter): on a plain CPU the engine refuses it, naming Triton
NEEDS_TRITON = ("deterministic",)


def _refused_here(name: str) -> bool:
    return name in NEEDS_TRITON and not triton_runs_on(torch.empty(0))


def _options(name: str) -> dict:
    return {"max_total_tokens": 256, name: NON_DEFAULT[name]}


def test_every_field_has_a_non_default_test_value_and_a_doc():
    assert set(NON_DEFAULT) == set(FIELDS)
    for field in dataclasses.fields(EngineOptions):
        assert NON_DEFAULT[field.name] != field.default
        assert field.metadata["doc"] and "\n" not in field.metadata["doc"]


@pytest.mark.parametrize("name", FIELDS)
def test_configure_takes_every_engine_option(name):
    if _refused_here(name):
        with pytest.raises(ValueError, match="Triton"):
            hf_radix.configure(fresh_model("llama"), **_options(name))
        return
    engine = hf_radix.configure(fresh_model("llama"), **_options(name))
    assert getattr(engine.options, name) == NON_DEFAULT[name]


@pytest.mark.parametrize("name", FIELDS)
def test_runner_takes_every_engine_option(name):
    if _refused_here(name):
        with pytest.raises(ValueError, match="Triton"):
            RadixBatchRunner(fresh_model("llama"), **_options(name))
        return
    runner = RadixBatchRunner(fresh_model("llama"), **_options(name))
    if name in RUNNER_ONLY:
        assert getattr(runner, f"_{name}") is NON_DEFAULT[name]
        assert getattr(runner.engine.options, name) is True  # the engine's stays as configured
    else:
        assert getattr(runner.engine.options, name) == NON_DEFAULT[name]
    [out] = runner.run([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2))
    assert len(out.token_ids) == 2


def test_runner_options_left_out_or_none_keep_the_engine_as_configured():
    model = fresh_model("llama")
    engine = hf_radix.configure(model, page_size=4, max_total_tokens=256, shared_prefix_mode="fold")
    for options in ({}, {"page_size": None, "shared_prefix_mode": None, "fused_ops": None}):
        runner = RadixBatchRunner(model, **options)
        assert runner.engine is engine and engine.options.page_size == 4
        assert engine.options.shared_prefix_mode == "fold"


def test_unknown_option_names_are_refused_with_the_valid_ones():
    model = fresh_model("llama")
    refused = r"configure: unknown option\(s\) \['pag_size'\].*page_size.*host_cache_gb"
    with pytest.raises(TypeError, match=refused):
        hf_radix.configure(model, pag_size=4)
    with pytest.raises(TypeError, match=r"RadixBatchRunner: unknown option\(s\) \['pag_size'\]") as error:
        RadixBatchRunner(model, pag_size=4)
    assert "shared_prefix_mode" in str(error.value) and "max_running_requests" in str(error.value)
    assert not hasattr(model, "_hf_radix_engine")  # refused before anything was allocated


def test_runner_keywords_stay_keywords():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, None, max_running_requests=4, chunked_prefill_size=64,
                              schedule_policy="fcfs", overlap=False, profile=True, max_total_tokens=256)
    assert runner.scheduler is not None and runner.engine.options.max_total_tokens == 256


@pytest.mark.parametrize(
    "name, text, value",
    [("page_size", "16", 16), ("page_size", " 2 ", 2), ("max_total_tokens", "none", None),
     ("max_total_tokens", "4096", 4096), ("mem_fraction", "0.5", 0.5), ("mem_fraction", "1", 1.0),
     ("cuda_graph", "false", False), ("cuda_graph", "True", True), ("fused_ops", "0", False),
     ("attn_backend", "torch", "torch"), ("host_cache_gb", "None", None), ("host_cache_gb", "2", 2.0),
     ("shared_prefix", False, False), ("page_size", 8, 8)],
)
def test_strings_convert_to_the_field_type(name, text, value):
    converted = EngineOptions.convert(name, text)
    assert converted == value and type(converted) is type(value)


@pytest.mark.parametrize("name, text", [("page_size", "sixteen"), ("cuda_graph", "maybe"),
                                        ("mem_fraction", "half"), ("page_size", "none")])
def test_strings_that_do_not_convert_are_refused(name, text):
    with pytest.raises(ValueError, match=f"engine option {name}="):
        EngineOptions.convert(name, text)


def test_lm_eval_engine_options_come_out_of_the_model_args_converted():
    model_args = pytest.importorskip("hf_radix.lm_eval_backend.model_args", exc_type=ImportError)
    kwargs = {"page_size": "16", "cuda_graph": "false", "max_total_tokens": "none", "max_length": 8}
    assert model_args.engine_options(kwargs) == {"page_size": 16, "cuda_graph": False}
    assert kwargs == {"max_length": 8}  # the rest is left for the other checks


@pytest.mark.parametrize("name", FIELDS)
def test_lm_eval_takes_every_engine_option_as_a_string(name):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
    from hf_radix.lm_eval_backend import HFRadixLM

    options = {key: str(value) for key, value in _options(name).items()}  # as on the command line
    if _refused_here(name):
        with pytest.raises(ValueError, match="Triton"):
            HFRadixLM(pretrained=fresh_model("llama"), tokenizer=tiny_tokenizer(), max_length=64, **options)
        return
    lm = HFRadixLM(pretrained=fresh_model("llama"), tokenizer=tiny_tokenizer(), max_length=64, **options)
    if name in RUNNER_ONLY:
        assert getattr(lm.runner, f"_{name}") is NON_DEFAULT[name]
    else:
        assert getattr(lm.runner.engine.options, name) == NON_DEFAULT[name]


def test_lm_eval_refuses_unknown_names_listing_engine_options():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
    from hf_radix.lm_eval_backend import HFRadixLM

    refused = r"unknown model_args \['pag_size'\]; supported: .*shared_prefix_mode"
    with pytest.raises(TypeError, match=refused):
        HFRadixLM(pretrained=fresh_model("llama"), tokenizer=tiny_tokenizer(), pag_size=4)


def test_docs_options_table_is_the_generated_one():
    docs = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    assert options_table() in docs, "regenerate docs/options.md's table: hf_radix.options.options_table()"
