"""Log-likelihood scoring through the runner equals a plain transformers forward, cached or not."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_greedy, hf_logits, random_ids

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.integrations.evaluation import loglikelihood_rolling, rolling_windows, score_choices
from hf_radix.tiny import tiny_model

ATOL = 1e-4


@pytest.fixture
def make_runner() -> Iterator[Callable[..., RadixBatchRunner]]:
    """Builds runners and checks every one's integrity after the test."""
    runners: list[RadixBatchRunner] = []

    def make(model: torch.nn.Module, tokenizer=None, **options) -> RadixBatchRunner:
        runner = RadixBatchRunner(model, tokenizer, **{"max_total_tokens": 4096, **options})
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.check_integrity()
        assert runner.engine.manager.num_rows == 0


def hf_score(model: torch.nn.Module, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """(sum of continuation log-probs, greedy flag) from one plain forward of context + continuation."""
    logits = hf_logits(model, context + continuation)
    positions = torch.arange(len(context) - 1, len(context) + len(continuation) - 1)
    targets = torch.tensor(continuation)
    logprob = logits.log_softmax(-1)[positions, targets].sum().item()
    return logprob, bool((logits[positions].argmax(-1) == targets).all())


def assert_scores(got: list[tuple[float, bool]], want: list[tuple[float, bool]]) -> None:
    assert len(got) == len(want)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert abs(lp - ref_lp) <= ATOL, (lp, ref_lp)
        assert greedy == ref_greedy


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_scores_match_hf_cold_and_cached(arch: str, page_size: int, make_runner):
    model = fresh_model(arch)
    runner = make_runner(model, page_size=page_size)
    gen = torch.Generator().manual_seed(3)
    shared = random_ids(gen, 13)  # not a multiple of the page size: contexts end mid-page
    contexts = [shared + random_ids(gen, n) for n in (2, 5, 7)] + [random_ids(gen, 1), random_ids(gen, 18)]
    pairs = [(ctx, random_ids(gen, n)) for ctx in contexts for n in (1, 3, 6)]
    want = [hf_score(model, ctx, cont) for ctx, cont in pairs]

    assert_scores(runner.loglikelihood(pairs), want)
    cold = runner.stats.cached_tokens
    assert_scores(runner.loglikelihood(pairs), want)  # every context is now in the tree
    warm = runner.stats.cached_tokens - cold
    assert warm > cold
    assert warm >= sum(len(ctx) - 1 - (len(ctx) - 1) % page_size for ctx, _ in pairs)


def test_greedy_flags(tokenizer, make_runner):
    model = fresh_model("llama")
    runner = make_runner(model, tokenizer)
    context = tokenizer("Question: how many legs does a spider have? Answer:")["input_ids"]
    greedy = hf_greedy(model, context, 5)
    vocab = model.config.vocab_size
    not_greedy = greedy[:-1] + [(greedy[-1] + 1) % vocab]
    first_wrong = [(greedy[0] + 7) % vocab] + greedy[1:]
    pairs = [(context, greedy), (context, not_greedy), (context, first_wrong), (context, greedy[:1]),
             (context, [(greedy[0] + 1) % vocab])]
    got = runner.loglikelihood(pairs)
    assert [g for _, g in got] == [True, False, False, True, False]
    assert_scores(got, [hf_score(model, c, x) for c, x in pairs])


def test_string_pairs_tokenize_like_the_docs(tokenizer, make_runner):
    model = fresh_model("llama")
    runner = make_runner(model, tokenizer)
    pairs = [("The quick brown fox", " jumps over"), ("Answer briefly:", " Paris.")]
    ids = [(tokenizer(c)["input_ids"], tokenizer(x, add_special_tokens=False)["input_ids"]) for c, x in pairs]
    assert_scores(runner.loglikelihood(pairs), [hf_score(model, c, x) for c, x in ids])


def test_shared_context_is_computed_once(make_runner):
    model = fresh_model("llama")
    runner = make_runner(model, page_size=4)
    gen = torch.Generator().manual_seed(5)
    preamble = random_ids(gen, 201)  # a few-shot prefix shared by every question
    questions = [preamble + random_ids(gen, 37) for _ in range(12)]
    choices = [[random_ids(gen, n) for n in (2, 3, 4, 5)] for _ in questions]
    before = runner.engine.stats.computed_tokens
    scores = score_choices(runner, questions, choices)
    computed = runner.engine.stats.computed_tokens - before
    total = sum(len(q) + len(c) for q, cs in zip(questions, choices) for c in cs)
    assert computed < 0.15 * total  # each context computed once, not once per choice
    # per question: its own tokens once, plus each choice and the context's unaligned last page
    assert computed <= len(preamble) + 12 * (37 + 4 * 4 + 2 + 3 + 4 + 5)
    for q, cs, row in zip(questions[:3], choices, scores):
        assert all(abs(s - hf_score(model, q, c)[0]) <= ATOL for c, s in zip(cs, row))


def test_chunked_prefill_smaller_than_contexts(make_runner):
    model = fresh_model("qwen3")
    runner = make_runner(model, page_size=4, chunked_prefill_size=8)
    gen = torch.Generator().manual_seed(7)
    shared = random_ids(gen, 21)
    pairs = [(shared + random_ids(gen, n), random_ids(gen, m)) for n, m in ((3, 1), (9, 12), (30, 5))]
    pairs.append((random_ids(gen, 17), random_ids(gen, 10)))  # continuation spans chunks too
    assert_scores(runner.loglikelihood(pairs), [hf_score(model, c, x) for c, x in pairs])


def test_full_context_window(make_runner):
    """context + continuation = max_context + 1 tokens: the model sees max_context, as in lm-eval."""
    model = tiny_model("llama", max_position_embeddings=24)
    runner = make_runner(model, page_size=4)
    gen = torch.Generator().manual_seed(9)
    ids = random_ids(gen, 25)
    got = runner.loglikelihood([(ids[:20], ids[20:]), (ids[:1], ids[1:])])
    logp = hf_logits(model, ids[:24]).log_softmax(-1)
    want = [logp[torch.arange(19, 24), torch.tensor(ids[20:])].sum().item(),
            logp[torch.arange(0, 24), torch.tensor(ids[1:])].sum().item()]
    assert [lp for lp, _ in got] == pytest.approx(want, abs=ATOL)
    with pytest.raises(ValueError, match="context"):
        runner.loglikelihood([(ids + [5], [6])])


def _hf_rolling(model: torch.nn.Module, tokens: list[int], prefix: int, max_length: int) -> float:
    """Reference: token i of a window is predicted from up to `max_length` preceding input tokens."""
    total, start = 0.0, 0
    while start < len(tokens):
        end = min(start + max_length, len(tokens))
        inputs = ([prefix] + tokens)[max(end - max_length, 0):end]  # the window's model input
        logp = hf_logits(model, inputs).log_softmax(-1)
        positions = torch.arange(len(inputs) - (end - start), len(inputs))
        total += logp[positions, torch.tensor(tokens[start:end])].sum().item()
        start = end
    return total


def test_loglikelihood_rolling_matches_hf(tokenizer, make_runner):
    model = tiny_model("llama", max_position_embeddings=16)
    runner = make_runner(model, tokenizer, page_size=4)
    gen = torch.Generator().manual_seed(11)
    texts = [random_ids(gen, n) for n in (1, 5, 16, 17, 40, 64)] + [[]]
    eos = tokenizer.eos_token_id
    got = runner.loglikelihood_rolling(texts)
    want = [_hf_rolling(model, t, eos, 16) for t in texts]
    assert got == pytest.approx(want, abs=ATOL)
    assert got[-1] == 0.0
    # each token scored once: windows cover the text exactly, each within the context
    for t in texts:
        windows = rolling_windows(t, eos, 16)
        assert [x for _, cont in windows for x in cont] == t
        assert all(len(ctx) + len(cont) <= 17 for ctx, cont in windows)
    # strings are tokenized without special tokens, the first token conditioned on BOS/EOS
    text = "The radix tree records mappings; the KV pool stores data. " * 3
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want = [0.0, _hf_rolling(model, ids, eos, 16)]
    assert runner.loglikelihood_rolling(["", text]) == pytest.approx(want, abs=ATOL)
    # a smaller window than the context, explicit prefix
    short = loglikelihood_rolling(runner, texts[:5], prefix_token_id=7, max_length=6)
    assert short == pytest.approx([_hf_rolling(model, t, 7, 6) for t in texts[:5]], abs=ATOL)


def test_empty_context_or_continuation_errors(tokenizer, make_runner):
    runner = make_runner(fresh_model("llama"), tokenizer)
    with pytest.raises(ValueError, match="context and continuation must both be non-empty"):
        runner.loglikelihood([("A question", " an answer"), ("", " orphan")])
    with pytest.raises(ValueError, match="context and continuation must both be non-empty"):
        runner.loglikelihood([([5, 6, 7], [])])
    with pytest.raises(ValueError, match="contexts"):
        score_choices(runner, ["a", "b"], [[" x"]])
    assert runner.loglikelihood([]) == []


def _generator(items: list) -> Iterator:
    yield from items


def test_any_iterable_input(tokenizer, make_runner):
    model = fresh_model("llama")
    runner = make_runner(model, tokenizer)
    prompts = ["You are a helpful assistant. Question: 1 2 3?", "You are a helpful assistant. Question: ten?"]
    params = SamplingParams(max_new_tokens=4)
    want = [o.token_ids for o in runner.run(prompts, params)]
    assert [o.token_ids for o in runner.run(_generator(prompts), params)] == want
    pairs = [(p, " Answer: eight.") for p in prompts]
    assert_scores(runner.loglikelihood(_generator(pairs)), runner.loglikelihood(pairs))
    assert runner.loglikelihood_rolling(_generator(prompts)) == pytest.approx(
        runner.loglikelihood_rolling(prompts), abs=ATOL)


def test_datasets_columns(tokenizer, make_runner):
    datasets = pytest.importorskip("datasets")
    model = fresh_model("llama")
    runner = make_runner(model, tokenizer)
    rows = {
        "question": ["Question: what is the capital of France? Answer:", "Question: 0 1 2 3? Answer:"],
        "choices": [[" Paris", " eight"], [" 4", " five", " ten"]],
    }
    ds = datasets.Dataset.from_dict(rows)
    params = SamplingParams(max_new_tokens=3)
    assert [o.token_ids for o in runner.run(ds["question"], params)] == [
        o.token_ids for o in runner.run(rows["question"], params)]
    got = score_choices(runner, ds["question"], ds["choices"])
    want = score_choices(runner, rows["question"], rows["choices"])
    assert [len(r) for r in got] == [2, 3]
    assert [x for r in got for x in r] == pytest.approx([x for r in want for x in r], abs=ATOL)
    assert runner.loglikelihood_rolling(ds["question"]) == pytest.approx(
        runner.loglikelihood_rolling(rows["question"]), abs=ATOL)


def test_repeated_contexts_convert_once_and_score_like_fresh_copies(tokenizer, make_runner):
    model = fresh_model("llama")
    runner = make_runner(model, tokenizer)
    gen = torch.Generator().manual_seed(9)
    context = random_ids(gen, 70)
    choices = [random_ids(gen, n) for n in (1, 2, 3)]
    kinds = [context, np.array(context, dtype=np.int32), torch.tensor(context)]
    pairs = [(c, x) for c in kinds for x in choices]  # each context object shared by its three choices
    want = [hf_score(model, context, x) for x in choices] * len(kinds)
    assert_scores(runner.loglikelihood(pairs), want)
    assert_scores(runner.loglikelihood([(list(context), list(x)) for _, x in pairs]), want)

    calls = []

    def counting(texts, **options):
        calls.append(list(texts))
        return tokenizer(texts, **options)

    runner.tokenizer = counting
    text_pairs = [("The quick brown fox", " jumps"), ("The quick brown fox", " sleeps"), ("Hi", " jumps")]
    got = runner.loglikelihood(text_pairs)
    assert calls == [["The quick brown fox", "Hi"], [" jumps", " sleeps"]]  # each distinct text once
    ids = [
        (tokenizer(c)["input_ids"], tokenizer(x, add_special_tokens=False)["input_ids"])
        for c, x in text_pairs
    ]
    assert_scores(got, [hf_score(model, c, x) for c, x in ids])
