"""CI matrix: every architecture family is exact against transformers or refused before its first forward.

`model_matrix.check_architecture` asserts exactness (runner greedy tokens, generate tokens and every step's
logits, log-likelihoods) for the supported ones; a family that is neither fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from model_matrix import ARCHITECTURES, architecture_table, check_architecture
from transformers.models.falcon.modeling_falcon import FalconAttention

from hf_radix.capability import _attention_call_keywords
from hf_radix.hybrid_layers import cache_state_api

REFUSED = {"Bloom", "GPTNeo", "Mpt", "Mamba", "Jamba", "MiniMax", "RecurrentGemma", "Mamba2",
           "Llava"}
#: exact where the state layers use the Cache API (5.24), else refused
HYBRID = {"Qwen3Next", "FalconH1", "Qwen3_5", "Qwen3_5Moe", "Qwen3_5VL", "NemotronH", "GraniteMoeHybrid",
          "Bamba", "Lfm2", "Lfm2Moe"}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
_results: dict[str, dict] = {}


def _expected(name: str) -> str:
    if name == "GPTJ" and not getattr(transformers.GPTJForCausalLM, "_supports_attention_backend", False):
        return "refused"  # before transformers moved GPT-J to the attention interface (e.g. 5.17)
    if name == "Falcon" and _attention_call_keywords(FalconAttention) is None:
        return "refused"  # before 5.25 FalconAttention computed attention itself
    if name in HYBRID and not cache_state_api():
        return "refused"
    return "refused" if name in REFUSED else "exact"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_is_exact_or_refused(name: str):
    page_size = 16 if list(ARCHITECTURES).index(name) % 2 else 1
    result = check_architecture(name, page_size=page_size)
    _results[name] = result
    assert result["status"] == _expected(name), result
    if result["status"] == "refused":
        assert result["reason"] and result["model_class"]


def test_docs_table_is_generated_from_this_matrix():
    if len(_results) != len(ARCHITECTURES):
        pytest.skip("needs the whole matrix in this session")
    docs = DOCS.read_text()
    if f"transformers {transformers.__version__})" not in docs:
        pytest.skip(f"docs/architectures.md comes from another transformers than {transformers.__version__}")
    assert architecture_table({name: _results[name] for name in ARCHITECTURES}) == docs, (
        "docs/architectures.md is stale: run `python tests/model_matrix.py`"
    )
