"""`model.generate(..., cache_implementation="radix")`: equal to the default cache, and reusing prefixes."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from conftest import fresh_model, random_ids
from reference import Boom, RaisingProcessor
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

import hf_radix
from hf_radix.engine import ENGINE_ATTR
from hf_radix.forward.cuda_graph import DecodeGraphs, ExtendGraphs
from hf_radix.integrations import generate_session
from hf_radix.tiny import tiny_model

PAD = 0


# ----------------------------------------------------------------------------- helpers


def _model(arch: str = "llama", page_size: int = 1, max_total_tokens: int = 2048, **overrides):
    """A fresh tiny model whose engine is configured (torch attention backend) before first use."""
    model = tiny_model(arch, **overrides) if overrides else fresh_model(arch)
    hf_radix.configure(model, max_total_tokens=max_total_tokens, page_size=page_size, attn_backend="torch")
    return model


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(model, prompts: list[list[int]], radix: bool, seed: int | None = None, **kwargs):
    """Left-padded batch generate with the radix or the default cache (sampling reseeded with `seed`)."""
    ids, mask = _left_pad(prompts)
    if seed is not None:
        torch.manual_seed(seed)
    if radix:
        kwargs["cache_implementation"] = "radix"
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", PAD)
    return model.generate(ids, attention_mask=mask, **kwargs)


def _both(model, prompts: list[list[int]], seed: int | None = None, **kwargs):
    """Runs the default cache, then radix; asserts equal sequences; returns the radix output."""
    ref = _generate(model, prompts, False, seed, **kwargs)
    got = _generate(model, prompts, True, seed, **kwargs)
    ref_seq = ref if isinstance(ref, torch.Tensor) else ref.sequences
    got_seq = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(got_seq, ref_seq), f"radix\n{got_seq}\n!= default\n{ref_seq}"
    return got


def _clean(model) -> hf_radix.RadixEngine:
    """The engine is consistent and idle; generate left no forward override, hook or attention switch."""
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    assert engine.manager.num_rows == 0
    assert "forward" not in vars(model) and not model._forward_pre_hooks and not model._forward_hooks
    assert model.config._attn_implementation != "radix"
    return engine


def _tree_tokens(sequences: list[list[int]], page_size: int) -> int:
    """Tokens a radix tree of whole pages holds once `sequences` are inserted (each cut to whole pages)."""
    pages = set()
    for seq in sequences:
        for end in range(page_size, len(seq) + 1, page_size):
            pages.add(tuple(seq[:end]))
    return len(pages) * page_size


def _rows(prompts: list[list[int]], out: torch.Tensor, eos: set[int] = frozenset()) -> list[list[int]]:
    """Each row's unpadded prompt + answer, the answer cut after its first EOS."""
    rows = []
    padded = max(map(len, prompts))
    for p, seq in zip(prompts, out.tolist(), strict=True):
        answer = seq[padded:]
        cut = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        rows.append(p + answer[:cut])
    return rows


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- registration


def test_registration_is_idempotent_and_minimal():
    from transformers.generation import configuration_utils as gen_config
    from transformers.generation.utils import GenerationMixin

    def state() -> tuple:
        implementations = gen_config.ALL_CACHE_IMPLEMENTATIONS, gen_config.DYNAMIC_CACHE_IMPLEMENTATIONS
        return implementations, GenerationMixin.generate

    before = state()
    hf_radix.register_generate_support()
    hf_radix.register_generate_support()
    assert state() == before
    assert gen_config.ALL_CACHE_IMPLEMENTATIONS.count("radix") == 1
    assert "radix" not in gen_config.DYNAMIC_CACHE_IMPLEMENTATIONS
    GenerationConfig(cache_implementation="radix").validate()  # a valid value now
    with pytest.raises(ValueError, match="Invalid `cache_implementation`"):
        GenerationConfig(cache_implementation="radixx").validate()


def test_default_generate_never_builds_a_radix_cache(monkeypatch, gen):
    """Without cache_implementation="radix" generate is untouched: no engine, no cache, no override."""

    def refuse(*args, **kwargs):
        raise AssertionError("RadixGenerateCache built for a default generate call")

    monkeypatch.setattr(generate_session.RadixGenerateCache, "__init__", refuse)
    model = fresh_model("llama")
    prompts = [random_ids(gen, 7), random_ids(gen, 4)]
    _generate(model, prompts, False, max_new_tokens=3)
    _generate(model, prompts, False, max_new_tokens=3, cache_implementation="dynamic")
    model.generation_config.cache_implementation = "radix"
    _generate(model, prompts, False, max_new_tokens=3, cache_implementation=None)  # an explicit None wins
    assert getattr(model, ENGINE_ATTR, None) is None
    assert "forward" not in vars(model)


def test_three_ways_to_ask_for_radix(gen):
    """Keyword, GenerationConfig object (positional or keyword), model.generation_config: all run radix."""
    model = _model("llama")
    engine = hf_radix.get_engine(model)
    prompts = [random_ids(gen, 9), random_ids(gen, 5)]
    ids, mask = _left_pad(prompts)
    ref = _generate(model, prompts, False, max_new_tokens=4)
    config = GenerationConfig(cache_implementation="radix", max_new_tokens=4, do_sample=False,
                              pad_token_id=PAD)
    calls = [
        lambda: model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                               cache_implementation="radix"),
        lambda: model.generate(ids, generation_config=config, attention_mask=mask),
        lambda: model.generate(ids, config, attention_mask=mask),
    ]
    for call in calls:
        computed = engine.stats.computed_tokens
        assert torch.equal(call(), ref)
        assert engine.stats.computed_tokens > computed  # the radix path ran
    assert config.cache_implementation == "radix"  # the user's object is not modified
    model.generation_config.cache_implementation = "radix"
    plain = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=PAD)  # None: the model's value
    for call in (lambda: model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                 lambda: model.generate(ids, generation_config=plain, attention_mask=mask)):
        computed = engine.stats.computed_tokens
        assert torch.equal(call(), ref)
        assert engine.stats.computed_tokens > computed
    _clean(model)


# ----------------------------------------------------------------------------- equal to the default cache


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "mistral"])
def test_matches_default_cache_with_ragged_reuse(arch: str, page_size: int, gen):
    model = _model(arch, page_size)
    engine = hf_radix.get_engine(model)
    shared = random_ids(gen, 11)
    first = [shared + random_ids(gen, 6), random_ids(gen, 3), shared[:5] + random_ids(gen, 9)]

    # 1. nothing cached: padding is never computed, never cached
    out = _both(model, first, max_new_tokens=6)
    steps = out.shape[1] - max(map(len, first))
    assert engine.stats.computed_tokens == sum(map(len, first)) + len(first) * (steps - 1)
    assert engine.manager.tree.size_info.total_size == _tree_tokens(
        [row[:len(p) + steps - 1] for p, row in zip(first, _rows(first, out, {1}), strict=True)], page_size
    )
    _clean(model)

    # 2. every row reuses its own cached prefix (of different lengths), greedy
    second = [shared + random_ids(gen, 4), first[1] + random_ids(gen, 7), shared[:5] + random_ids(gen, 2)]
    before = hf_radix.cache_stats(model)
    _both(model, second, max_new_tokens=5)
    after = hf_radix.cache_stats(model)
    # rows reuse 11, 3 and 5 tokens; with pages of 4 only whole pages: 8, 0 and 4
    assert after["cached_tokens"] - before["cached_tokens"] == {1: 19, 4: 12}[page_size]
    _clean(model)

    # 3. sampling with a fixed seed, unequal prompts, more reuse
    third = [shared + random_ids(gen, 2), second[1] + random_ids(gen, 1), random_ids(gen, 8)]
    _both(model, third, seed=7, max_new_tokens=6, do_sample=True, temperature=0.9, top_k=0)
    _both(model, third, seed=8, max_new_tokens=5, do_sample=True, top_p=0.9, top_k=20)
    _clean(model)


def test_output_scores_match_default(gen):
    model = _model("gemma2", page_size=4)
    prompts = [random_ids(gen, 13), random_ids(gen, 6)]
    _generate(model, prompts, True, max_new_tokens=2)  # part of the prompts is cached now
    kwargs = dict(max_new_tokens=5, return_dict_in_generate=True, output_scores=True, output_logits=True,
                  repetition_penalty=1.3)
    ref = _generate(model, prompts, False, **kwargs)
    got = _both(model, prompts, **kwargs)
    assert len(got.scores) == len(ref.scores) == 5
    for mine, theirs in zip([*got.scores, *got.logits], [*ref.scores, *ref.logits], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    _clean(model)


# ----------------------------------------------------------------------------- prefix reuse and statistics


def test_few_shot_prefix_is_computed_once_and_cache_stats_show_it(gen):
    model = _model("qwen2")
    few_shot = random_ids(gen, 40)
    q1, q2, q3 = random_ids(gen, 6), random_ids(gen, 5), random_ids(gen, 7)
    q2[0] = q3[0] = (q1[0] + 1) % 380 + 2  # the questions diverge from q1 at their first token

    _both(model, [few_shot + q1], max_new_tokens=4, eos_token_id=None)
    stats = hf_radix.cache_stats(model)
    assert stats["prompt_tokens"] == 46 and stats["cached_tokens"] == 0
    assert stats["computed_tokens"] == 46 + 3

    _both(model, [few_shot + q2, few_shot + q3], max_new_tokens=4, eos_token_id=None)
    new = hf_radix.cache_stats(model)
    assert new["prompt_tokens"] - stats["prompt_tokens"] == 45 + 47
    assert new["cached_tokens"] - stats["cached_tokens"] == 2 * 40  # the few-shot prefix, for both rows
    assert new["computed_tokens"] - stats["computed_tokens"] == (5 + 7) + 2 * 3  # questions + decode steps
    assert new["hit_rate"] == pytest.approx(80 / (46 + 45 + 47))
    assert new["generated_tokens"] == 3 * 4
    assert new["evicted_tokens"] == 0
    # the time of the radix calls (not of the plain ones), and the throughput it gives
    assert 0 < stats["wall_time"] < new["wall_time"]
    assert new["tokens_per_s"] == pytest.approx(new["generated_tokens"] / new["wall_time"])
    _clean(model)


@pytest.mark.parametrize("page_size", [1, 4])
def test_num_return_sequences_computes_the_prompt_once(page_size: int, gen):
    model = _model("llama", page_size)
    engine = hf_radix.get_engine(model)
    prompts = [random_ids(gen, 22), random_ids(gen, 9)]
    kwargs = dict(max_new_tokens=5, do_sample=True, num_return_sequences=3, top_k=0,
                  return_dict_in_generate=True, output_logits=True)
    ref = _generate(model, prompts, False, seed=3, **kwargs)
    out = _both(model, prompts, seed=3, **kwargs)
    for mine, theirs in zip(out.logits, ref.logits, strict=True):  # sensitive to the copied K/V of duplicates
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert out.sequences.shape[0] == 6
    steps = out.sequences.shape[1] - 22
    assert engine.stats.computed_tokens == 22 + 9 + 6 * (steps - 1)  # each prompt once, then 6 decoding rows
    assert engine.stats.prompt_tokens == 3 * (22 + 9)
    _clean(model)
    # greedy duplicates too (identical rows)
    _both(model, [prompts[1], prompts[1]], max_new_tokens=3)
    _clean(model)


def test_multi_turn_chat_reuses_previous_answer(tokenizer):
    model = _model("mistral")
    turn = tokenizer("You are a helpful assistant. Question: what is the capital of France? Answer:")
    turn = turn["input_ids"]
    out = _both(model, [turn], max_new_tokens=6, eos_token_id=None)
    answer = out[0, len(turn):].tolist()
    assert len(answer) == 6
    stats = hf_radix.cache_stats(model)
    _clean(model)

    user = tokenizer(" Question: how many legs does a spider have? Answer:")["input_ids"]
    second = turn + answer + user
    _both(model, [second], max_new_tokens=4, eos_token_id=None)
    new = hf_radix.cache_stats(model)
    # prompt + answer are cached, except the answer's last token: no forward ever computed its K/V
    assert new["cached_tokens"] - stats["cached_tokens"] == len(turn) + len(answer) - 1
    assert new["computed_tokens"] - stats["computed_tokens"] == len(user) + 1 + 3
    _clean(model)


def test_runner_and_generate_share_one_engine(gen):
    model = _model("llama", page_size=1, max_total_tokens=1024)
    runner = hf_radix.RadixBatchRunner(model, page_size=1, max_total_tokens=1024, attn_backend="torch")
    assert runner.engine is hf_radix.get_engine(model)

    # generate computes a prefix; the runner reuses it
    prefix = random_ids(gen, 30)
    _both(model, [prefix + random_ids(gen, 4)], max_new_tokens=3)
    outs = runner.run([prefix + random_ids(gen, 5)], hf_radix.SamplingParams(max_new_tokens=2))
    assert outs[0].cached_tokens >= 30
    _clean(model)

    # the runner computes a prefix; generate reuses it
    other = random_ids(gen, 25)
    runner.run([other + random_ids(gen, 3)], hf_radix.SamplingParams(max_new_tokens=2))
    before = hf_radix.cache_stats(model)["cached_tokens"]
    _both(model, [other + random_ids(gen, 6)], max_new_tokens=3)
    assert hf_radix.cache_stats(model)["cached_tokens"] - before >= 25
    runner.check_integrity()
    _clean(model)


# ----------------------------------------------------------------------------- generate features


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.chunks.append([])


class _Ban(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.token] = -float("inf")
        return scores


class _StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamers_processors_and_stopping_criteria(tokenizer, gen):
    model = _model("qwen2", page_size=4)
    prompt = random_ids(gen, 10)
    banned = _generate(model, [prompt], False, max_new_tokens=1)[0, -1].item()  # the greedy first token
    streams = []
    for radix in (False, True):
        streamer = _Collect()
        out = _generate(
            model, [prompt], radix, max_new_tokens=10, streamer=streamer, no_repeat_ngram_size=2,
            logits_processor=LogitsProcessorList([_Ban(banned)]),
            stopping_criteria=StoppingCriteriaList([_StopAfter(len(prompt) + 6)]),
        )
        assert out.shape[1] == len(prompt) + 6 and banned not in out[0, len(prompt):].tolist()
        streams.append((out, streamer.chunks))
    assert torch.equal(streams[0][0], streams[1][0]) and streams[0][1] == streams[1][1]

    # the usual pattern: generate in a thread, text read from a TextIteratorStreamer
    texts = []
    for radix in (False, True):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
        kwargs = dict(max_new_tokens=6, streamer=streamer)
        thread = threading.Thread(target=_generate, args=(model, [prompt], radix), kwargs=kwargs)
        thread.start()
        texts.append("".join(streamer))
        thread.join()
    assert texts[0] == texts[1] and texts[0]

    # classifier-free guidance: the processor's own unconditional model calls pass through untouched
    _both(model, [prompt], max_new_tokens=4, guidance_scale=1.5)
    _both(model, [prompt], max_new_tokens=4, guidance_scale=2.0, negative_prompt_ids=torch.tensor([[3, 4]]))
    _clean(model)


def test_eos_stops_rows_and_only_the_answer_up_to_eos_is_cached(gen):
    model = _model("llama")
    engine = hf_radix.get_engine(model)
    prompts = [random_ids(gen, 8), random_ids(gen, 12)]
    free_run = _generate(model, [prompts[0]], False, max_new_tokens=8, eos_token_id=None)[0, 8:].tolist()
    eos = free_run[2]  # the first row emits it as its 3rd token (or earlier)
    out = _both(model, prompts, max_new_tokens=8, eos_token_id=eos)
    rows = _rows(prompts, out, {eos})
    assert rows[0][-1] == eos and len(rows[0]) <= 8 + 3
    steps = out.shape[1] - 12
    assert engine.stats.generated_tokens == sum(len(r) - len(p) for r, p in zip(rows, prompts, strict=True))
    cached = [r[:len(p) + steps - 1] for r, p in zip(rows, prompts, strict=True)]  # no token after an EOS
    assert engine.manager.tree.size_info.total_size == _tree_tokens(cached, 1)
    _clean(model)


def test_inputs_embeds_work_and_are_never_cached(gen):
    model = _model("gemma2")
    engine = hf_radix.get_engine(model)
    ids, mask = _left_pad([random_ids(gen, 9), random_ids(gen, 5)])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=5, do_sample=False,
                  pad_token_id=PAD, eos_token_id=None)
    ref = model.generate(**kwargs)
    got = model.generate(**kwargs, cache_implementation="radix")
    assert torch.equal(got, ref)
    assert engine.stats.computed_tokens == 14 + 2 * 4
    assert engine.manager.tree.size_info.total_size == 0  # no token ids: nothing can be matched later
    _clean(model)


def test_prefill_chunk_size_is_honoured(gen):
    model = _model("llama", page_size=4)
    engine = hf_radix.get_engine(model)
    shared = random_ids(gen, 16)
    _both(model, [shared + random_ids(gen, 3)], max_new_tokens=2)
    prompts = [shared + random_ids(gen, 9), random_ids(gen, 14)]
    calls, computed = engine.stats.forward_calls, engine.stats.computed_tokens
    _both(model, prompts, max_new_tokens=3, prefill_chunk_size=5, eos_token_id=None)
    # 9 + 14 uncached prompt tokens in chunks of <= 5 (each row's last token in generate's own forward)
    assert engine.stats.computed_tokens - computed == 9 + 14 + 2 * 2
    assert engine.stats.forward_calls - calls >= 5 + 2
    _clean(model)


def test_decode_steps_and_short_prefills_go_through_the_graph_runners(monkeypatch, gen):
    """Decode steps and short prefills run as the padded batches a CUDA graph replays (eagerly on the CPU)."""
    model = _model("gemma2", page_size=4)  # sliding window and soft-capping too
    engine = hf_radix.get_engine(model)
    decode, extend = DecodeGraphs(engine, max_batch=4), ExtendGraphs(engine, max_rows=4, max_tokens=32)
    assert not decode.capture and extend.token_sizes == [16, 32] and extend.row_sizes == [1, 2, 4]
    monkeypatch.setattr(engine.model_runner, "decode_graphs", decode)
    monkeypatch.setattr(engine.model_runner, "extend_graphs", extend)
    shared = random_ids(gen, 12)
    prompts = [shared + random_ids(gen, 3), random_ids(gen, 3), shared + random_ids(gen, 1)]
    _both(model, prompts, max_new_tokens=6, eos_token_id=None)
    # 3 rows, 31 tokens: one extend (padded to 4 rows, 32 tokens); 5 decode steps (padded to 4 rows)
    assert (extend.replays, decode.replays) == (1, 5)
    assert engine.stats.computed_tokens == 31 + 3 * 5
    # Cached prefixes: each row extends its own (ragged) prefix; duplicated rows are computed once.
    again = [shared + random_ids(gen, 5), shared + random_ids(gen, 2)]
    out = _both(model, again, seed=2, max_new_tokens=4, do_sample=True, num_return_sequences=2, top_k=0)
    assert out.shape[0] == 4 and (extend.replays, decode.replays) == (2, 5 + 3)
    assert engine.stats.computed_tokens == 31 + 3 * 5 + (5 + 2) + 3 * 4  # the 12 shared tokens were cached
    # The first step runs before generate's own set-up; an error found there still releases everything.
    ids, mask = _left_pad([random_ids(gen, 9)])
    with pytest.raises(ValueError, match="not_a_generate_argument"):
        model.generate(ids, attention_mask=mask, cache_implementation="radix", not_a_generate_argument=1)
    assert extend.replays == 3 and engine.manager.num_rows == 0
    engine.check_integrity()
    # Past the captured shapes: prefill of 40 tokens and a 5-row batch run eagerly.
    _both(model, [random_ids(gen, 40)], max_new_tokens=2)
    _both(model, [random_ids(gen, 5) for _ in range(5)], max_new_tokens=3)
    assert (extend.replays, decode.replays) == (3, 5 + 3 + 1)
    _clean(model)


# ----------------------------------------------------------------------------- errors and robustness





class _RaisingCriterion(StoppingCriteria):
    """Raises on its `at`-th call; never stops otherwise."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        if self.calls == self.at:
            raise Boom("raised in a stopping criterion")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _raise_in_first_forward(model) -> torch.utils.hooks.RemovableHandle:
    def hook(module, args, output):
        handle.remove()
        raise Boom("raised inside the first forward")

    handle = model.model.layers[-1].register_forward_hook(hook)
    return handle


@pytest.mark.parametrize("where", ["stopping_criteria", "logits_processor", "first_forward"])
def test_exception_mid_generation_releases_everything(where: str, gen):
    model = _model("llama", page_size=4)
    prompt = random_ids(gen, 19)
    _both(model, [prompt[:12] + random_ids(gen, 3)], max_new_tokens=2)  # a cached prefix the call will lock
    kwargs = dict(max_new_tokens=8, do_sample=True, num_return_sequences=2, top_k=0)  # duplicated rows too
    if where == "stopping_criteria":
        kwargs["stopping_criteria"] = StoppingCriteriaList([_RaisingCriterion(3)])
    elif where == "logits_processor":
        kwargs["logits_processor"] = LogitsProcessorList([RaisingProcessor(2)])
    else:
        _raise_in_first_forward(model)
    with pytest.raises(Boom):
        _generate(model, [prompt, random_ids(gen, 7)], True, seed=1, **kwargs)
    engine = _clean(model)
    assert engine.manager.tree.size_info.protected_size == 0  # every lock released
    # the engine still works, and what was computed before the error is reused
    before = hf_radix.cache_stats(model)["cached_tokens"]
    _both(model, [prompt], max_new_tokens=3)
    reused = hf_radix.cache_stats(model)["cached_tokens"] - before
    assert reused == (16 if where != "first_forward" else 12)
    _clean(model)


def test_unsupported_modes_raise_clear_errors(gen):
    model = _model("llama")
    prompts = [random_ids(gen, 6)]
    cases = [
        (dict(num_beams=2), "beam search.*num_beams=1.*default cache"),
        (dict(num_beams=2, do_sample=True), "beam search"),
        (dict(assistant_model=fresh_model("llama", seed=1)), "assisted decoding.*default cache"),
        (dict(prompt_lookup_num_tokens=2), "assisted decoding"),
        (dict(use_cache=False), "use_cache=True.*drop use_cache=False"),
        (dict(output_attentions=True, return_dict_in_generate=True), "attentions or hidden states"),
        (dict(past_key_values=transformers.DynamicCache()), "keeps its own cache"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            _generate(model, prompts, True, max_new_tokens=3, **kwargs)
        engine = _clean(model)
        assert engine.stats.prompt_tokens == 0  # refused before touching the engine


def test_right_padding_raises_and_leaves_engine_usable(gen):
    model = _model("qwen2")
    a, b = random_ids(gen, 7), random_ids(gen, 4)
    ids = torch.tensor([a, b + [PAD] * 3])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD,
                       cache_implementation="radix")
    engine = _clean(model)
    assert engine.manager.tree.size_info.total_size == 0
    _both(model, [a, b], max_new_tokens=3)
    _clean(model)


def test_empty_prompt_and_all_padding_row_raise_before_any_forward(gen):
    """An empty prompt (plain transformers fails inside the forward, reshaping 0 elements) and a row that is
    all padding raise a ValueError naming the problem before any forward; the engine stays usable."""
    model = _model("llama")
    engine = hf_radix.get_engine(model)
    empty = torch.empty((1, 0), dtype=torch.long)
    calls = [
        (lambda: model.generate(input_ids=empty, cache_implementation="radix", max_new_tokens=2,
                                pad_token_id=PAD), r"empty prompt \(input_ids of shape \(1, 0\)\).*BOS"),
        (lambda: model.generate(empty, cache_implementation="radix", max_new_tokens=2, pad_token_id=PAD),
         "empty prompt"),
        (lambda: model.generate(inputs_embeds=torch.empty((2, 0, 64)), cache_implementation="radix",
                                max_new_tokens=2, pad_token_id=PAD), r"inputs_embeds of shape \(2, 0, 64\)"),
        (lambda: _generate(model, [random_ids(gen, 5), []], True, max_new_tokens=2),
         r"row 1 of the batch is empty \(all padding\)"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
        assert engine.stats.computed_tokens == 0  # refused before computing anything
        _clean(model)
    _both(model, [random_ids(gen, 5), random_ids(gen, 3)], max_new_tokens=3)
    _clean(model)


def test_pool_too_small_fails_early_with_advice(gen):
    model = _model("llama", page_size=4, max_total_tokens=64)
    engine = hf_radix.get_engine(model)
    with pytest.raises(ValueError, match=r"hf_radix.configure\(model, max_total_tokens"):
        _generate(model, [random_ids(gen, 40), random_ids(gen, 20)], True, max_new_tokens=16)
    assert engine.stats.computed_tokens == 0  # refused before computing anything
    _clean(model)
    _both(model, [random_ids(gen, 40)], max_new_tokens=16)  # 56 tokens fit
    _clean(model)


def test_generation_beyond_max_position_embeddings_matches_default(gen):
    """The engine's context limit is the pool, not max_position_embeddings: same as the default cache."""
    model = _model("llama", max_position_embeddings=24)
    out = _both(model, [random_ids(gen, 20), random_ids(gen, 13)], max_new_tokens=10)  # asserts equality
    assert out.shape[1] > 24  # the call did go past max_position_embeddings
    _clean(model)


def test_eviction_under_memory_pressure_keeps_outputs_equal(gen):
    model = _model("qwen2", page_size=4, max_total_tokens=96)
    shared = random_ids(gen, 12)
    for i in range(8):
        if i % 2:
            prompts = [shared + random_ids(gen, 20 + i % 3)]
        else:
            prompts = [random_ids(gen, 30), shared + [5, 6, 7]]
        _both(model, prompts, max_new_tokens=6)
        _clean(model)
    stats = hf_radix.cache_stats(model)
    assert stats["evicted_tokens"] > 0 and stats["cached_tokens"] > 0
    assert stats["tree_tokens"] <= 96


def test_nested_radix_generate_on_the_same_model_is_refused(gen):
    model = _model("llama")
    prompt = random_ids(gen, 5)

    class Nested(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _generate(model, [prompt], True, max_new_tokens=1)
            return scores

    with pytest.raises(RuntimeError, match="another generate"):
        _generate(model, [prompt], True, max_new_tokens=3, logits_processor=LogitsProcessorList([Nested()]))
    _clean(model)
    _both(model, [prompt], max_new_tokens=3)
    _clean(model)


def test_generate_rows_are_requests_through_their_statuses(monkeypatch):
    """Each row of a call is a `Req`: PREFILLING on the first step, DECODING after it, FINISHED at the end
    ("stop" at its first EOS, else "length"); a duplicated prompt counts as cached and keeps its tokens."""
    from hf_radix.integrations.generate_rows import GenerateRows
    from hf_radix.scheduling.request import RequestStatus

    model = _model()
    gen = torch.Generator().manual_seed(11)
    shared = random_ids(gen, 9)
    prompts = [shared, random_ids(gen, 5), shared]
    seen: dict[str, list] = {}
    real_open, real_cache, real_release = GenerateRows.open, GenerateRows.cache_prompts, GenerateRows.release

    def opened(rows, *args):
        real_open(rows, *args)
        seen["opened"] = [(r.status, r.computed_len, r.extend_len) for r in rows.reqs]

    def cached(rows):
        real_cache(rows)
        seen["decoding"] = [(r.status, r.computed_len, r.launched) for r in rows.reqs]

    def released(rows, last, eos, failed=False):
        generated = real_release(rows, last, eos, failed)
        seen["reqs"] = rows.reqs
        return generated

    monkeypatch.setattr(GenerateRows, "open", opened)
    monkeypatch.setattr(GenerateRows, "cache_prompts", cached)
    monkeypatch.setattr(GenerateRows, "release", released)
    out = _both(model, prompts, max_new_tokens=4)
    assert seen["opened"] == [(RequestStatus.PREFILLING, 0, len(p)) for p in prompts]
    assert seen["decoding"] == [(RequestStatus.DECODING, len(p), 1) for p in prompts]
    for req, prompt, row in zip(seen["reqs"], prompts, out.tolist()):
        assert req.status is RequestStatus.FINISHED and req.finish_reason == "length" and req.row is None
        assert req.token_ids == row[len(row) - len(prompt) - 4 :]
    assert seen["reqs"][2].cached_len == len(shared)  # computed once, by row 0
    _clean(model)
