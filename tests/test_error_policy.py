"""One error policy: a bad request fails alone (run reports it, loglikelihood raises or returns it)."""

from __future__ import annotations

import numpy as np
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


def _calls(runner) -> tuple[int, int]:
    stats = runner.engine.stats
    return stats.forward_calls, stats.prompt_tokens


def test_one_prompt_not_wrapped_in_a_list_is_refused_before_anything_runs(runner, tokenizer):
    """A bare string would run one prompt per character, a flat token list one prompt per id: both raise a
    TypeError naming the fix; one (context, continuation) pair and one rolling text likewise."""
    runner.tokenizer = tokenizer
    try:
        before = _calls(runner)
        cases = [
            (lambda: runner.run("What comes after 3?"),
             r"run\(\) takes a list of prompts, got a single string .*wrap it in a list: run\(\[prompt\]\)"),
            (lambda: runner.run([5, 6, 7]),
             r"flat sequence of numbers .*wrap it in a list: run\(\[token_ids\]\)"),
            (lambda: runner.run(torch.tensor([5, 6, 7])), r"wrap it in a list: run\(\[token_ids\]\)"),
            (lambda: runner.run([5.7, 6.2]), "flat sequence of numbers"),
            (lambda: runner.loglikelihood(("The capital of France is", " Paris")),
             r"item 0 is str 'The capital of France is', not a pair; .*wrap it in a list"),
            (lambda: runner.loglikelihood(([5, 6], [7, 8])), "got pairs of numbers"),
            (lambda: runner.loglikelihood("ab"), "got a string"),
            (lambda: runner.loglikelihood([([5], [6], [7])]), "item 0 is tuple"),
            (lambda: runner.loglikelihood_rolling("What comes after 3?"),
             r"wrap it in a list: loglikelihood_rolling\(\[text\]\)"),
            (lambda: runner.loglikelihood_rolling([5, 6, 7]), "flat sequence of numbers"),
        ]
        for call, message in cases:
            with pytest.raises(TypeError, match=message):
                call()
        assert _calls(runner) == before  # nothing ran
    finally:
        runner.tokenizer = None
    runner.check_integrity()


def test_ids_that_are_not_integer_token_ids_fail_alone(runner):
    """Floats (even integral ones), bools, nested lists, negative ids and ids past the vocabulary: that
    request fails with a message naming the problem; the others complete as they would alone."""
    gen = torch.Generator().manual_seed(4)
    a, b = random_ids(gen, 9), random_ids(gen, 5)
    vocab = runner.engine.vocab_size
    bad = {
        1: ([5.7, 6.2, 7.9], "token ids must be integers, got float 5.7 at position 0"),
        2: ([5, 6.0], "token ids must be integers, got float 6.0 at position 1"),
        3: (torch.tensor([5.0, 6.0]), "token ids must be integers, got float 5.0 at position 0"),
        5: ([True, False], "token ids must be integers, got bool True at position 0"),
        6: ([[5, 6]], "token ids must be integers, got list [5, 6] at position 0"),
        7: ([5, -1], f"token ids must lie in [0, {vocab}), got -1..5"),
        8: ([5, vocab], f"token ids must lie in [0, {vocab}), got 5..{vocab}"),
        9: (7, "token ids must form a sequence of integers, got int 7"),
    }
    good = {0: a, 4: b, 10: np.array(a, dtype=np.int32), 11: torch.tensor(b)}
    prompts = [good[i] if i in good else bad[i][0] for i in range(12)]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    alone = [o.token_ids for o in runner.run([a, b], params)]
    outs = runner.run(prompts, params)
    assert {i: o.error for i, o in enumerate(outs) if o.finish_reason == "error"} == {
        i: message for i, (_, message) in bad.items()
    }
    assert [outs[i].token_ids for i in good] == alone * 2
    assert all(outs[i].finish_reason == "length" for i in good)
    with pytest.raises(RequestError, match="8 of 12 requests failed; first \\(index 1\\): token ids must be"):
        runner.run(prompts, params, errors="raise")
    runner.check_integrity()


def test_scoring_inputs_that_are_not_integer_token_ids_fail_alone(runner):
    gen = torch.Generator().manual_seed(5)
    ctx, cont = random_ids(gen, 8), random_ids(gen, 3)
    pairs = [(ctx, cont), (ctx, [7.0]), ([True, False], cont), (ctx, [3, 2]), (np.array([2.5]), [4])]
    alone = runner.loglikelihood([pairs[0], pairs[3]])
    with pytest.raises(RequestError, match="3 of 5 scoring requests failed") as info:
        runner.loglikelihood(pairs)
    assert info.value.errors == {
        1: "continuation: token ids must be integers, got float 7.0 at position 0",
        2: "context: token ids must be integers, got bool True at position 0",
        4: "context: token ids must be integers, got float 2.5 at position 0",
    }
    returned = runner.loglikelihood(pairs, errors="return")
    assert returned == info.value.results and [returned[i] for i in (1, 2, 4)] == [None] * 3
    for got, want in zip([returned[0], returned[3]], alone):
        assert got[0] == pytest.approx(want[0], abs=1e-5) and got[1] == want[1]

    texts = [ctx + cont, [5.0, 6], [9, 10_000], cont]
    totals = runner.loglikelihood_rolling([texts[0], texts[3]])
    with pytest.raises(RequestError, match="2 of 4 texts failed; first \\(index 1\\)") as info:
        runner.loglikelihood_rolling(texts)
    assert info.value.errors[1] == "token ids must be integers, got float 5.0 at position 0"
    assert info.value.errors[2].startswith(f"token ids must lie in [0, {runner.engine.vocab_size})")
    results = info.value.results
    assert results[1] is None and results[2] is None
    assert [results[0], results[3]] == pytest.approx(totals, abs=1e-5)
    runner.check_integrity()
