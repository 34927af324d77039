"""One packed forward through RadixCache + "radix" attention equals transformers' own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_logits, random_ids

from hf_radix.engine import EngineOptions, RadixEngine
from hf_radix.forward.engine_view import eager_batch
from hf_radix.paged_attention.forward_batch import StepRows

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2"]


def _forward_rows(engine: RadixEngine, rows: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """Forwards rows (row id, all token ids, first new position); returns logits of every new position."""
    manager = engine.manager
    manager.allocate([r for r, _, _ in rows], [len(ids) for _, ids, _ in rows])
    step = StepRows.of(
        [r for r, _, _ in rows],
        [start for _, _, start in rows],
        [np.asarray(ids[start:]) for _, ids, start in rows],
        [np.arange(len(ids) - start) for _, ids, start in rows],
    )
    batch = eager_batch(engine, step)
    logits = engine.forward(batch)
    out, offset = [], 0
    for _, ids, start in rows:
        out.append(logits[offset : offset + len(ids) - start].float())
        offset += len(ids) - start
    return out


def _open(engine: RadixEngine, ids: list[int]) -> tuple[int, int]:
    handle = engine.manager.match(ids)
    engine.manager.lock(handle)
    return engine.manager.open_row(handle), handle.cached_len


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forward_matches_hf(arch: str, page_size: int):
    model = fresh_model(arch)
    engine = RadixEngine(
        model, EngineOptions(page_size=page_size, max_total_tokens=1024, attn_backend="torch")
    )
    gen = torch.Generator().manual_seed(1)
    shared = random_ids(gen, 37)
    a = shared + random_ids(gen, 9)
    b = shared + random_ids(gen, 14)
    c = random_ids(gen, 23)

    # 1. two fresh prefills in one batch (nothing cached)
    row_a, cached_a = _open(engine, a)
    row_c, cached_c = _open(engine, c)
    assert cached_a == cached_c == 0
    got_a, got_c = _forward_rows(engine, [(row_a, a, 0), (row_c, c, 0)])
    torch.testing.assert_close(got_a, hf_logits(model, a), atol=1e-4, rtol=0)
    torch.testing.assert_close(got_c, hf_logits(model, c), atol=1e-4, rtol=0)
    engine.manager.cache_req(row_a, a, len(a), finished=False)
    engine.check_integrity()

    # 2. a prefix hit for b, mixed with a decode row of c and of a
    row_b, cached_b = _open(engine, b)
    assert cached_b == 37 - 37 % page_size
    c_next, a_next = c + [5], a + [7]
    got_b, got_c1, got_a1 = _forward_rows(
        engine, [(row_b, b, cached_b), (row_c, c_next, len(c)), (row_a, a_next, len(a))]
    )
    torch.testing.assert_close(got_b, hf_logits(model, b)[cached_b:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got_c1, hf_logits(model, c_next)[-1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got_a1, hf_logits(model, a_next)[-1:], atol=1e-4, rtol=0)

    for row, ids in [(row_a, a_next), (row_b, b), (row_c, c_next)]:
        engine.manager.cache_req(row, ids, len(ids), finished=True)
    engine.check_integrity()
    assert engine.manager.num_rows == 0
