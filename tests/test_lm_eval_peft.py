"""`peft=<adapter directory>` on a local `pretrained` directory: hf-radix scores as lm-eval's `hf` backend.

`hf` loads the base model, puts the PEFT adapter on it and runs it unmerged; hf-radix merges it into the
weights. In float32 the two agree to rounding, sample by sample, and the results JSON records the same
model information (the parameter count of the model with its adapter layers, as `hf` counts it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")
peft = pytest.importorskip("peft", reason="peft is not installed")
hf = pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval's hf backend needs accelerate")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval_helpers import evaluate  # noqa: E402

from hf_radix.lm_eval_backend import HFRadixLM  # noqa: E402
from hf_radix.tiny import tiny_model, tiny_tokenizer  # noqa: E402

ATOL = 1e-4
ADDED = "<tool>"  # a token the adapter adds to the tokenizer (and trains its embedding rows for)
PAIRS = [
    ("", "Paris"),
    ("Question: what is the capital of France? Answer:", " Paris"),
    ("Question: how many legs does a spider have? Answer:", " eight"),
    ("The quick brown fox jumps over the lazy dog.", " The quick brown fox"),
    ("You are a helpful assistant. " + ADDED, " Answer briefly and precisely."),
]
REQUESTS = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]


def _checkpoint(root: Path, added_token: bool) -> tuple[str, str]:
    """A tiny Llama and its tokenizer in `root/base`, a LoRA adapter that changes its outputs in `root/lora`.

    With `added_token`, the tokenizer beside the base has one token more than the model's vocabulary and
    the adapter carries the resized embeddings (`modules_to_save`), as for a fine-tune that added tokens.
    """
    base, adapter = root / "base", root / "lora"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", seed=1).save_pretrained(base)
    model = tiny_model("llama", seed=1)
    extra = {}
    if added_token:
        tokenizer.add_tokens([ADDED])
        model.resize_token_embeddings(len(tokenizer))
        extra["modules_to_save"] = ["embed_tokens", "lm_head"]
    tokenizer.save_pretrained(base)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False,
        **extra,
    )
    with_adapter = peft.get_peft_model(model, config)
    if added_token:  # the embedding rows the fine-tune "trained" for the new token
        for name, param in with_adapter.named_parameters():
            if "modules_to_save" in name:
                torch.nn.init.normal_(param, std=0.02)
    with_adapter.save_pretrained(adapter)
    return str(base), str(adapter)


@pytest.mark.parametrize("added_token", [False, True], ids=["lora", "lora-added-token"])
def test_loglikelihood_with_peft_matches_hf(tmp_path, added_token):
    base, adapter = _checkpoint(tmp_path, added_token)
    args = {"pretrained": base, "peft": adapter, "dtype": "float32", "device": "cpu"}
    ours = HFRadixLM(**args)
    theirs = hf.HFLM(**args, batch_size=4)
    assert isinstance(theirs.model, peft.PeftModel)  # hf runs the adapter unmerged
    got, want = ours.loglikelihood(REQUESTS), theirs.loglikelihood(REQUESTS)
    assert [g for _, g in got] == [g for _, g in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=ATOL)
    ours.runner.check_integrity()

    if not added_token:  # the adapter matters: the base model alone scores otherwise
        plain = HFRadixLM(pretrained=base, dtype="float32", device="cpu").loglikelihood(REQUESTS)
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, plain)) > 100 * ATOL


def test_simple_evaluate_with_peft_matches_hf(tmp_path):
    """Through `simple_evaluate` (model_args as the command line gives them): samples and model info."""
    base, adapter = _checkpoint(tmp_path, added_token=False)
    args = f"pretrained={base},peft={adapter},dtype=float32,device=cpu,max_length=128"
    radix = evaluate("hf-radix", args, ["hf_radix_tiny_mc"], limit=4)
    ref = evaluate("hf", args + ",batch_size=4", ["hf_radix_tiny_mc"], limit=4)
    for key in ("model_num_parameters", "model_dtype", "model_revision", "model_sha", "peft_sha"):
        assert radix["config"][key] == ref["config"][key], key
    assert radix["config"]["hf_radix_reuse"]["cached_tokens"] > 0
    ours, theirs = radix["samples"]["hf_radix_tiny_mc"], ref["samples"]["hf_radix_tiny_mc"]
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert a["arguments"] == b["arguments"]
        assert [g for _, g in a["filtered_resps"]] == [g for _, g in b["filtered_resps"]]
        got, want = [lp for lp, _ in a["filtered_resps"]], [lp for lp, _ in b["filtered_resps"]]
        assert got == pytest.approx(want, abs=ATOL)


def test_peft_on_a_model_object_is_refused(tmp_path):
    """`hf` ignores `peft` on a model object (it only adapts models it loads): hf-radix says so."""
    with pytest.raises(ValueError, match="peft needs `pretrained` as a hub id or local directory"):
        HFRadixLM(pretrained=tiny_model("llama"), tokenizer=tiny_tokenizer(), peft=str(tmp_path))
