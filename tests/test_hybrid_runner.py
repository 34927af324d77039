"""Hybrid models end to end (issue 29): `RadixBatchRunner.run` greedy tokens and `loglikelihood` equal plain
transformers on tiny fp32 models, with prefix-cache hits across calls (state snapshots on the tree), page
sizes 1, 4 and 16, chunked prefill; the families hf_radix cannot run exactly are refused with their reason
(radix `generate`: test_hybrid_generate.py; decode graphs: test_hybrid_graphs.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from reference import hf_greedy, hf_logprob

from hf_radix import RadixBatchRunner, SamplingParams, UnsupportedModelError
from hf_radix.capability import check_model
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_model
from hf_radix.scheduling import admission
from hf_radix.scheduling.admission import PrefillPlanner

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]
warnings.filterwarnings("ignore")
NEW = 5
CORE = ["qwen3_5", "nemotron_h", "lfm2"]
OTHERS = ["qwen3_next", "granitemoehybrid", "falcon_h1", "qwen3_5_moe", "lfm2_moe", "bamba"]
CASES = [(f, ps) for f in CORE for ps in (1, 4)] + [(f, 16) for f in CORE + OTHERS]


def _prompts(vocab: int, seed: int, shared_len: int = 21) -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (shared_len,), generator=gen).tolist()
    return shared, [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 11, 1)]


def _run(runner, model, prompts):
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in prompts]
    runner.check_integrity()


@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_runner_and_loglikelihood_equal_transformers_with_prefix_hits(family: str, page_size: int) -> None:
    model = tiny_hybrid_model(family)
    vocab = model.config.vocab_size
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size)
    assert not runner.engine.captures_graphs and not runner.model_runner.has_graphs
    assert runner.model_runner.warm_up() == {}  # nothing to capture; a padding row has no state slot
    shared, prompts = _prompts(vocab, seed=1)
    _run(runner, model, prompts)  # prompts share a prefix: the later ones hit its snapshot
    first = runner.stats.cached_tokens
    assert first >= (len(shared) // page_size) * page_size * (len(prompts) - 1) > 0
    # a second call: the same prompts (each hits its own last page boundary) and new ones on the prefix
    _, others = _prompts(vocab, seed=2)
    again = prompts[:2] + [shared + others[0][len(shared):]]
    _run(runner, model, again)
    assert runner.stats.cached_tokens - first >= sum((len(p) - 1) // page_size * page_size for p in again[:2])
    pairs = [(prompts[0][:9], prompts[0][9:]), (prompts[1][:-3], prompts[1][-3:]), (shared[:1], [7, 9])]
    scores = runner.loglikelihood(pairs)
    for (logprob, _), (context, continuation) in zip(scores, pairs):
        assert abs(logprob - hf_logprob(model, context, continuation)) <= 1e-4
    runner.check_integrity()


@pytest.mark.parametrize("family", CORE)
def test_chunked_prefill_without_overlap(family: str) -> None:
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=4, chunked_prefill_size=5,
                              overlap=False, max_running_requests=2)
    _, prompts = _prompts(model.config.vocab_size, seed=3)
    _run(runner, model, prompts + [prompts[0][:17]])
    _run(runner, model, prompts[1:])
    assert runner.stats.cached_tokens > 0


def test_few_state_slots_make_requests_wait_not_fail() -> None:
    """A pool of 6 state slots and 20 requests: admission waits for slots; snapshots are evicted."""
    model = tiny_hybrid_model("lfm2")
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=1, state_slots=6)
    assert runner.engine.state_pool.num_slots == 6
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in torch.randint(2, 12, (20,))]
    _run(runner, model, prompts)
    _run(runner, model, prompts[::3])


@pytest.mark.parametrize(
    ("family", "words"),
    [("mamba2", "no attention layer"), ("jamba", "Mamba1"), ("mamba", "Mamba1"),
     ("falcon_mamba", "Mamba1"), ("minimax", "MiniMaxCache"), ("recurrent_gemma", "RG-LRU")],
)
def test_families_not_exact_are_refused_with_their_reason(family: str, words: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        check_model(tiny_hybrid_model(family))
    assert words in info.value.reason


@pytest.mark.parametrize(("family", "page_size"), [(f, 1) for f in CORE] + [(f, 4) for f in CORE])
def test_follow_up_turn_hits_the_previous_prompt_and_answer(family: str, page_size: int) -> None:
    """At release a row's state is kept as the snapshot at the end of prompt + answer (page size 1), or
    at the last page boundary its decode crossed: the next turn, which starts with them, hits it."""
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size)
    _, prompts = _prompts(model.config.vocab_size, seed=5)
    outs = runner.run(prompts[:2], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    turns = [p + o.token_ids + [4, 5, 6] for p, o in zip(prompts, outs)]
    before = runner.stats.cached_tokens
    _run(runner, model, turns)
    want = sum((len(p) + NEW - 1) // page_size * page_size for p in prompts[:2])
    assert runner.stats.cached_tokens - before == want


@pytest.mark.parametrize(("overlap", "page_size"), [(True, 1), (False, 1), (True, 4), (False, 4)])
def test_stop_tokens_with_overlap_then_cache_hits(overlap: bool, page_size: int) -> None:
    """Requests stopping early (a stop token; with overlap a step past the stop is computed and dropped)
    leave a consistent cache: a second call is exact and the integrity check holds."""
    model = tiny_hybrid_model("nemotron_h")
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size, overlap=overlap)
    _, prompts = _prompts(model.config.vocab_size, seed=6)
    full = [hf_greedy(model, p, 8) for p in prompts]
    stops = [f[2] for f in full]
    for _ in range(2):
        outs = runner.run(prompts, [SamplingParams(max_new_tokens=8, stop_token_ids=[s], ignore_eos=True)
                                    for s in stops])
        assert [o.token_ids for o in outs] == [f[: f.index(s) + 1] for f, s in zip(full, stops)]
        runner.check_integrity()
        turns = [p + o.token_ids + [4, 5] for p, o in zip(prompts, outs)]
        _run(runner, model, turns)


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_prefill_chunks_of_one_length_share_a_forward(family: str) -> None:
    """Prompts of one length (no shared prefix) prefill together: two forwards (up to the snapshot point
    before the last token, then the last token), then one forward per decode step."""
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=1)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (9,), generator=gen).tolist() for _ in range(4)]
    _run(runner, model, prompts)
    assert runner.stats.forward_calls == 2 + NEW - 1


def test_scoring_steps_take_the_length_with_the_most_tokens(monkeypatch) -> None:
    """5-shot-like scoring: each step's chunk length is the one with the most tokens waiting (the rest of
    the questions before the choices of the first ones), which takes fewer forwards than the first
    request's length did, with the same log-likelihoods (to fp32 rounding), equal to transformers."""
    model = tiny_hybrid_model("qwen3_5")
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 96, (n,), generator=gen).tolist()

    shots = ids(40)
    questions = [ids(20) for _ in range(16)]
    pairs = [(shots + question, ids(2 + i % 4)) for question in questions for i in range(3)]

    def score() -> tuple[list[float], int]:
        runner = RadixBatchRunner(model, max_total_tokens=2048, page_size=4, chunked_prefill_size=200)
        logprobs = [lp for lp, _ in runner.loglikelihood(pairs)]
        runner.check_integrity()
        return logprobs, runner.stats.forward_calls

    logprobs, forwards = score()
    for (context, continuation), logprob in list(zip(pairs, logprobs))[::7]:
        assert abs(logprob - hf_logprob(model, context, continuation)) <= 1e-4
    monkeypatch.setattr(PrefillPlanner, "_preferred_width", lambda self, budget: None)  # the first's length
    first_logprobs, first_forwards = score()
    assert max(abs(a - b) for a, b in zip(first_logprobs, logprobs)) <= 1e-4
    assert forwards < first_forwards, (forwards, first_forwards)


@pytest.mark.parametrize(("family", "page_size"), [("qwen3_5", 1), ("nemotron_h", 4), ("lfm2", 1),
                                                   ("falcon_h1", 16)])
def test_scoring_rows_of_other_lengths_share_a_forward_padded(family: str, page_size: int,
                                                              monkeypatch) -> None:
    """Continuations of 1 to 9 tokens behind shared questions: their last chunks run in steps of one length,
    the shorter ones padded at their ends, in fewer forwards than a step per length, with log-likelihoods
    equal to transformers (a zero-padding at the front instead fails here). Generating from the scored texts
    afterwards (a scoring request keeps no state past its context, padded or not) equals transformers."""
    model = tiny_hybrid_model(family)
    gen = torch.Generator().manual_seed(11)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 96, (n,), generator=gen).tolist()

    shots = ids(24)
    pairs = [(shots + ids(8), []) for _ in range(4)]
    pairs = [(context, ids(1 + (3 * i + j) % 9)) for i, (context, _) in enumerate(pairs) for j in range(3)]

    def score() -> tuple[RadixBatchRunner, list[float], int]:
        runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size)
        logprobs = [lp for lp, _ in runner.loglikelihood(pairs)]
        runner.check_integrity()
        return runner, logprobs, runner.stats.forward_calls

    runner, logprobs, forwards = score()
    for (context, continuation), logprob in zip(pairs, logprobs):
        assert abs(logprob - hf_logprob(model, context, continuation)) <= 1e-4
    _run(runner, model, [context + continuation for context, continuation in pairs[::2]])
    monkeypatch.setattr(admission, "pads_end", lambda req, end: False)
    _, unpadded, unpadded_forwards = score()
    assert max(abs(a - b) for a, b in zip(unpadded, logprobs)) <= 1e-4
    assert forwards < unpadded_forwards, (forwards, unpadded_forwards)


@pytest.mark.parametrize(("family", "page_size"), [("qwen3_5", 1), ("nemotron_h", 4)])
def test_prompts_of_many_lengths_take_fewer_prefill_steps(family: str, page_size: int, monkeypatch) -> None:
    """Questions of 10 to 150 tokens behind a shared prefix: a chunk at least twice a step's length joins it
    cut (the state continues exactly), so prefill takes fewer steps than a step per length; tokens equal
    transformers either way."""
    model = tiny_hybrid_model(family)
    gen = torch.Generator().manual_seed(12)
    system = torch.randint(3, 96, (60,), generator=gen).tolist()
    prompts = [system + torch.randint(3, 96, (int(n),), generator=gen).tolist()
               for n in torch.randint(10, 150, (24,), generator=gen)]

    def forwards() -> int:
        runner = RadixBatchRunner(model, max_total_tokens=8192, page_size=page_size)
        outs = runner.run(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 2) for p in prompts]
        runner.check_integrity()
        return runner.stats.forward_calls

    cut = forwards()
    monkeypatch.setattr(admission, "joins", lambda natural, width, padded: (natural == width) | padded & (
        natural < width))  # chunks join only at their own length (or padded)
    assert cut < forwards()


def test_saved_cache_with_snapshots_loads_into_a_reset_engine(tmp_path) -> None:
    """`save_cache` / `load_cache` carry the state snapshots: after a reset and a load, the same prompts
    hit their snapshots and stay exact."""
    model = tiny_hybrid_model("lfm2")
    runner = RadixBatchRunner(model, max_total_tokens=512, page_size=1)
    _, prompts = _prompts(model.config.vocab_size, seed=8)
    _run(runner, model, prompts)
    runner.save_cache(tmp_path / "cache")
    runner.engine.reset_cache()
    assert runner.load_cache(tmp_path / "cache")["snapshots"] > 0
    runner.check_integrity()
    before = runner.stats.cached_tokens
    _run(runner, model, prompts)
    assert runner.stats.cached_tokens - before == sum(len(p) - 1 for p in prompts)


@pytest.mark.parametrize("family", CORE + ["falcon_h1", "granitemoehybrid", "qwen3_next"])
def test_a_fresh_row_and_a_restored_row_prefill_together(family: str) -> None:
    """A prompt continuing from a snapshot (chunk 16..24) and a fresh one (chunk 0..8) share a prefill
    forward: the fresh row reads its zeroed slot as a state; both equal transformers."""
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=1)
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(3, 96, (17,), generator=gen).tolist()
    _run(runner, model, [base])  # snapshot after 16 tokens
    calls = runner.stats.forward_calls
    cached = runner.stats.cached_tokens
    _run(runner, model, [base + torch.randint(3, 96, (8,), generator=gen).tolist(),
                         torch.randint(3, 96, (9,), generator=gen).tolist()])
    assert runner.stats.cached_tokens - cached == 16
    assert runner.stats.forward_calls - calls == 2 + NEW - 1  # chunks 16..24 and 0..8 together, then 24, 8


@pytest.mark.parametrize(("family", "page_size"), [("qwen3_5", 1), ("nemotron_h", 4), ("lfm2", 4)])
def test_host_tier_keeps_evicted_prefixes_and_their_snapshots(family: str, page_size: int) -> None:
    """A small GPU pool with a host tier: prompts evicted from the GPU come back from host memory, their
    state snapshots too, and tokens equal transformers."""
    model = tiny_hybrid_model(family)
    vocab = model.config.vocab_size
    runner = RadixBatchRunner(model, max_total_tokens=96, page_size=page_size, host_cache_tokens=1024)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (30,), generator=gen).tolist() for _ in range(6)]
    for prompt in prompts:  # one at a time: each evicts the earlier ones from the small GPU pool
        _run(runner, model, [prompt])
    outs = runner.run(prompts[:2], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in prompts[:2]]
    assert all(o.host_cached_tokens > 0 for o in outs)
    assert runner.engine.host_tier.restored_tokens > 0
    runner.check_integrity()


def test_a_request_restored_from_the_host_tier_then_deferred_counts_its_host_tokens() -> None:
    """Two prompts back from the host tier with chunks of other lengths: the step takes the longer chunk, and
    the other request, whose match already copied its prefix back, waits a step; its output still counts the
    tokens that came from the host tier."""
    model = tiny_hybrid_model("qwen3_5")
    runner = RadixBatchRunner(model, max_total_tokens=96, page_size=1, host_cache_tokens=1024)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (30,), generator=gen).tolist() for _ in range(5)]
    for prompt in prompts:  # one at a time: the later ones evict the first two from the GPU
        _run(runner, model, [prompt])
    again = [prompts[0] + torch.randint(3, 96, (5,), generator=gen).tolist(),
             prompts[1] + torch.randint(3, 96, (9,), generator=gen).tolist()]
    calls = runner.stats.forward_calls
    outs = runner.run(again, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in again]
    assert runner.stats.forward_calls - calls > NEW + 1  # not one prefill step: a request was deferred
    assert [o.host_cached_tokens for o in outs] == [o.cached_tokens for o in outs] == [29, 29]
    runner.check_integrity()
