"""Deterministic mode's split decode: the tile tables (host), and (Triton interpreter, one subprocess, with
the row-uniform dot of `test_deterministic`) the decode kernels, rows alone, grouped and at every place of a
tile, against the extend kernel bit for bit over contexts of several pieces, and against a plain softmax."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from interpreter import interpreter_test, report_checks
from test_deterministic import _row_uniform_dot

from hf_radix.paged_attention.grouped_decode import build_decode_tiles


def test_tiles_pack_groups_and_leave_the_rest_alone() -> None:
    nodes = np.array([0, 1, 0, -1, 0, 2, 0, 0, 1])
    lens = np.array([32, 64, 32, 0, 32, 8, 32, 32, 64])
    rows, pieces, row_pieces = build_decode_tiles(nodes, lens, rows_per_tile=2, piece=16)
    assert rows.tolist() == [[0, 2], [4, 6], [7, -1], [1, 8], [3, -1], [5, -1]]
    assert pieces.tolist() == [2, 2, 2, 4, 0, 0]  # node 2's prefix holds no whole piece: rows alone
    assert row_pieces.tolist() == [2, 4, 2, 0, 2, 0, 2, 2, 4]
    assert rows.dtype == pieces.dtype == row_pieces.dtype == np.int32
    rows, pieces, row_pieces = build_decode_tiles(np.full(3, -1), np.zeros(3), 4, 16)
    assert rows.tolist() == [[0, -1, -1, -1], [1, -1, -1, -1], [2, -1, -1, -1]]
    assert not pieces.any() and not row_pieces.any()


# --------------------------------------------------------------------------------------------------------
# Interpreter checks (one TRITON_INTERPRET=1 subprocess)
# --------------------------------------------------------------------------------------------------------


def _contexts(shared: int, own: list[int], page: int, pool: int, gen: torch.Generator) -> list[list[int]]:
    """Slot lists of rows whose first ``shared`` positions hold the same slots, then ``own[i]`` of their own
    (pages of ``page`` slots at random places; the shared part ends on a page boundary when paged)."""
    pages = torch.randperm(pool // page, generator=gen).tolist()

    def take(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            first = pages.pop() * page
            out += range(first, first + page)
        return out[:n]

    prefix = take(shared)
    return [prefix + take(n) for n in own]


def _launch(contexts, q, kc, vc, tables, cfg, **kw) -> torch.Tensor:
    from hf_radix.kernels.triton_split_decode import split_decode_attention

    kv = torch.tensor([s for c in contexts for s in c])
    indptr = torch.tensor(np.cumsum([0] + [len(c) for c in contexts]), dtype=torch.int32)
    if tables is not None:
        tables = tuple(torch.from_numpy(np.asarray(t, dtype=np.int32)) for t in tables)
    return split_decode_attention(q, kc, vc, kv, indptr, 0.3, tiles=tables, config=cfg, **kw)


def _per_row(contexts, q, kc, vc, cfg, **kw) -> torch.Tensor:
    from hf_radix.kernels.triton_invariant_attention import invariant_attention

    kv = torch.tensor([s for c in contexts for s in c])
    indptr = torch.tensor(np.cumsum([0] + [len(c) for c in contexts]), dtype=torch.int32)
    qo = torch.arange(len(contexts) + 1, dtype=torch.int32)
    return invariant_attention(q, kc, vc, qo, kv, indptr, 0.3, config=cfg, **kw)


def check_kernel(group: int, head_dim: int, shared: int, page: int = 1, window: int | None = None,
                 softcap: float | None = None, sinks: bool = False, config: dict | None = None) -> dict:
    """16 decode rows of 1 to about 200 keys, sharing ``shared`` positions: grouped (as the planner tiles
    them), each alone, in no tile, each at a tile's first, second, middle and last place among others, and
    the shared pieces computed by tiles of one row, all bit-identical to the extend kernel's (its tiles at
    other places, other pieces merged beside) and to each row's own extend result."""
    from hf_radix.kernels.triton_invariant_attention import invariant_config

    _row_uniform_dot()
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + shared)
    cfg = config or invariant_config(head_dim, torch.device("cpu"))
    per_tile, piece = cfg["BLOCK_M"] // group, cfg["PIECE"]
    hkv, rows = 2, 16
    own = [1 + (37 * i) % (200 - shared) for i in range(rows)]
    own[3] = 1  # the new token alone past the shared prefix
    contexts = _contexts(shared, own, page, 4096, gen)
    kc, vc = torch.randn(4096, hkv, head_dim, generator=gen), torch.randn(4096, hkv, head_dim, generator=gen)
    q = torch.randn(rows, hkv * group, head_dim, generator=gen)
    kw = {"sliding_window": window, "softcap": softcap,
          "sinks": torch.randn(hkv * group, generator=gen) if sinks else None}
    ref = _per_row(contexts, q, kc, vc, cfg, **kw)
    for i in (0, 3, 15):
        assert torch.equal(_per_row(contexts[i:i + 1], q[i:i + 1], kc, vc, cfg, **kw)[0], ref[i]), i
        assert torch.equal(_launch(contexts[i:i + 1], q[i:i + 1], kc, vc, None, cfg, **kw)[0], ref[i]), i

    grouped = build_decode_tiles(np.zeros(rows), np.full(rows, shared), per_tile, piece)
    assert torch.equal(_launch(contexts, q, kc, vc, grouped, cfg, **kw), ref)
    assert torch.equal(_launch(contexts, q, kc, vc, None, cfg, **kw), ref)
    pieces = shared // piece
    alone = np.full((rows, per_tile), -1)
    alone[:, 0] = np.arange(rows)
    assert torch.equal(_launch(contexts, q, kc, vc, (alone, np.full(rows, pieces), np.full(rows, pieces)),
                               cfg, **kw), ref)
    for i in (0, 3):
        others = [r for r in range(rows) if r != i][: per_tile - 1]
        for place in sorted({0, 1, per_tile // 2, per_tile - 1} & set(range(per_tile))):  # edges and middle
            tile = others[:place] + [i] + others[place:]
            rest = [r for r in range(rows) if r not in tile]
            table = np.full((1 + len(rest), per_tile), -1)
            table[0, : len(tile)] = tile
            table[1:, 0] = rest
            row_pieces = np.where(np.isin(np.arange(rows), tile), pieces, 0)
            tables = (table, np.r_[pieces, np.zeros(len(rest))], row_pieces)
            assert torch.equal(_launch(contexts, q, kc, vc, tables, cfg, **kw), ref), (i, place)
    prefill = _prefill_row(contexts[0], q[0], kc, vc, cfg, **kw)  # the row's query among earlier ones
    assert torch.equal(prefill, ref[0])
    return {"ok": True, "tiles": len(grouped[0]), "pieces": -(-max(map(len, contexts)) // piece)}


def _prefill_row(context, query, kc, vc, cfg, **kw) -> torch.Tensor:
    """The last query's output among ``len(context) // 3 + 1`` new tokens (the others random)."""
    from hf_radix.kernels.triton_invariant_attention import invariant_attention

    new = len(context) // 3 + 1
    q = torch.cat([torch.randn(new - 1, *query.shape), query[None]])
    qo = torch.tensor([0, new], dtype=torch.int32)
    indptr = torch.tensor([0, len(context)], dtype=torch.int32)
    return invariant_attention(q, kc, vc, qo, torch.tensor(context), indptr, 0.3, config=cfg, **kw)[-1]


def check_reference() -> dict:
    """The grouped kernel against a plain softmax over the rows' contexts (windows, caps, sinks)."""
    _row_uniform_dot()
    from hf_radix.attention import TorchBackend

    gen = torch.Generator().manual_seed(3)
    contexts = _contexts(40, [5, 57, 1, 130], 1, 512, gen)
    kc, vc = torch.randn(512, 2, 32, generator=gen), torch.randn(512, 2, 32, generator=gen)
    q = torch.randn(4, 8, 32, generator=gen)
    sinks = torch.randn(8, generator=gen)
    tables = build_decode_tiles(np.zeros(4), np.full(4, 40), 4, 32)

    class Batch:
        batch_size = 4
        qo_indptr_host = np.arange(5)
        seq_lens_host = np.array([len(c) for c in contexts])
        kv_indices = torch.tensor([s for c in contexts for s in c])

    for window, softcap in ((None, None), (9, 5.0), (30, None), (70, None)):
        out = _launch(contexts, q, kc, vc, tables, None, sliding_window=window, softcap=softcap, sinks=sinks)
        ref = TorchBackend().forward(q, None, None, kc, vc, Batch, 0.3, window, softcap, sinks)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    return {"ok": True}


GPU_SHAPE = {"BLOCK_M": 64, "BLOCK_N": 64, "PIECE": 64, "num_warps": 4, "num_stages": 2}

CHECKS = {
    "reference": check_reference,
    "group1": lambda: check_kernel(1, 64, 37),
    "group4_window_paged": lambda: check_kernel(4, 64, 48, page=16, window=20),
    "group4_one_piece_shared": lambda: check_kernel(4, 64, 32, page=4, window=75),
    "group8_softcap_sinks": lambda: check_kernel(8, 128, 9, softcap=5.0, sinks=True),
    "group4_head80_window": lambda: check_kernel(4, 80, 100, window=45, sinks=True),
    "group8_gpu_tiles": lambda: check_kernel(8, 64, 130, page=4, window=70, config=GPU_SHAPE),
}

test_triton_interpreter = pytest.mark.slow(interpreter_test(__file__, CHECKS))

if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)
