"""Shared-prefix attention in decode steps: groups from the tree, plans kept across steps, the runner and
generate with it on (Triton kernels under TRITON_INTERPRET=1 in a subprocess) equal to HF.

Host checks (no kernels): rows are grouped by the deepest node of their locked paths that another row
passes; the plan is rebuilt only when the batch's rows (or their locks) change, and the device refresh of
each step gives the tables a fresh plan of that step would have. Interpreter checks: the batch runner
(decode graphs run padded on the CPU, and eager decode) and `generate` with shared-prefix attention forced
on (the cost rule keeps every group) give HF's greedy tokens with page sizes 1 and 4, several groups, rows
joining and finishing; a row's decode logits do not depend on the other rows of its batch.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids
from interpreter import interpreter_test, report_checks

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.engine import EngineOptions, RadixEngine
from hf_radix.forward.cuda_graph import DecodeGraphs
from hf_radix.memory.radix_tree import RadixPrefixCache
from hf_radix.paged_attention.forward_batch import StepRows, build_forward_batch
from hf_radix.paged_attention.prefix_groups import SharedPrefixBuffers, build_shared_prefix_plan
from hf_radix.paged_attention.shared_decode import SharedPrefixDecode, decode_cost, prefix_splits, tree_groups

# --------------------------------------------------------------------------------------------------------
# Host: grouping, plans kept across steps, the device refresh
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_groups_pick_the_deepest_node_shared_in_the_batch(page_size: int):
    tree = RadixPrefixCache(page_size)
    gen = np.random.default_rng(0)
    ids = lambda n: gen.integers(2, 300, n)  # noqa: E731
    s1, s2, t = ids(4 * page_size), ids(3 * page_size), ids(2 * page_size)
    seqs = [np.r_[s1, t, ids(2 * page_size)], np.r_[s1, t, ids(page_size)], np.r_[s1, ids(3 * page_size)],
            np.r_[s2, ids(page_size)], np.r_[s2, ids(2 * page_size)], ids(5 * page_size)]
    handles, used = [], 0
    for seq in seqs:
        _, handle = tree.insert_prefix(seq, np.arange(used, used + len(seq)))
        used += len(seq) + page_size
        handles.append(handle)
    nodes, lens = tree_groups([*handles, None])
    assert nodes[0] == nodes[1] and lens[0] == lens[1] == len(s1) + len(t)  # the deeper shared node
    assert nodes[2] >= 0 and nodes[2] != nodes[0] and lens[2] == len(s1)  # alone at s1: the plan drops it
    assert nodes[3] == nodes[4] and lens[3] == len(s2) and nodes[3] not in (nodes[0], nodes[2])
    assert (nodes[5], lens[5]) == (-1, 0) and (nodes[6], lens[6]) == (-1, 0)  # shares nothing; padding
    same = tree.match_prefix(np.r_[s1, t, ids(page_size)])  # generate: rows matched to one node
    nodes, lens = tree_groups([same, same])
    assert nodes[0] == nodes[1] >= 0 and lens[0] == len(s1) + len(t)


def test_prefix_splits_fill_at_most_one_wave():
    assert prefix_splits(8, 8, 2048, 132) == 2  # gsp-8x32: 64 programs
    assert prefix_splits(16, 8, 1024, 132) == 1
    assert prefix_splits(1, 2, 4096, 132) == 8  # capped
    assert prefix_splits(1, 1, 300, 132) == 2  # at least 256 keys a split


def _decode_rows(engine: RadixEngine, prompts: list[list[int]]) -> list[int]:
    """Page-table rows of prefilled prompts (inserted in the tree, locked), as the runner leaves them."""
    manager, rows = engine.manager, []
    for ids in prompts:
        handle = manager.match(ids)
        manager.lock(handle)
        row = manager.open_row(handle)
        manager.allocate([row], [len(ids) + 8])
        manager.cache_req(row, ids, len(ids), finished=False)
        rows.append(row)
    return rows


@pytest.mark.parametrize("page_size", [1, 4])
def test_plan_is_kept_while_rows_decode_and_refreshed_on_the_device(page_size: int):
    engine = RadixEngine(fresh_model("llama"), EngineOptions(attn_backend="torch", max_total_tokens=1024,
                                                             page_size=page_size))
    gen = torch.Generator().manual_seed(1)
    systems = [random_ids(gen, 6 * page_size + 1), random_ids(gen, 3 * page_size + 2)]
    prompts = [systems[i % 2] + random_ids(gen, 2 + 3 * i) for i in range(5)] + [random_ids(gen, 7)]
    rows = np.array(_decode_rows(engine, prompts))
    cost = dataclasses.replace(decode_cost(engine), keep_all=True)
    shared = SharedPrefixDecode(engine, cost, max_rows=8)
    lens = np.array([len(p) for p in prompts])
    for k in range(3):  # three decode steps: one plan, the device refresh follows the lengths
        step = StepRows(rows=rows, prefix_lens=lens + k, new_lens=np.ones(len(rows), dtype=np.int64),
                        input_ids=np.zeros(len(rows), dtype=np.int64))
        share = shared.share(step)
        assert share is not None and shared.plans == 1 and shared.steps == k + 1
        batch = build_forward_batch(engine.manager.table, step, context=True)
        share.refresh(batch.kv_indptr, batch.seq_lens)
        node_ids, shared_lens = tree_groups([engine.manager.row_handle(r) for r in rows])
        seq = lens + k + 1
        plan = build_shared_prefix_plan(node_ids, shared_lens, np.cumsum(seq) - seq, seq, cost=cost,
                                        page_size=page_size, suffix_tile_q=1,
                                        slots=batch.kv_indices.numpy())
        assert plan.num_shared_groups == 2
        fresh = SharedPrefixBuffers.from_plan(plan, "cpu")
        got = share.buffers
        for name in ("prefix_tiles", "suffix_tiles", "query_pos", "query_shared", "prefix_queries"):
            n = len(getattr(fresh, name))
            assert torch.equal(getattr(got, name)[:n], getattr(fresh, name)), name
    step = dataclasses.replace(step, rows=rows[::-1].copy(), prefix_lens=step.prefix_lens[::-1].copy())
    shared.share(step)  # the same rows in another order: a new plan
    assert shared.plans == 2
    default = SharedPrefixDecode(engine, decode_cost(engine), max_rows=8)
    assert default.share(step) is None  # tiny shapes: the cost rule picks per-row attention


def test_share_compares_locks_only_after_one_moved(monkeypatch):
    """A step with the rows and locks of the last one reads no row's lock (O(1)); a lock moving elsewhere
    makes it compare them (same plan); a lock of the batch moving makes a new plan."""
    engine = RadixEngine(fresh_model("llama"), EngineOptions(attn_backend="torch", max_total_tokens=1024))
    gen = torch.Generator().manual_seed(2)
    system = random_ids(gen, 9)
    prompts = [system + random_ids(gen, 3 + i) for i in range(4)]
    rows = np.array(_decode_rows(engine, prompts))
    shared = SharedPrefixDecode(engine, dataclasses.replace(decode_cost(engine), keep_all=True), max_rows=8)
    manager, read = engine.manager, []
    real = manager.row_handle
    monkeypatch.setattr(manager, "row_handle", lambda row: read.append(row) or real(row))
    lens = np.array([len(p) for p in prompts])

    def share(k: int):
        return shared.share(StepRows(rows=rows, prefix_lens=lens + k, new_lens=np.ones(len(rows), np.int64),
                                     input_ids=np.zeros(len(rows), np.int64)))

    first = share(0)
    assert first is not None and len(read) == len(rows) and shared.plans == 1
    assert share(1) is first and len(read) == len(rows)
    _decode_rows(engine, [random_ids(gen, 5)])  # another row opens: locks are compared, the plan stays
    assert share(2) is first and len(read) == 2 * len(rows) and shared.plans == 1
    longer = prompts[0] + random_ids(gen, 4)
    manager.cache_req(int(rows[0]), longer, len(longer), finished=False)  # a row of the batch moves its lock
    assert share(3) is not first and shared.plans == 2 and shared.steps == 4


def test_option_turns_shared_prefix_off():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="triton", max_total_tokens=512, warm_up=False)
    assert runner.model_runner.shared_prefix and runner.model_runner.eager_shared is not None
    pool = runner.engine.pool
    engine = hf_radix.configure(model, shared_prefix=False)
    assert engine.pool is pool  # a backend option: the cache stays
    assert not engine.model_runner.shared_prefix and engine.model_runner.eager_shared is None
    off = RadixBatchRunner(model, shared_prefix=False, warm_up=False, cuda_graph=False)
    assert off.model_runner.eager_shared is None
    torch_runner = RadixBatchRunner(fresh_model("llama"), attn_backend="torch", max_total_tokens=512)
    assert not torch_runner.model_runner.shared_prefix  # the torch backend stays per-row


# --------------------------------------------------------------------------------------------------------
# Under the Triton interpreter: runner and generate equal HF with shared-prefix attention on
# --------------------------------------------------------------------------------------------------------

NEW = 4


def _keep_all(shared: SharedPrefixDecode | None) -> None:
    assert shared is not None
    shared.cost = dataclasses.replace(shared.cost, keep_all=True)


def _prompts(seed: int, page_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    systems = [random_ids(gen, 5 * page_size + 3), random_ids(gen, 4 * page_size + 1)]
    return [systems[i % 2] + random_ids(gen, 2 + 2 * i) for i in range(5)] + [random_ids(gen, 6)]


def _decode_logits(runner: RadixBatchRunner, prompts: list[list[int]], params: list[SamplingParams],
                   order: list[int]) -> tuple[list, dict[tuple[int, int], torch.Tensor]]:
    """Runs ``prompts[order]``; returns the outputs (input order) and each decode row's logits by
    (prompt, position)."""
    scheduler, core = runner.scheduler, runner.model_runner
    logits: dict[tuple[int, int], torch.Tensor] = {}
    launched: list = []
    real_rows, real_forward = scheduler._step_rows, core.forward

    def step_rows(items, *args):
        launched[:] = items
        return real_rows(items, *args)

    def forward(step, *args, **kwargs):
        out = real_forward(step, *args, **kwargs)
        if step.is_decode:
            for i, (req, start, _) in enumerate(launched):
                logits[(order[req.index], start)] = out[i].clone()
        return out

    scheduler._step_rows, core.forward = step_rows, forward
    try:
        outs = runner.run([prompts[i] for i in order], [params[i] for i in order])
    finally:
        del scheduler._step_rows, core.forward
    runner.check_integrity()
    by_prompt = [None] * len(prompts)
    for out, i in zip(outs, order):
        by_prompt[i] = out
    return by_prompt, logits


def _runner_check(page_size: int, graphs: bool) -> dict[str, Any]:
    """Runner with 3 running rows over 6 prompts (rows join and finish): HF's tokens; a row's decode
    logits do not depend on its batch-mates (another order, a subset)."""
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="triton", max_total_tokens=2048, page_size=page_size,
                              max_running_requests=3, warm_up=False)
    core = runner.model_runner
    if graphs:  # the decode graphs' padded batches, run eagerly off CUDA
        core.decode_graphs = DecodeGraphs(runner.engine, max_batch=4, shared_prefix=True)
        planner = core.decode_graphs.shared
    else:
        planner = core.eager_shared
    _keep_all(planner)
    prompts = _prompts(page_size, page_size)
    params = [SamplingParams(max_new_tokens=NEW + i % 3) for i in range(len(prompts))]
    outs, logits = _decode_logits(runner, prompts, params, list(range(len(prompts))))
    hf = all(o.token_ids == hf_greedy(model, p, s.max_new_tokens) for p, o, s in zip(prompts, outs, params))
    res: dict[str, Any] = {"hf": hf, "shared_steps": core.shared_prefix_steps, "plans": planner.plans}
    ok = hf and res["shared_steps"] > 0 and res["plans"] >= 2
    if not graphs:
        runner.reset_cache()
        again, logits2 = _decode_logits(runner, prompts, params, [4, 1, 0, 2])
        same = all(a is None or a.token_ids == o.token_ids for a, o in zip(again, outs))
        common = [k for k in logits2 if k in logits]
        res["compared"] = len(common)
        res["logits_diff"] = max(float((logits2[k] - logits[k]).abs().max()) for k in common)
        ok = ok and same and len(common) >= 8 and res["logits_diff"] <= 1e-5
    res["ok"] = ok
    return res


def _generate_check(page_size: int, cached_first: bool = True) -> dict[str, Any]:
    """generate(cache_implementation="radix"): a batch of questions after one few-shot prefix, cached by an
    earlier call or (``cached_first=False``) first computed in this one."""
    model = fresh_model("llama")
    engine = hf_radix.configure(model, attn_backend="triton", max_total_tokens=2048, page_size=page_size)
    _keep_all(engine.model_runner.eager_shared)
    gen = torch.Generator().manual_seed(7)
    system = random_ids(gen, 5 * page_size + 2)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             cache_implementation="radix")
        return [row[width:].tolist() for row in out]

    if cached_first:
        generate([system + random_ids(gen, 3)])  # caches the prefix
    before = engine.model_runner.shared_prefix_steps
    prompts = [system + random_ids(gen, 2 + i) for i in range(3)] + [random_ids(gen, 5)]
    outs = generate(prompts)
    engine.check_integrity()
    hf = all(o == hf_greedy(model, p, NEW) for p, o in zip(prompts, outs))
    steps = engine.model_runner.shared_prefix_steps - before
    return {"ok": hf and steps == NEW - 1, "hf": hf, "shared_steps": steps}


def _warm_up_check(page_size: int) -> dict[str, Any]:
    """Warm-up runs the shared-prefix kernels (on padding rows, one and two prefix splits) and leaves the
    runner as it was: later runs equal HF and the cache is consistent."""
    from hf_radix.forward import model_runner
    from hf_radix.kernels import triton_shared_prefix

    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="triton", max_total_tokens=512, page_size=page_size,
                              warm_up=False)
    model_runner.WARM_UP_TOKENS = (1,)  # the eager prefills are covered elsewhere; this checks the rest
    calls: list[int] = []
    real = triton_shared_prefix.shared_prefix_attention

    def counted(*args, **kwargs):
        calls.append(kwargs["num_prefix_splits"])
        return real(*args, **kwargs)

    triton_shared_prefix.shared_prefix_attention = counted
    try:
        runner.model_runner.warm_up()
    finally:
        triton_shared_prefix.shared_prefix_attention = real
    runner.check_integrity()
    layers = model.config.num_hidden_layers
    prompts = _prompts(page_size, page_size)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    hf = all(o.token_ids == hf_greedy(model, p, NEW) for p, o in zip(prompts, outs))
    return {"ok": hf and sorted(set(calls)) == [1, 2] and len(calls) == 2 * layers, "hf": hf, "calls": calls}


CHECKS = {
    "warm_up_shared_p4": lambda: _warm_up_check(4),
    "runner_graphs_p1": lambda: _runner_check(1, graphs=True),
    "runner_eager_p4": lambda: _runner_check(4, graphs=False),
    "generate_p1": lambda: _generate_check(1),
    "generate_p4": lambda: _generate_check(4),
    "generate_uncached_prefix_p4": lambda: _generate_check(4, cached_first=False),
}


# Slow (once, on the newest transformers): the longest check of the suite on 2 cores. Which transformers
# runs the model does not change the kernels or the plans; the torch-backend tests cover the runner and
# generate on every transformers version.
test_triton_interpreter = pytest.mark.slow(interpreter_test(__file__, CHECKS))


if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)
