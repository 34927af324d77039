"""Shared fixtures: tiny random models of several architectures and reference computations."""

from __future__ import annotations

import pytest
import torch

import hf_radix  # noqa: F401  (registers "radix")
from hf_radix.tiny import tiny_model, tiny_tokenizer

torch.set_num_threads(2)

GPU_COMMAND = "python -m pytest -m gpu"
_gpu_deselected: list[int] = []  # GPU tests left out here (from every xdist worker's collection)


def pytest_collection_modifyitems(config, items):
    """Without CUDA, the GPU tests (marker `gpu`) are deselected, not skipped one by one, unless a `-m`
    expression names `gpu`; the run ends with one line saying how many there are and how to run them."""
    if torch.cuda.is_available() or "gpu" in config.option.markexpr:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    _gpu_deselected.append(len(gpu))
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the line
        config.workeroutput["gpu_deselected"] = len(gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller, as each worker finishes
    _gpu_deselected.append(getattr(node, "workeroutput", {}).get("gpu_deselected", 0))


def gpu_note(count: int) -> str:
    return f"{count} GPU tests deselected (no CUDA device here); on a GPU machine run them with {GPU_COMMAND}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _gpu_deselected and max(_gpu_deselected) and not hasattr(config, "workeroutput"):
        terminalreporter.write_line(gpu_note(max(_gpu_deselected)))


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
