"""Host side of shared-prefix attention: rows grouped by tree node, tile tables, cost rule, static buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.paged_attention.prefix_groups import (
    SharedPrefixBuffers,
    SharedPrefixCost,
    SharedPrefixPlan,
    build_shared_prefix_plan,
)

pytestmark = pytest.mark.slow  # no transformers version changes what this tests: run once

LLAMA_BF16 = SharedPrefixCost(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, prefix_parts=4)


ALWAYS = SharedPrefixCost(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, keep_all=True)


def plan_of(node_ids, shared_lens, seq_lens, new_lens=None, cost=LLAMA_BF16, **kw) -> SharedPrefixPlan:
    seq = np.asarray(seq_lens)
    starts = np.concatenate([[0], np.cumsum(seq)[:-1]])
    return build_shared_prefix_plan(np.asarray(node_ids), np.asarray(shared_lens), starts, seq, new_lens,
                                    cost=cost, **kw)


def test_groups_by_node_in_order_of_appearance_and_rows_alone() -> None:
    seq = [300, 40, 310, 600, 700, 305, 90]
    plan = plan_of([7, -1, 7, 3, 3, 7, 9], [256, 0, 256, 512, 512, 256, 64], seq, page_size=64)
    starts = np.concatenate([[0], np.cumsum(seq)[:-1]])
    assert plan.row_group.tolist() == [0, 2, 0, 1, 1, 0, 3]  # node 9 has one row: a row alone
    assert plan.group_prefix_len.tolist() == [256, 512, 0, 0] and plan.num_shared_groups == 2
    assert plan.group_kv_start.tolist() == [starts[0], starts[3], starts[1], starts[6]]
    assert plan.group_rows.tolist() == [0, 2, 5, 3, 4, 1, 6]
    assert plan.group_row_indptr.tolist() == [0, 3, 5, 6, 7]
    assert plan.row_suffix_start.tolist() == (starts + [256, 0, 256, 512, 512, 256, 0]).tolist()
    assert plan.row_suffix_len.tolist() == [44, 40, 54, 88, 188, 49, 90]
    # decode: one prefix tile per group (32 rows fit in 128 M rows), one suffix tile per row
    assert plan.prefix_tiles.tolist() == [[starts[0], 0, 256, 0, 3], [starts[3], 0, 512, 3, 2]]
    assert plan.prefix_queries.tolist() == [0, 2, 5, 3, 4]
    assert plan.suffix_tile_q == 1 and plan.prefix_tile_q == 32
    assert plan.suffix_tiles[:, 0].tolist() == plan.row_suffix_start.tolist()
    assert plan.suffix_tiles[:, 1].tolist() == [256, 0, 256, 512, 512, 256, 0]
    assert plan.suffix_tiles[:, 3].tolist() == list(range(7)) and (plan.suffix_tiles[:, 4] == 1).all()
    assert plan.query_pos.tolist() == [s - 1 for s in seq]
    assert plan.query_shared.tolist() == [256, 0, 256, 512, 512, 256, 0]
    assert plan.gain_s > 0 and not plan.use_shared  # too small a batch to pay for one more launch


def test_extend_tiles_chunk_each_group_and_row() -> None:
    cost = SharedPrefixCost(8, 2, 64, 2, tile_rows=16, keep_all=True)  # 4 queries a tile
    # rows: (seq, new) = (30, 6), (25, 0), (28, 3); all behind node 1 (shared 16), then a row alone (10, 5)
    plan = plan_of([1, 1, 1, -1], [16, 16, 16, 0], [30, 25, 28, 10], [6, 0, 3, 5], cost=cost)
    assert plan.prefix_tile_q == 4 and plan.suffix_tile_q == 4
    assert plan.prefix_queries.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert plan.prefix_tiles[:, 2:].tolist() == [[16, 0, 4], [16, 4, 4], [16, 8, 1]]
    assert plan.suffix_tiles[:, 1:].tolist() == [[16, 14, 0, 4], [16, 14, 4, 2], [16, 12, 6, 3],
                                                 [0, 10, 9, 4], [0, 10, 13, 1]]
    assert plan.query_pos.tolist() == [24, 25, 26, 27, 28, 29, 25, 26, 27, 5, 6, 7, 8, 9]
    assert plan.query_shared.tolist() == [16] * 9 + [0] * 5


@pytest.mark.parametrize(
    "node_ids,shared,seq,new,match",
    [
        ([1, 1], [16, 32], [40, 40], None, "same shared prefix length"),
        ([1, 1], [40, 40], [40, 40], None, "within the row's cached tokens"),
        ([1, 1], [12, 12], [40, 40], None, "multiples of the page size"),
        ([1], [0], [4], [5], "new_lens <= seq_lens"),
        ([1, 2], [0], [4, 4], None, "one entry per row"),
    ],
)
def test_bad_input_is_refused(node_ids, shared, seq, new, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_of(node_ids, shared, seq, new, page_size=8)


def test_rows_claiming_one_node_must_hold_its_slots() -> None:
    slots = np.arange(100)
    seq = np.array([40, 40])
    with pytest.raises(ValueError, match="same slots"):
        build_shared_prefix_plan(np.array([4, 4]), np.array([32, 32]), np.array([0, 40]), seq, cost=ALWAYS,
                                 slots=slots)
    slots[40:72] = slots[0:32]
    plan = build_shared_prefix_plan(np.array([4, 4]), np.array([32, 32]), np.array([0, 40]), seq, cost=ALWAYS,
                                    slots=slots)
    assert plan.num_shared_groups == 1


def test_cost_rule() -> None:
    gsp = plan_of(np.repeat(np.arange(8), 32), [2048] * 256, [2048 + 256] * 256)
    assert gsp.use_shared and gsp.num_shared_groups == 8
    # per-row 256 x 2,304 tokens vs 8 x 2,048 + 256 x 256: most of the K/V traffic is saved
    assert gsp.gain_s > 0.7 * 256 * 2048 * 4096 / LLAMA_BF16.bandwidth
    # short prefixes and groups of one gain nothing: per-row attention
    short = plan_of([1, 1, 2, 2], [16] * 4, [300] * 4, page_size=16)
    assert short.num_shared_groups == 0 and not short.use_shared
    alone = plan_of([1, 2, 3, -1], [512, 512, 512, 0], [600] * 4)
    assert alone.num_shared_groups == 0 and not alone.use_shared and len(alone.prefix_tiles) == 0
    assert alone.row_suffix_len.tolist() == [600] * 4
    # extend: rows with few new tokens behind a long prefix share it; full per-row tiles of new tokens
    # over a short prefix do not
    few = plan_of([0] * 32, [1536] * 32, [1536 + 8] * 32, [8] * 32)
    assert few.use_shared
    many = plan_of([0] * 4, [128] * 4, [128 + 512] * 4, [512] * 4)
    assert not many.use_shared


@st.composite
def batches(draw):
    rows = draw(st.integers(1, 12))
    page = draw(st.sampled_from([1, 4]))
    node = draw(st.lists(st.integers(-1, 3), min_size=rows, max_size=rows))
    node_pages = {n: draw(st.integers(0, 5)) for n in range(4)}
    shared = [node_pages[n] * page if n >= 0 else 0 for n in node]
    cached = [s + draw(st.integers(0, 6)) for s in shared]
    new = draw(st.lists(st.integers(0, 9), min_size=rows, max_size=rows))
    tile_rows = draw(st.sampled_from([4, 8, 16]))
    return node, shared, np.array(cached) + np.array(new), new, page, tile_rows


@settings(max_examples=60, deadline=None)
@given(batches())
def test_tiles_cover_each_query_once_and_fit_static_buffers(batch) -> None:
    node, shared, seq, new, page, tile_rows = batch
    cost = SharedPrefixCost(4, 2, 16, 4, tile_rows=tile_rows, keep_all=True)
    plan = plan_of(node, shared, seq, new, cost=cost, page_size=page)
    new = np.asarray(new)
    tokens = int(new.sum())
    qo = np.concatenate([[0], np.cumsum(new)])
    starts = np.concatenate([[0], np.cumsum(seq)[:-1]])
    # suffix tiles: every query token exactly once, each tile within one row, over the row's own suffix
    covered = []
    for kv_start, pos0, kv_len, q_start, q_len in plan.suffix_tiles:
        toks = np.arange(q_start, q_start + q_len)  # a suffix tile's queries are consecutive tokens
        row = np.searchsorted(qo, toks[0], side="right") - 1
        assert ((toks >= qo[row]) & (toks < qo[row + 1])).all() and 0 < q_len <= plan.suffix_tile_q
        assert (kv_start, pos0, kv_len) == (starts[row] + pos0, plan.query_shared[toks[0]], seq[row] - pos0)
        covered += toks.tolist()
    assert sorted(covered) == list(range(tokens))
    # prefix tiles: every token of a shared group exactly once, within its group, over the group's prefix
    covered = []
    for kv_start, pos0, kv_len, q_start, q_len in plan.prefix_tiles:
        toks = plan.prefix_queries[q_start:q_start + q_len]
        rows = np.searchsorted(qo, toks, side="right") - 1
        assert len(set(plan.row_group[rows])) == 1 and pos0 == 0 and 0 < q_len <= plan.prefix_tile_q
        assert kv_len == plan.query_shared[toks[0]] > 0
        assert kv_start == plan.group_kv_start[plan.row_group[rows[0]]]
        covered += toks.tolist()
    assert sorted(covered) == [t for t in range(tokens) if plan.query_shared[t] > 0]
    assert ((plan.query_shared > 0) <= (np.asarray(node)[np.repeat(np.arange(len(new)), new)] >= 0)).all()
    # static buffers sized by (rows, tokens) hold any such batch
    buffers = SharedPrefixBuffers(len(new), max(1, tokens), plan.prefix_tile_q, plan.suffix_tile_q, "cpu")
    buffers.load(plan)
    assert buffers.suffix_tiles[:len(plan.suffix_tiles)].numpy().tolist() == plan.suffix_tiles.tolist()
    assert not buffers.suffix_tiles[len(plan.suffix_tiles):].any()


def test_buffers_pad_refill_and_refuse_overflow() -> None:
    big = plan_of([0] * 6, [64] * 6, [80] * 6)
    small = plan_of([0, 0], [64, 64], [70, 75])
    buffers = SharedPrefixBuffers(8, 8, big.prefix_tile_q, big.suffix_tile_q, torch.device("cpu"))
    buffers.load(big)
    buffers.load(small)  # stale rows of the bigger batch are cleared
    assert buffers.suffix_tiles[:2].tolist() == small.suffix_tiles.tolist()
    assert not buffers.suffix_tiles[2:].any() and not buffers.prefix_tiles[1:].any()
    assert buffers.query_pos[:2].tolist() == [69, 74] and not buffers.query_pos[2:].any()
    with pytest.raises(ValueError, match="capacity"):
        SharedPrefixBuffers(2, 2, big.prefix_tile_q, 1, "cpu").load(big)
    with pytest.raises(ValueError, match="queries"):
        SharedPrefixBuffers(8, 8, 4, 1, "cpu").load(big)
    exact = SharedPrefixBuffers.from_plan(big, "cpu")
    assert exact.prefix_tiles[:1].tolist() == big.prefix_tiles.tolist() and not exact.prefix_tiles[1:].any()
