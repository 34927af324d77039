"""The test command itself: without CUDA the GPU tests are deselected; one line says how to run them."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import torch


class _Item:
    def __init__(self, name: str, gpu: bool):
        self.name, self.gpu = name, gpu

    def get_closest_marker(self, name: str):
        return object() if name == "gpu" and self.gpu else None


def _collect(monkeypatch, cuda: bool, markexpr: str = "") -> tuple[list[str], list[str], list[int]]:
    """(kept, deselected, counts recorded for the closing line) after conftest's collection hook."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    recorded: list[int] = []
    monkeypatch.setattr(conftest, "_gpu_deselected", recorded)
    deselected: list = []
    config = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr),
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
    )
    items = [_Item("cpu_a", False), _Item("gpu_a", True), _Item("cpu_b", False), _Item("gpu_b", True)]
    conftest.pytest_collection_modifyitems(config, items)
    return [i.name for i in items], [i.name for i in deselected], recorded


def test_gpu_tests_are_deselected_without_cuda(monkeypatch):
    for markexpr in ("", "not slow"):  # the two runs of scripts/test.sh
        kept, deselected, recorded = _collect(monkeypatch, cuda=False, markexpr=markexpr)
        assert kept == ["cpu_a", "cpu_b"] and deselected == ["gpu_a", "gpu_b"] and recorded == [2]
    note = conftest.gpu_note(2)
    assert note.startswith("2 GPU tests deselected") and note.endswith("python -m pytest -m gpu")


def test_gpu_tests_stay_with_cuda_or_an_explicit_marker_expression(monkeypatch):
    everything = ["cpu_a", "gpu_a", "cpu_b", "gpu_b"]
    assert _collect(monkeypatch, cuda=True) == (everything, [], [])
    assert _collect(monkeypatch, cuda=False, markexpr="gpu") == (everything, [], [])  # skipped, with reasons
