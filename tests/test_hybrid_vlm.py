"""Qwen3.5 as its checkpoints load (`Qwen3_5ForConditionalGeneration`, a vision tower in front of the hybrid
text model; its MoE twin too): text prompts through `RadixBatchRunner.run`, `runner.loglikelihood` and radix
`generate` equal plain transformers, with prefix-cache hits at page sizes 1 and 16; image and video inputs
and their placeholder tokens are refused with a message saying what to do.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from reference import hf_greedy, hf_logprob

from hf_radix import RadixBatchRunner, RequestError, SamplingParams, UnsupportedModelError
from hf_radix.capability import check_model
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_vlm

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]
warnings.filterwarnings("ignore")
NEW = 5
TEXT_VOCAB = 92  # the tiny models' ids 92..95 are the image / video placeholders and their markers
IMAGE, VIDEO = 92, 93
GREEDY = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)






def _prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, TEXT_VOCAB, (21,), generator=gen).tolist()
    return shared, [shared + torch.randint(3, TEXT_VOCAB, (n,), generator=gen).tolist() for n in (6, 11, 1)]


def _run(runner, model, prompts) -> None:
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in prompts]
    runner.check_integrity()


@pytest.mark.parametrize(("name", "page_size"), [("qwen3_5", 1), ("qwen3_5", 16)])
def test_text_prompts_equal_transformers_with_prefix_hits(name: str, page_size: int) -> None:
    model = tiny_hybrid_vlm(name)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size)
    shared, prompts = _prompts(seed=1)
    _run(runner, model, prompts)
    first = runner.stats.cached_tokens
    assert first >= (len(shared) // page_size) * page_size * (len(prompts) - 1) > 0
    _run(runner, model, prompts[:2])  # the same prompts again hit their own last page boundary
    hits = sum((len(p) - 1) // page_size * page_size for p in prompts[:2])
    assert runner.stats.cached_tokens - first >= hits
    pairs = [(prompts[0][:9], prompts[0][9:]), (prompts[1][:-3], prompts[1][-3:]), (shared[:1], [7, 9])]
    for (logprob, _), (context, continuation) in zip(runner.loglikelihood(pairs), pairs):
        assert abs(logprob - hf_logprob(model, context, continuation)) <= 1e-4
    runner.check_integrity()
    ids = torch.tensor([prompts[0][-12:], prompts[1][-12:]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="radix", **GREEDY)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("name", "model_class"), [("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                                                   ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")])
def test_only_the_text_model_is_checked_and_run(name: str, model_class: str) -> None:
    """The vision tower's attention (cu_seqlens, not causal) is not the text model's: the check counts the
    text model's one full-attention layer of four (the MoE wrapper runs the same code path as the dense
    one, whose exactness the test above checks)."""
    model = tiny_hybrid_vlm(name)
    assert (model.config.image_token_id, model.config.video_token_id) == (IMAGE, VIDEO)
    support = check_model(model)
    assert support.model_class == model_class
    assert support.attention_layers == 1


@pytest.mark.parametrize(
    ("extra", "words"),
    [({"pixel_values": torch.zeros(4, 96), "image_grid_thw": torch.tensor([[1, 2, 2]])}, "pixel_values"),
     ({"pixel_values_videos": torch.zeros(4, 96)}, "pixel_values_videos"),
     ({"image_grid_thw": torch.tensor([[1, 2, 2]])}, "image_grid_thw")],
)
def test_image_and_video_inputs_to_generate_are_refused(extra: dict, words: str) -> None:
    model = tiny_hybrid_vlm("qwen3_5")
    ids = torch.tensor([[5, 6, IMAGE, 7]])
    with pytest.raises(UnsupportedModelError, match=words) as info:
        model.generate(ids, cache_implementation="radix", **extra, **GREEDY)
    assert "plain generate" in info.value.reason


@pytest.mark.parametrize("token", [IMAGE, VIDEO])
def test_placeholder_tokens_are_refused_in_every_entry_point(token: int) -> None:
    model = tiny_hybrid_vlm("qwen3_5")
    runner = RadixBatchRunner(model, max_total_tokens=256, page_size=1)
    prompt = [5, 6, token, 7]
    with pytest.raises(UnsupportedModelError, match="placeholder tokens") as info:
        model.generate(torch.tensor([prompt]), cache_implementation="radix", **GREEDY)
    assert "text prompts only" in info.value.reason
    bad, good = runner.run([prompt, [5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert bad.finish_reason == "error" and "placeholder tokens" in bad.error and "text prompts" in bad.error
    assert good.finish_reason == "length"
    with pytest.raises(RequestError, match="placeholder tokens"):
        runner.loglikelihood([([5, 6], [token, 7])])
    runner.check_integrity()


def test_plain_generate_with_an_image_is_unchanged_by_the_runner() -> None:
    """Images go through plain transformers: attaching a runner changes nothing there (the vision tower
    keeps its own attention outside radix calls)."""
    model = tiny_hybrid_vlm("qwen3_5")
    ids = torch.tensor([[5, 6, 94, IMAGE, 95, 7, 8]])  # vision start, one merged image token, vision end
    image = dict(pixel_values=torch.randn(4, 96, generator=torch.Generator().manual_seed(0)),
                 image_grid_thw=torch.tensor([[1, 2, 2]]), mm_token_type_ids=(ids == IMAGE).long())
    want = model.generate(ids, attention_mask=torch.ones_like(ids), **image, **GREEDY)
    runner = RadixBatchRunner(model, max_total_tokens=256, page_size=1)
    runner.run([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2))
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), **image, **GREEDY), want)
