"""Radix calls work whatever the caller's grad mode, in any order (the pool may be made in any of them)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams

MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
}


def _calls(model, prompts: list[list[int]], want: list[list[int]]):
    """The three radix entry points, each checking its result against plain transformers."""
    runner = RadixBatchRunner(model, attn_backend="torch")

    def run() -> None:
        outs = runner.run(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert [o.token_ids for o in outs] == want

    def generate() -> None:
        for prompt, tokens in zip(prompts, want):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, cache_implementation="radix")
            assert out[0, len(prompt):].tolist() == tokens

    def score() -> None:
        (logprob, _), = runner.loglikelihood([(prompts[0], want[0])])
        assert logprob < 0.0

    return {"run": run, "generate": generate, "score": score}


@pytest.mark.parametrize("first", ["inference_mode", "grad"])
def test_radix_calls_in_any_grad_mode_order(first: str):
    model = fresh_model("llama")
    gen = torch.Generator().manual_seed(3)
    shared = random_ids(gen, 12)
    prompts = [shared + random_ids(gen, 5), shared + random_ids(gen, 3)]
    want = [hf_greedy(model, p, 3) for p in prompts]
    calls = _calls(model, prompts, want)
    with MODES[first]():  # the pool is made here
        calls["run"]()
    others = [m for m in MODES if m != first]
    for mode in (*others, first, others[0]):  # every mode after every other
        for call in calls.values():
            with MODES[mode]():
                call()
    engine = hf_radix.get_engine(model)
    assert not torch.is_inference(engine.pool.buffer) and not engine.pool.buffer.requires_grad
    engine.check_integrity()
