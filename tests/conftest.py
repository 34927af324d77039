"""Shared fixtures: tiny random models of several architectures and reference computations."""

from __future__ import annotations

import pytest
import torch

import hf_radix  # noqa: F401  (registers "radix")
from hf_radix.tiny import tiny_model, tiny_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


_MODELS: dict[str, torch.nn.Module] = {}


def fresh_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A new tiny fp32 model (no engine attached)."""
    return tiny_model(arch, seed=seed)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` from transformers' own attention, one sequence alone."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Plain `generate` (default cache) on one prompt alone; returns the new tokens."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def random_ids(generator: torch.Generator, length: int, vocab: int = 384) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=generator).tolist()
