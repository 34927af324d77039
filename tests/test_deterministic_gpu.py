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
def test_linear_rows_identical_under_every_config(n: int, k: int) -> None:
    """A row's product has the same bits whatever launch config the call's shape picks (decode-sized and
    prefill-sized calls, tensor-memory loads on Hopper) and under every candidate config, at any place."""
    from hf_radix.kernels.triton_invariant_matmul import candidate_configs, invariant_matmul

    torch.manual_seed(0)
    x = torch.randn(3000, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    large = invariant_matmul(x, w, b)
    torch.testing.assert_close(large, torch.nn.functional.linear(x, w, b), atol=2e-2, rtol=2e-2)
    for start, rows in ((0, 1), (7, 1), (3, 16), (100, 64), (40, 200), (2999, 1), (1000, 257), (5, 777)):
        assert torch.equal(invariant_matmul(x[start : start + rows], w, b), large[start : start + rows])
    for config in candidate_configs(torch.bfloat16, x.device):
        assert torch.equal(invariant_matmul(x, w, b, config=config), large), config
        assert torch.equal(invariant_matmul(x[9:10], w, b, config=config), large[9:10]), config


@pytest.mark.parametrize("group, head_dim, window", [(4, 128, None), (8, 64, 1500), (1, 80, None)])
def test_split_decode_matches_extend_over_many_pieces(group: int, head_dim: int, window: int | None) -> None:
    """Decode rows whose contexts span several pieces (a 2,600-token shared prefix: two whole shared pieces
    and a boundary piece; a lone 20,000-token row), grouped in tiles, alone, and the same queries in a
    prefill: bit-identical."""
    import numpy as np

    from hf_radix.kernels.triton_invariant_attention import invariant_attention
    from hf_radix.kernels.triton_split_decode import split_decode_attention, tile_shape
    from hf_radix.paged_attention.grouped_decode import build_decode_tiles

    torch.manual_seed(group)
    hkv, rows, shared = 2, 40, 2600
    kw = {"sliding_window": window, "sinks": torch.randn(hkv * group, device="cuda")}
    kc = torch.randn(60000, hkv, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(60000, device="cuda")
    contexts = [perm[:shared].tolist() + perm[shared + 300 * i : shared + 300 * i + 1 + 7 * i].tolist()
                for i in range(rows)]
    contexts[-1] = perm[40000 - 20000 : 40000].tolist()  # a lone long row, sharing nothing
    q = torch.randn(rows, hkv * group, head_dim, device="cuda", dtype=torch.bfloat16)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    kv = torch.tensor([s for c in contexts for s in c], device="cuda")
    indptr = i32(np.cumsum([0] + [len(c) for c in contexts]).tolist())
    extend = invariant_attention(q, kc, vc, i32(list(range(rows + 1))), kv, indptr, 0.3, **kw)
    per_tile, piece = tile_shape(hkv * group, hkv, head_dim, q.device)
    tables = build_decode_tiles(np.r_[np.zeros(rows - 1), -1], np.r_[np.full(rows - 1, shared), 0], per_tile,
                                piece)
    tiles = tuple(torch.from_numpy(t).cuda() for t in tables)
    grouped = split_decode_attention(q, kc, vc, kv, indptr, 0.3, tiles=tiles, **kw)
    assert torch.equal(grouped, extend)
    assert torch.equal(split_decode_attention(q, kc, vc, kv, indptr, 0.3, **kw), extend)
    for i in (0, 17, rows - 1):
        alone = split_decode_attention(q[i : i + 1], kc, vc, torch.tensor(contexts[i], device="cuda"),
                                       i32([0, len(contexts[i])]), 0.3, **kw)
        assert torch.equal(alone[0], extend[i]), i
        new = 333  # the row's query last of a prefill chunk
        chunk = torch.cat([torch.randn(new - 1, *q.shape[1:], device="cuda", dtype=q.dtype), q[i : i + 1]])
        prefill = invariant_attention(chunk, kc, vc, i32([0, new]), torch.tensor(contexts[i], device="cuda"),
                                      i32([0, len(contexts[i])]), 0.3, **kw)
        assert torch.equal(prefill[-1], extend[i]), i
