"""Deterministic mode on a GPU: 64 requests (greedy and seeded sampling) and their log-likelihoods
bit-identical alone, in a batch of 256, reversed, after a cache warm-up with small prefill chunks, with pages
of 16 in a pool that evicts (eager, no overlap), and through radix `generate` (bench/deterministic.py's
configurations, on a small random bf16 Llama)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import deterministic as det  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def test_requests_identical_across_configurations() -> None:
    model = _model()
    prompts, others, params, pairs = det.workload(model.config.vocab_size, prefix_len=96, suffix_len=(4, 80))
    results = det.configurations(model, prompts, others, params, pairs, pool=65536, small_pool=2048)
    assert len(results) >= 6
    same = det.identical(results)
    assert all(same), [i for i, ok in enumerate(same) if not ok]


@pytest.mark.parametrize("n, k", [(512, 512), (1536, 512), (8192, 512), (384, 1536), (1000, 200)])
def test_linear_rows_identical_under_both_configs(n: int, k: int) -> None:
    """A row's product has the same bits in a decode-sized call (the small tiles) as in a prefill-sized one
    (the large tiles, tensor-memory loads on Hopper), at any place of either."""
    from hf_radix.kernels.triton_invariant_matmul import SMALL_ROWS, invariant_matmul

    torch.manual_seed(0)
    x = torch.randn(3000, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    large = invariant_matmul(x, w, b)
    torch.testing.assert_close(large, torch.nn.functional.linear(x, w, b), atol=2e-2, rtol=2e-2)
    for start, rows in ((0, 1), (7, 1), (100, SMALL_ROWS), (2999, 1), (1000, SMALL_ROWS + 1), (5, 777)):
        assert torch.equal(invariant_matmul(x[start : start + rows], w, b), large[start : start + rows])
