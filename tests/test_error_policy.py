"""One error policy: a bad request fails alone (run reports it, loglikelihood raises or returns it)."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_model, random_ids

from hf_radix import RadixBatchRunner, RequestError, SamplingParams


@pytest.fixture(scope="module")
def runner() -> RadixBatchRunner:
    return RadixBatchRunner(fresh_model("llama"), max_total_tokens=512, attn_backend="torch")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [random_ids(gen, 9), [], random_ids(gen, 6), [5, 10_000]]


def test_run_reports_bad_requests_in_their_outputs_or_raises_carrying_them(runner):
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    prompts = _prompts()
    good = runner.run([prompts[0], prompts[2]], params)
    outs = runner.run(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "error"]
    assert "empty prompt" in outs[1].error and "token ids" in outs[3].error
    assert [outs[0].token_ids, outs[2].token_ids] == [g.token_ids for g in good]
    with pytest.raises(RequestError, match="2 of 4 requests failed") as info:
        runner.run(prompts, params, errors="raise")
    assert sorted(info.value.errors) == [1, 3]
    assert [o.token_ids for o in info.value.results] == [o.token_ids for o in outs]
    runner.check_integrity()


def test_loglikelihood_raises_or_returns_failures_consistently(runner):
    prompts = _prompts()
    pairs = [(prompts[0], [7, 8]), ([], [3]), (prompts[2], [4]), ([5], [10_000])]
    good = runner.loglikelihood([pairs[0], pairs[2]])
    with pytest.raises(ValueError, match="2 of 4 scoring requests failed") as info:
        runner.loglikelihood(pairs)
    assert isinstance(info.value, RequestError) and sorted(info.value.errors) == [1, 3]
    assert "non-empty" in info.value.errors[1] and "token ids" in info.value.errors[3]
    returned = runner.loglikelihood(pairs, errors="return")
    assert returned == info.value.results
    assert returned[1] is None and returned[3] is None
    for got, want in zip([returned[0], returned[2]], good):
        assert got[0] == pytest.approx(want[0], abs=1e-5) and got[1] == want[1]
    runner.check_integrity()


def test_unknown_error_mode_is_refused(runner):
    with pytest.raises(ValueError, match="errors must be one of"):
        runner.run([[5, 6]], errors="ignore")
    with pytest.raises(ValueError, match="errors must be one of"):
        runner.loglikelihood([([5], [6])], errors="ignore")
