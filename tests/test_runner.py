"""RadixBatchRunner: greedy outputs equal plain `generate`, under reuse, chunking, eviction and bad input."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.forward.cuda_graph import ExtendGraphs

NEW = 6


@functools.cache
def _model(arch: str):
    return fresh_model(arch)


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...], new: int = NEW) -> list[int]:
    return hf_greedy(_model(arch), list(prompt), new)


def _workload(seed: int = 0) -> list[list[int]]:
    """Shared prefixes, exact duplicates, a prompt that prefixes others, single-token prompts."""
    gen = torch.Generator().manual_seed(seed)
    system = random_ids(gen, 29)
    other = random_ids(gen, 17)
    prompts = [system + random_ids(gen, n) for n in (3, 7, 12)]
    prompts += [list(prompts[0]), list(prompts[0])]  # exact duplicates
    prompts += [system[:13], system, other + random_ids(gen, 4), other, [42], [42]]
    return prompts


def _runner(arch: str, **options) -> RadixBatchRunner:
    model = _model(arch)
    options = {"attn_backend": "torch", "max_total_tokens": 2048, **options}
    runner = RadixBatchRunner(model, **options)
    runner.reset_cache()
    return runner


def _assert_matches_hf(arch: str, prompts: list[list[int]], outs, new: int = NEW) -> None:
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.prompt_token_ids == prompt
        assert out.token_ids == _reference(arch, tuple(prompt), new), (
            f"prompt of {len(prompt)} tokens differs"
        )


@pytest.mark.parametrize(
    "arch,page_size,chunk",
    [("llama", 1, 8192), ("llama", 4, 5), ("qwen2", 1, 7), ("gemma2", 4, 8192), ("mistral", 2, 11)],
)
def test_greedy_equals_generate(arch: str, page_size: int, chunk: int):
    runner = _runner(arch, page_size=page_size, chunked_prefill_size=chunk)
    prompts = _workload()
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    _assert_matches_hf(arch, prompts, outs)
    assert all(o.finish_reason in ("length", "stop") for o in outs)

    again = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    for prompt, first, second in zip(prompts, outs, again):
        assert second.token_ids == first.token_ids
        aligned = (len(prompt) - 1) // page_size * page_size
        assert second.cached_tokens >= aligned
    assert runner.engine.manager.num_rows == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_eviction_under_memory_pressure(page_size: int):
    runner = _runner("llama", page_size=page_size, max_total_tokens=96, max_running_requests=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [random_ids(gen, 30 + i) for i in range(8)]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    _assert_matches_hf("llama", prompts, outs)
    assert runner.engine.manager.evicted_tokens > 0


def test_shared_prefix_is_computed_once():
    runner = _runner("llama")
    gen = torch.Generator().manual_seed(4)
    system = random_ids(gen, 64)
    prompts = [system + random_ids(gen, 4) for _ in range(8)] + [system + [9, 9, 9, 9]] * 4
    before = runner.engine.stats.computed_tokens
    outs = runner.run(prompts, SamplingParams(max_new_tokens=1))
    runner.check_integrity()
    computed = runner.engine.stats.computed_tokens - before
    assert computed <= 64 + 12 * 5, f"computed {computed} tokens; the shared prefix was recomputed"
    _assert_matches_hf("llama", prompts, outs, new=1)
    assert sum(o.cached_tokens >= 64 for o in outs) >= 11


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_policies_agree(policy: str):
    runner = _runner("qwen3", schedule_policy=policy, chunked_prefill_size=16)
    prompts = _workload(seed=5)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    _assert_matches_hf("qwen3", prompts, outs)


def test_seeded_sampling_is_reproducible_across_batches():
    runner = _runner("llama")
    gen = torch.Generator().manual_seed(6)
    target = random_ids(gen, 12)
    others = [random_ids(gen, n) for n in (5, 9, 20)]
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = runner.run([target], params)[0].token_ids
    mixed = runner.run(others + [target], [SamplingParams(max_new_tokens=8, temperature=1.0)] * 3 + [params])
    assert mixed[-1].token_ids == alone
    different = runner.run([target], SamplingParams(max_new_tokens=8, temperature=0.9, seed=99))[0].token_ids
    assert different != alone
    runner.check_integrity()


def test_stop_token_ids_and_stop_strings(tokenizer):
    runner = RadixBatchRunner(_model("llama"), tokenizer, attn_backend="torch", max_total_tokens=2048)
    prompt = "Question: what is the capital of France? Answer:"
    greedy = runner.run([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_at = 4
    stop_id = greedy.token_ids[stop_at]
    first = greedy.token_ids.index(stop_id)
    by_id = runner.run([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_id]))[0]
    assert by_id.token_ids == greedy.token_ids[: first + 1]
    assert by_id.finish_reason == "stop"

    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    by_text = runner.run([prompt], SamplingParams(max_new_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == text[: text.index(stop)]
    decoded = tokenizer.decode(by_text.token_ids)
    assert stop in decoded and stop not in tokenizer.decode(by_text.token_ids[:-1])
    runner.check_integrity()


def test_bad_requests_fail_alone():
    runner = _runner("llama", max_total_tokens=256)
    gen = torch.Generator().manual_seed(7)
    good = [random_ids(gen, 10), random_ids(gen, 15)]
    too_long_for_context = random_ids(gen, 1020)
    too_long_for_pool = random_ids(gen, 300)
    prompts = [good[0], [], [5, 99999], too_long_for_context, too_long_for_pool, [-1, 3], good[1]]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    assert [o.finish_reason == "error" for o in outs] == [False, True, True, True, True, True, False]
    assert "empty" in outs[1].error
    assert "vocab" in outs[2].error or "[0, " in outs[2].error
    assert "context" in outs[3].error
    assert "pool" in outs[4].error
    _assert_matches_hf("llama", good, [outs[0], outs[6]])


def test_max_new_tokens_zero_and_invalid_params():
    runner = _runner("llama")
    out = runner.run([[3, 4, 5]], SamplingParams(max_new_tokens=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    for bad in ({"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="tokenizer"):
        runner.run(["text needs a tokenizer"])
    runner.check_integrity()


def test_interrupt_leaves_engine_usable(monkeypatch):
    runner = _runner("llama")
    gen = torch.Generator().manual_seed(8)
    prompts = [random_ids(gen, 20) for _ in range(4)]
    engine = runner.engine
    real_forward = engine.run_model
    calls = {"n": 0}

    def interrupted(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_forward(batch)

    monkeypatch.setattr(engine, "run_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    assert engine.manager.num_rows == 0
    monkeypatch.setattr(engine, "run_model", real_forward)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    _assert_matches_hf("llama", prompts, outs)


def test_string_prompts_and_stats(tokenizer):
    runner = RadixBatchRunner(_model("llama"), tokenizer, attn_backend="torch", max_total_tokens=2048)
    runner.reset_cache()
    engine_time = runner.engine.stats.wall_time  # the model's engine may have served other tests
    system = "You are a helpful assistant. Answer briefly and precisely. "
    prompts = (system + q for q in ["Question: one?", "Question: two?", "Question: three?"])
    outs = runner.run(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 and isinstance(o.text, str) for o in outs)
    stats = runner.stats
    assert stats.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert stats.cached_tokens > 0 and 0 < stats.hit_rate < 1
    assert stats.generated_tokens == 12 and stats.wall_time > 0 and stats.tokens_per_s > 0
    engine = hf_radix.cache_stats(runner.model)  # the engine's statistics time its radix calls too
    assert engine["wall_time"] - engine_time == pytest.approx(stats.wall_time) and engine["tokens_per_s"] > 0
    runner.check_integrity()


def test_default_runner_keeps_the_configured_engine():
    model = fresh_model("llama")
    engine = hf_radix.configure(model, max_total_tokens=512, page_size=2, attn_backend="torch")
    runner = RadixBatchRunner(model)
    assert runner.engine is engine and engine.manager.num_pages * engine.page_size == 512
    other = RadixBatchRunner(model, page_size=4)
    assert other.engine is not engine and other.engine.page_size == 4
    assert other.engine.options.max_total_tokens == 512  # unspecified options carry over
    other.check_integrity()


@pytest.mark.parametrize("arch,page_size,chunk", [("qwen2", 2, 9), ("gemma2", 1, 8192)])
def test_small_prefill_rounds_replay_extend_graphs(arch: str, page_size: int, chunk: int):
    """Rounds of <= 4 rows and 32 new tokens run as the padded batch a CUDA graph replays (eagerly here)."""
    runner = _runner(arch, page_size=page_size, chunked_prefill_size=chunk, max_running_requests=3)
    graphs = ExtendGraphs(runner.engine, max_rows=4, max_tokens=32)
    runner.model_runner.extend_graphs = graphs
    prompts = _workload(seed=3)
    _assert_matches_hf(arch, prompts, runner.run(prompts, SamplingParams(max_new_tokens=NEW)))
    runner.check_integrity()
    assert graphs.replays > 0
    replays = graphs.replays
    runner.loglikelihood([(prompts[0], [5, 6, 7])])  # scoring rounds run eagerly
    assert graphs.replays == replays
    runner.check_integrity()


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_admission_holds_exactly_max_running_requests(limit: int, monkeypatch):
    """Every forward holds at most `limit` requests, and the first prefill round holds exactly `limit`."""
    runner = _runner("llama", max_running_requests=limit)
    engine = runner.engine
    sizes: list[int] = []
    real_forward = engine.run_model

    def counting(batch):
        sizes.append(batch.batch_size)
        return real_forward(batch)

    monkeypatch.setattr(engine, "run_model", counting)
    gen = torch.Generator().manual_seed(11)
    prompts = [random_ids(gen, 5 + i) for i in range(12)]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=3))
    runner.check_integrity()
    _assert_matches_hf("llama", prompts, outs, new=3)
    assert max(sizes) == limit and sizes[0] == limit
