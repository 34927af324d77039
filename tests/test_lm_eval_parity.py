"""hf-radix behaves as lm-eval's `hf` where users switch between them: BOS, chat templates, generation
kwargs only HF applies, long max_length, model_args; per sample, on local tasks and tiny fp32 models."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
pytest.importorskip("accelerate", reason="lm-eval's hf backend needs accelerate")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval_helpers import evaluate  # noqa: E402

from hf_radix.lm_eval_backend import HFRadixLM  # noqa: E402
from hf_radix.lm_eval_backend.generate import plan  # noqa: E402
from hf_radix.tiny import tiny_model, tiny_tokenizer  # noqa: E402

ATOL = 1e-4
NO_SYSTEM_TEMPLATE = (  # Gemma-style: a system message is an error
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _assert_same_samples(ours: dict, theirs: dict, tasks: list[str]) -> None:
    for task in tasks:
        a_samples, b_samples = ours["samples"][task], theirs["samples"][task]
        assert len(a_samples) == len(b_samples) > 0
        for a, b in zip(a_samples, b_samples):
            assert a["arguments"] == b["arguments"]
            got, want = a["filtered_resps"], b["filtered_resps"]
            if a_samples[0]["filtered_resps"] and isinstance(got[0], (list, tuple)):  # multiple choice
                assert [g for _, g in got] == [g for _, g in want]
                got, want = [lp for lp, _ in got], [lp for lp, _ in want]
            if got and isinstance(got[0], str):
                assert got == want
            else:
                assert got == pytest.approx(want, abs=ATOL)


@pytest.fixture(scope="module")
def bos_checkpoint(tmp_path_factory) -> Path:
    """A model and a tokenizer that defines BOS but does not add it, saved together."""
    path = tmp_path_factory.mktemp("bos")
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<bos>"})
    assert tokenizer.encode("Hi")[0] != tokenizer.bos_token_id
    tiny_model("llama", seed=3, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_add_bos_token_matches_hf(bos_checkpoint):
    args = {"pretrained": str(bos_checkpoint), "dtype": "float32", "device": "cpu", "add_bos_token": True,
            "max_length": 48}
    tasks = ["hf_radix_tiny_mc", "hf_radix_tiny_ppl"]
    radix = evaluate("hf-radix", args, tasks, limit=4)
    hf = evaluate("hf", {**args, "batch_size": 4}, tasks, limit=4)
    _assert_same_samples(radix, hf, tasks)
    ppl = "hf_radix_tiny_ppl"
    metric = "word_perplexity,none"
    assert radix["results"][ppl][metric] == pytest.approx(hf["results"][ppl][metric])
    lm = HFRadixLM(pretrained=str(bos_checkpoint), add_bos_token=True, device="cpu")
    assert lm.tok_encode("Hi")[0] == lm.tokenizer.bos_token_id  # BOS added, as hf's tokenizer adds it
    # a tokenizer object gets add_bos_token too (hf ignores it there; hf-radix applies it to a copy)
    obj = tiny_tokenizer()
    obj.add_special_tokens({"bos_token": "<bos>"})
    lm = HFRadixLM(pretrained=lm.model, tokenizer=obj, add_bos_token=True)
    assert lm.tok_encode("Hi")[0] == obj.bos_token_id and obj.encode("Hi")[0] != obj.bos_token_id


def test_chat_template_without_system_role_matches_hf(caplog):
    model = tiny_model("llama", seed=1)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    args = {"pretrained": model, "tokenizer": tokenizer, "max_length": 160}
    tasks = ["hf_radix_tiny_gen", "hf_radix_tiny_mc"]
    options = dict(apply_chat_template=True, system_instruction="Answer briefly.", limit=3)
    with caplog.at_level(logging.WARNING, logger="hf_radix"):
        radix = evaluate("hf-radix", args, tasks, **options)
    assert "without the system message" in caplog.text
    hf = evaluate("hf", {**args, "batch_size": 4}, tasks, **options)
    _assert_same_samples(radix, hf, tasks)
    prompt = str(radix["samples"]["hf_radix_tiny_gen"][0]["arguments"])
    assert "<user>" in prompt and "<system>" not in prompt  # templated, without the system turn (as hf)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_generation_kwargs_only_hf_applies_match_hf(model, tokenizer, monkeypatch, caplog):
    """repetition_penalty and friends run through generate(cache_implementation="radix"), grouped."""
    ours = HFRadixLM(pretrained=model, tokenizer=tokenizer, max_length=64)
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=64)
    penalized = {"until": ["\n"], "max_gen_toks": 10, "do_sample": False, "repetition_penalty": 1.5}
    ngram = {"until": ["."], "max_gen_toks": 8, "no_repeat_ngram_size": 2}
    plain = {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}
    contexts = ["Question: how many legs? Answer:", "The quick brown fox", "0 1 2 3 4 5"]
    requests = [Instance("generate_until", {}, (c, dict(k)), i)
                for i, (c, k) in enumerate((c, k) for k in (penalized, ngram, plain) for c in contexts)]
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: calls.append(kw) or generate(*a, **kw))
    with caplog.at_level(logging.WARNING, logger="hf_radix"):
        got = ours.generate_until(requests)
    assert len(calls) == 2  # one generate per kwargs group; the plain requests ran on the runner
    assert all(kw["cache_implementation"] == "radix" for kw in calls)
    assert caplog.text.count("repetition_penalty") == 1  # said once, not per request
    monkeypatch.setattr(model, "generate", generate)
    want = theirs.generate_until(requests)
    assert got == want
    assert got[:3] != ours.generate_until(requests[6:])  # the penalty changed the answers
    ours.runner.check_integrity()


def test_runner_sampling_takes_the_models_generation_config(model):
    """A model whose generation_config sets a penalty, or top_k/top_p for sampling, is honoured."""
    config = model.generation_config
    kwargs = {"do_sample": True, "temperature": 0.7, "until": [], "max_gen_toks": 4}
    params = plan(model, kwargs, ["\n"]).params
    assert (params.top_k, params.top_p, params.temperature) == (50, 1.0, 0.7)  # transformers' defaults
    try:
        config.top_p, config.repetition_penalty = 0.9, 1.2
        sampled = plan(model, kwargs, [])
        assert sampled.params is None
        assert "repetition_penalty (the model's generation_config)" in sampled.needs_hf
        assert plan(model, {**kwargs, "repetition_penalty": 1.0}, []).params.top_p == 0.9
    finally:
        config.top_p = config.repetition_penalty = None


def test_max_length_above_max_position_embeddings_matches_hf(tokenizer):
    """hf runs positions past max_position_embeddings (rotary); so does hf-radix, with hf's truncation."""
    model = tiny_model("llama", seed=2, max_position_embeddings=32)
    ours = HFRadixLM(pretrained=model, tokenizer=tokenizer, max_length=48, page_size=4)
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=48)
    long = "The quick brown fox jumps over the lazy dog. " * 6
    pairs = [(long, " twelve"), ("Question: what is the capital of France? Answer:", " Paris")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got, want = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=ATOL)
    rolling = [Instance("loglikelihood_rolling", {}, (long * 2,), 0)]
    want = theirs.loglikelihood_rolling(rolling)  # hf sums each window in float32
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(want, rel=1e-6, abs=ATOL)
    with pytest.raises(ValueError, match="KV pool"):  # checked when built, not after a whole batch ran
        HFRadixLM(pretrained=model, tokenizer=tokenizer, max_length=48, max_total_tokens=32)


def test_model_args(model, tokenizer):
    lm = HFRadixLM(pretrained=model, tokenizer=tokenizer, batch_size=8, max_batch_size=64,
                   softmax_dtype="float32",
                   truncation=False, use_fast_tokenizer=True, attn_implementation="sdpa", logits_cache=True)
    assert lm.max_length == model.config.max_position_embeddings
    HFRadixLM(pretrained=model, tokenizer=tokenizer, parallelize=False, device_map=None)  # unset: fine
    with pytest.raises(ValueError, match="one device"):
        HFRadixLM(pretrained=model, tokenizer=tokenizer, device_map="auto")
    with pytest.raises(ValueError, match="one device"):
        HFRadixLM(pretrained=model, tokenizer=tokenizer, parallelize=True)
    with pytest.raises(TypeError, match=r"unknown model_args \['load_in_9bit'\]; supported: .*softmax_dtype"):
        HFRadixLM(pretrained=model, tokenizer=tokenizer, load_in_9bit=True)
    with pytest.raises(ValueError, match="causal"):
        HFRadixLM(pretrained=model, tokenizer=tokenizer, backend="seq2seq")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="model object is on cpu"):
            HFRadixLM(pretrained=model, tokenizer=tokenizer, device="cuda")
