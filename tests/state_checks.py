"""Checks shared by the model-state tests: radix results of a few prompts against plain transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_logits, random_ids

from hf_radix import RadixBatchRunner, SamplingParams

NEW = 4


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = random_ids(g, 24)
    return [prefix + random_ids(g, 3 + i) for i in range(3)]


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    logits = hf_logits(model, context + continuation)
    logprobs = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
    return float(logprobs.gather(1, torch.tensor(continuation)[:, None]).sum())


def assert_matches_hf(model, runner: RadixBatchRunner) -> None:
    """Runner tokens, radix generate tokens and log-likelihoods of the shared prompts equal plain HF's."""
    shared = prompts()
    expected = [hf_greedy(model, p, NEW) for p in shared]
    outs = runner.run(shared, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == expected
    for prompt, tokens in zip(shared, expected):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 cache_implementation="radix")
        assert out[0, len(prompt):].tolist() == tokens
    pairs = [(p[:-2], p[-2:]) for p in shared]
    scores = runner.loglikelihood(pairs)
    for (context, continuation), (logprob, _) in zip(pairs, scores):
        assert logprob == pytest.approx(hf_loglikelihood(model, context, continuation), abs=1e-4)
    runner.check_integrity()
