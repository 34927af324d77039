"""Plain-transformers references the tests compare hf_radix with, and a logits processor that raises."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    """Plain `generate`'s greedy continuation of one prompt (`new` tokens, no EOS), on the model's device."""
    t = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_logprob(model, context: list[int], continuation: list[int]) -> float:
    """The log-likelihood of `continuation` after `context` from one plain forward (float32 log-softmax)."""
    ids = torch.tensor([context + continuation], device=model.device)
    with torch.inference_mode():
        logp = model(input_ids=ids).logits[0, len(context) - 1 : -1].float().log_softmax(-1)
    return float(logp.gather(-1, torch.tensor(continuation, device=model.device)[:, None]).sum())


class Boom(RuntimeError):
    """What the raising test hooks raise."""


class RaisingProcessor(LogitsProcessor):
    """Raises on its `at`-th call."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls == self.at:
            raise Boom("raised in a logits processor")
        return scores
