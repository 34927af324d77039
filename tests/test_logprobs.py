"""Chunked target log-probs equal `log_softmax(...).gather(...)` of the whole fp32 copy."""

from __future__ import annotations

import pytest
import torch

from hf_radix.scheduling.logprobs import target_logprobs


def _reference(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor):
    chosen = logits[rows].float()
    logp = chosen.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    return logp, chosen.argmax(-1) == targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_rows", [None, 1, 5, 64])
def test_equals_the_full_log_softmax(dtype: torch.dtype, chunk_rows: int | None):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(40, 3001, generator=gen) * 6).to(dtype)
    rows = torch.randint(0, 40, (57,), generator=gen)
    targets = torch.randint(0, 3001, (57,), generator=gen)
    targets[::4] = logits[rows[::4]].float().argmax(-1)  # some greedy hits
    logp, greedy = target_logprobs(logits, rows, targets, chunk_rows)
    ref_logp, ref_greedy = _reference(logits, rows, targets)
    assert logp.dtype == torch.float32 and logp.shape == (57,)
    assert (logp - ref_logp).abs().max().item() <= 1e-6
    assert torch.equal(greedy, ref_greedy) and greedy.any() and not greedy.all()


def test_extreme_logits_and_ties():
    logits = torch.tensor([[0.0, 0.0, -1e4], [80.0, -80.0, 80.0], [-30.0, -30.0, -30.0]])
    rows = torch.tensor([0, 0, 1, 1, 2])
    targets = torch.tensor([0, 2, 2, 1, 1])
    logp, greedy = target_logprobs(logits, rows, targets)
    ref_logp, ref_greedy = _reference(logits, rows, targets)
    assert torch.allclose(logp, ref_logp, atol=1e-6, rtol=0)
    assert torch.equal(greedy, ref_greedy)


def test_no_rows():
    none = torch.zeros(0, dtype=torch.long)
    logp, greedy = target_logprobs(torch.zeros(3, 7), none, none)
    assert logp.shape == greedy.shape == (0,)
