"""The "hf-radix" lm-eval backend agrees with lm-eval's own "hf" backend, sample by sample."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402
from lm_eval_helpers import evaluate  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix.integrations.evaluation import rolling_windows  # noqa: E402
from hf_radix.lm_eval_backend import HFRadixLM  # noqa: E402
from hf_radix.tiny import tiny_model, tiny_tokenizer  # noqa: E402

TASKS = ["hf_radix_tiny_mc", "hf_radix_tiny_ppl", "hf_radix_tiny_gen"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _hf_lm(model, tokenizer, **options):
    hf = pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval's hf backend needs accelerate")
    return hf.HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, **options)


def test_registered_under_hf_radix():
    assert get_model("hf-radix") is HFRadixLM


def test_simple_evaluate_matches_hf_backend(model, tokenizer):
    pytest.importorskip("accelerate", reason="lm-eval's hf backend needs accelerate")
    args = {"pretrained": model, "tokenizer": tokenizer, "max_length": 128}
    radix = evaluate("hf-radix", {**args, "page_size": 4}, TASKS)
    stats = hf_radix.cache_stats(model)
    hf_radix.get_engine(model).check_integrity()
    hf = evaluate("hf", {**args, "batch_size": 4}, TASKS)

    mc = "hf_radix_tiny_mc"
    assert radix["results"][mc]["acc,none"] == hf["results"][mc]["acc,none"]
    assert radix["results"][mc]["acc_norm,none"] == hf["results"][mc]["acc_norm,none"]
    assert stats["hit_rate"] > 0.5  # the two-shot preamble and each question are shared by the choices
    info, reference = radix["config"], hf["config"]
    for key in ("model_num_parameters", "model_dtype", "model_revision", "model_sha"):
        assert info[key] == reference[key]
    reuse = info["hf_radix_reuse"]  # this run's reuse, in the results JSON
    assert reuse["prompt_tokens"] > reuse["cached_tokens"] > 0
    assert reuse["hit_rate"] == pytest.approx(reuse["cached_tokens"] / reuse["prompt_tokens"])
    assert 0 < reuse["computed_tokens"] < reuse["prompt_tokens"] + reuse["generated_tokens"]
    for task in TASKS:
        ours, theirs = radix["samples"][task], hf["samples"][task]
        assert len(ours) == len(theirs) == 8
        for a, b in zip(ours, theirs):
            assert a["arguments"] == b["arguments"]
            if task == "hf_radix_tiny_gen":
                assert a["resps"] == b["resps"]
                continue
            got, want = a["filtered_resps"], b["filtered_resps"]
            if task == mc:
                assert [g for _, g in got] == [g for _, g in want]
                got, want = [lp for lp, _ in got], [lp for lp, _ in want]
            assert got == pytest.approx(want, abs=ATOL)


def test_tokenization_edge_cases_match_hf_backend(model, tokenizer):
    """Empty and space-terminated contexts, left truncation, rolling windows, stop strings."""
    ours = HFRadixLM(pretrained=model, tokenizer=tokenizer, max_length=24, page_size=4)
    theirs = _hf_lm(model, tokenizer, max_length=24)
    long = "The quick brown fox jumps over the lazy dog. " * 4
    pairs = [("", "Paris"), ("Question: what is the capital of France? Answer: ", "Paris"),
             ("Answer:", " eight"), (long, " twelve"), (long + "The", " quick brown fox jumps")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got, want = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=ATOL)

    texts = [long, "eight", long * 2 + "0 1 2 3 4 5 6 7 8 9 ten eleven twelve."]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    want = theirs.loglikelihood_rolling(rolling)
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(want, abs=ATOL)

    kwargs = [{"until": ["\n"], "max_gen_toks": 6, "do_sample": False}, {"until": "e", "max_gen_toks": 8},
              {"max_new_tokens": 5, "temperature": 0.0}]
    prompts = [Instance("generate_until", {}, ("Question: ten? Answer:", k), i) for i, k in enumerate(kwargs)]
    prompts.append(Instance("generate_until", {}, (long, kwargs[0]), 3))  # left-truncated to 24 - 6 tokens
    assert ours.generate_until(prompts) == theirs.generate_until(prompts)
    with pytest.raises(ValueError, match="max_gen_toks"):
        ours.generate_until([Instance("generate_until", {}, ("Hi", {"max_gen_toks": 24}), 0)])
    ours.runner.check_integrity()


def test_loads_from_a_path(model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = HFRadixLM(pretrained=str(tmp_path), dtype="float32", device="cpu")
    assert loaded.model.device.type == "cpu"
    in_memory = HFRadixLM(pretrained=model, tokenizer=tokenizer)
    requests = [Instance("loglikelihood", {}, ("Answer briefly and precisely:", " Paris."), 0)]
    want = in_memory.loglikelihood(requests)[0][0]
    assert loaded.loglikelihood(requests)[0][0] == pytest.approx(want, abs=ATOL)
    assert loaded.model.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        HFRadixLM(pretrained=str(tmp_path), dtype="float33")
    if not torch.cuda.is_available():  # the device asked for, or a clear error: never a silent fallback
        with pytest.raises(ValueError, match="CUDA is not available"):
            HFRadixLM(pretrained=str(tmp_path), device="cuda")


@pytest.mark.parametrize("max_length", [1, 2, 3, 7, 16])
def test_rolling_windows_match_lm_eval(max_length: int):
    for n in range(0, 40):
        tokens = list(range(100, 100 + n))
        want = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, max_length, 1)]
        assert rolling_windows(tokens, 7, max_length) == [(list(a), list(b)) for a, b in want]


def test_bf16_error_no_larger_than_hf_backend():
    """Against the same weights in float32, hf-radix's bf16 log-likelihoods err no more than hf's own.

    hf-radix takes the log-softmax of the kept logits in float32 (hf does with softmax_dtype=float32; by
    default it works in the model's dtype and errs several times more).
    """
    pytest.importorskip("accelerate", reason="lm-eval's hf backend needs accelerate")
    tokenizer = tiny_tokenizer()
    fp32 = tiny_model("llama", seed=4, vocab_size=len(tokenizer))
    bf16 = tiny_model("llama", seed=4, vocab_size=len(tokenizer), dtype=torch.bfloat16)
    long = "The quick brown fox jumps over the lazy dog. Question: what is the capital of France? " * 3
    pairs = [(long + "Answer:", c) for c in (" Paris.", " eight", " the lazy dog", " twelve")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]

    def scores(lm) -> np.ndarray:
        return np.array([lp for lp, _ in lm.loglikelihood(requests, disable_tqdm=True)])

    reference = scores(_hf_lm(fp32, tokenizer))
    hf_default = np.abs(scores(_hf_lm(bf16, tokenizer)) - reference).mean()
    hf_fp32_softmax = np.abs(scores(_hf_lm(bf16, tokenizer, softmax_dtype="float32")) - reference).mean()
    ours = np.abs(scores(HFRadixLM(pretrained=bf16, tokenizer=tokenizer, page_size=4)) - reference).mean()
    assert ours <= hf_fp32_softmax * 1.25  # here 0.0013 against 0.0016 nats
    assert ours < hf_default / 5  # 0.029: bf16 log-softmax rounding


def test_help_says_how_to_use_hf_radix(capsys, monkeypatch):
    from hf_radix.lm_eval_backend import main, model_args

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")  # main leaves hf_radix's log level alone
    monkeypatch.setattr(sys, "argv", ["hf-radix-lm-eval"])
    monkeypatch.setattr(model_args, "batch_size_is_cli_default", False)
    for args in (["--help"], []):  # no arguments: the same help
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("hf-radix-lm-eval (or: python -m hf_radix.lm_eval_backend)")
        assert "--model_args pretrained=" in out and "lm_eval --model hf-radix` does not work" in out
        assert "page_size" in out and "usage: lm-eval" in out  # then lm-eval's own help


@pytest.mark.parametrize(
    "batch_size,max_batch_size,cli_default,noted",
    [(None, None, False, False), (4, None, False, True), (None, 64, False, True),
     (1, None, True, False),  # lm-eval's command line passes 1 when no --batch_size was given
     (1, None, False, True), (8, None, True, True)],
)
def test_batch_size_note_only_when_the_user_set_one(
    monkeypatch, batch_size, max_batch_size, cli_default: bool, noted: bool
):
    from hf_radix.lm_eval_backend import model_args

    monkeypatch.setattr(model_args, "batch_size_is_cli_default", cli_default)
    assert model_args.batch_size_set(batch_size, max_batch_size) is noted
