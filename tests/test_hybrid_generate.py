"""Radix `generate` on hybrid models (issue 29): greedy tokens and every step's logits equal plain
transformers on tiny fp32 models, for single prompts and left-padded batches of different lengths, with
sampling, duplicated rows, prefill chunks and prompts given as embeddings; a follow-up call whose prompts
extend the first call's prompts and answers hits the state snapshots the first call left on the tree, and
the runner and generate hit each other's snapshots.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from reference import Boom, RaisingProcessor
from transformers import LogitsProcessorList

import hf_radix
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_model

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]
warnings.filterwarnings("ignore")
PAD = 0
NEW = 4
CORE = ["qwen3_5", "nemotron_h", "lfm2"]
OTHERS = ["qwen3_next", "granitemoehybrid", "falcon_h1", "qwen3_5_moe", "lfm2_moe", "bamba"]
CASES = [(f, ps) for f in CORE for ps in (1, 16)] + [(f, (1, 16)[i % 2]) for i, f in enumerate(OTHERS)]


def _model(family: str, page_size: int, **options) -> torch.nn.Module:
    model = tiny_hybrid_model(family)
    hf_radix.configure(model, max_total_tokens=1024, page_size=page_size, **options)
    return model


def _ids(model, seed: int, *lens: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _both(model, prompts: list[list[int]], seed: int = 0, **kwargs):
    """Plain generate, then radix generate (same seed): equal sequences and step logits; the radix output."""
    ids, mask = _left_pad(prompts)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                  return_dict_in_generate=True, output_logits=True) | kwargs
    outs = []
    for cache in ("dynamic", "radix"):
        torch.manual_seed(seed)
        outs.append(model.generate(ids, attention_mask=mask, cache_implementation=cache, **kwargs))
    ref, got = outs
    assert torch.equal(got.sequences, ref.sequences), f"radix\n{got.sequences}\n!= plain\n{ref.sequences}"
    assert len(got.logits) == len(ref.logits)
    for mine, theirs in zip(got.logits, ref.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    _clean(model)
    return got


def _clean(model) -> hf_radix.RadixEngine:
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    assert engine.hybrid and engine.manager.num_rows == 0
    assert engine.state_pool.num_used == len(engine.manager.tree.snapshot_slots())  # no running slot left
    return engine


def _answers(prompts: list[list[int]], out) -> list[list[int]]:
    width = max(map(len, prompts))
    return [out.sequences[i, width:].tolist() for i in range(len(prompts))]


def _cached(model) -> int:
    return hf_radix.cache_stats(model)["cached_tokens"]


@pytest.mark.parametrize(("family", "page_size"), CASES)
def test_generate_equals_transformers_and_follow_ups_hit_prompt_and_answer(family: str, page_size: int):
    model = _model(family, page_size)
    shared, a, b, c = _ids(model, 1, 18, 5, 9, 7)
    prompts = [shared + a, c, shared + b]  # different lengths, left-padded; two share a prefix
    out = _both(model, prompts)
    assert _cached(model) == 0
    # the next turn of each row: its prompt, its answer and new text; each hits prompt + answer (the last
    # answer token has no forward), to the last page boundary
    turns = [p + answer + [4, 5, 6] for p, answer in zip(prompts, _answers(prompts, out), strict=True)]
    before = _cached(model)
    _both(model, turns + _ids(model, 2, 4))  # with a new prompt as long as the turns' uncached parts (page 1)
    assert _cached(model) - before == sum((len(p) + NEW - 1) // page_size * page_size for p in prompts)
    if family in CORE:  # the same prompt alone hits its last page boundary before its last token
        before = _cached(model)
        _both(model, [prompts[2]])
        assert _cached(model) - before == (len(prompts[2]) - 1) // page_size * page_size


@pytest.mark.parametrize(("family", "page_size"), [("qwen3_5", 1), ("nemotron_h", 16), ("lfm2", 4)])
def test_sampling_with_a_seed_and_duplicated_rows(family: str, page_size: int):
    """`num_return_sequences` rows compute their prompt once and copy the first row's state."""
    model = _model(family, page_size)
    prompts = _ids(model, 2, 21, 6)
    kwargs = dict(do_sample=True, top_k=0, temperature=0.9, num_return_sequences=2)
    _both(model, prompts, seed=5, **kwargs)
    engine = hf_radix.get_engine(model)
    before = _cached(model)
    _both(model, prompts, seed=6, **kwargs)  # each prompt hits its snapshot; duplicates count whole
    hits = sum((len(p) - 1) // page_size * page_size + len(p) for p in prompts)
    assert _cached(model) - before == hits
    assert engine.stats.generated_tokens == 2 * 4 * NEW


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_answer_cut_at_eos_is_cached_with_its_state(page_size: int):
    """A row that stops at EOS while another goes on keeps its state at the end of its answer (page size 1)
    or its last page boundary: a follow-up turn hits it, and no state from past the EOS is kept."""
    model = _model("lfm2", page_size)
    prompts = _ids(model, 3, 13, 6)
    free = _answers(prompts, _both(model, prompts, max_new_tokens=8))[0]
    eos = free[2]
    out = _both(model, prompts, max_new_tokens=8, eos_token_id=eos)
    answer = _answers(prompts, out)[0]
    answer = answer[: answer.index(eos) + 1]
    keep = len(prompts[0]) + len(answer)
    before = _cached(model)
    _both(model, [prompts[0] + answer + [7, 8]], eos_token_id=eos)
    assert _cached(model) - before == keep // page_size * page_size


def test_prefill_chunks_and_prompts_given_as_embeddings():
    model = _model("qwen3_5", 4)
    engine = hf_radix.get_engine(model)
    prompts = _ids(model, 4, 17, 6, 11)
    _both(model, prompts, prefill_chunk_size=5)
    before = _cached(model)
    _both(model, prompts[:1], prefill_chunk_size=3)
    assert _cached(model) - before == 16
    ids, mask = _left_pad(prompts[1:])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                  pad_token_id=PAD, eos_token_id=None)
    size = engine.manager.tree.size_info.total_size
    assert torch.equal(model.generate(**kwargs, cache_implementation="radix"), model.generate(**kwargs))
    assert engine.manager.tree.size_info.total_size == size  # no token ids: nothing to match later
    _clean(model)





def test_more_rows_than_state_slots_and_errors_leave_the_engine_usable():
    model = _model("nemotron_h", 1, state_slots=2)
    prompts = _ids(model, 5, 9, 5, 7)
    with pytest.raises(ValueError, match="state slots"):
        _both(model, prompts)
    _clean(model)
    ids, mask = _left_pad(prompts[:2])
    raising = LogitsProcessorList([RaisingProcessor(2)])
    with pytest.raises(Boom):
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=None,
                       cache_implementation="radix", logits_processor=raising)
    _clean(model)
    _both(model, prompts[:2])


def test_runner_and_generate_share_their_snapshots():
    model = _model("lfm2", 1)
    runner = hf_radix.RadixBatchRunner(model, page_size=1, max_total_tokens=1024)
    assert runner.engine is hf_radix.get_engine(model)
    p, q, more = _ids(model, 6, 14, 11, 5)
    answer = _answers([p], _both(model, [p]))[0]  # generate's snapshot: the end of prompt + answer
    params = hf_radix.SamplingParams(max_new_tokens=2, ignore_eos=True)
    assert runner.run([p + answer + more], params)[0].cached_tokens == len(p) + NEW - 1
    runner.run([q], params)  # the runner's snapshot before the prompt's last token
    before = _cached(model)
    _both(model, [q + more])
    assert _cached(model) - before == len(q) - 1
    runner.check_integrity()
