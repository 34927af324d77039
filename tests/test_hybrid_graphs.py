"""Hybrid models' decode graphs (`DecodeGraphs` with `forward.hybrid.GraphStates`) on the CPU.

Rows padded to a bucket (padding rows on the state pool's scratch slot) give plain transformers' tokens;
a capture's eager runs leave running rows' states alone; and, under the Triton interpreter with the Triton
attention backend, a stand-in for CUDA graphs (a capture records its static batch, a replay runs that batch
again, reading whatever the static buffers hold then) gives plain transformers' tokens across captures of
several bucket sizes (the H200 test `tests/test_hybrid_gpu.py` found a capture writing the rows' slots that
the step before had left in the static index; this reproduces it on the CPU).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from interpreter import interpreter_test, report_checks
from reference import hf_greedy

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.forward.cuda_graph import DecodeGraphs
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_model

pytestmark = [
    pytest.mark.slow,  # run once, on the newest transformers
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]
warnings.filterwarnings("ignore")
NEW = 5


def _prompts(vocab: int, seed: int, sizes=(6, 11, 1)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (21,), generator=gen).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes]


def _run(runner, model, prompts) -> bool:
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    runner.check_integrity()
    return [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in prompts]


def stand_in_capture(graphs: DecodeGraphs) -> None:
    """Makes `graphs` capture off CUDA: a capture runs its static batch twice (as before a real capture)
    and keeps it; a replay runs the kept batch again."""
    kept = {}

    def record(batch):
        graphs._forward(batch)
        graphs._forward(batch)
        key = object()
        kept[id(key)] = (key, batch)
        return key, None

    graphs.capture = True
    graphs._allocate_static()
    graphs._record = record
    graphs._replay = lambda captured, rows: graphs._forward(kept[id(captured[0])][1])[:rows]


@pytest.mark.parametrize(("family", "page_size"), [("nemotron_h", 16), ("lfm2", 4)])  # Qwen3.5: below
def test_decode_graph_steps_equal_transformers(family: str, page_size: int) -> None:
    """Decode steps through `DecodeGraphs` (eager off CUDA: rows padded to a bucket, padding rows on the
    scratch slot, states read through the static index) give plain transformers' tokens, also on hits."""
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=page_size)
    graphs = runner.model_runner.decode_graphs = DecodeGraphs(runner.engine, max_batch=4)
    prompts = _prompts(model.config.vocab_size, seed=3)  # three rows: one padding row
    for _ in range(2):
        assert _run(runner, model, prompts)
    assert graphs.replays >= 2 * (NEW - 1)  # every decode step of both calls (a hit may add a prefill)
    assert runner.engine.state_pool.scratch_slot not in runner.engine.state_pool.used_slots


def test_capturing_a_decode_graph_leaves_running_rows_states_alone() -> None:
    """A capture's eager runs (padding rows only) read and write the scratch state slot, whatever slots the
    static index held from the step before."""
    model = tiny_hybrid_model("qwen3_5")
    runner = RadixBatchRunner(model, max_total_tokens=1024, page_size=1)
    graphs = runner.model_runner.decode_graphs = DecodeGraphs(runner.engine, max_batch=4)
    assert _run(runner, model, _prompts(model.config.vocab_size, seed=3))
    pool = runner.engine.state_pool
    graphs.states.static[:3] = torch.tensor(sorted(pool.used_slots)[:3])  # a step's rows, left behind
    before = {key: t[: pool.num_slots].clone() for key, t in pool.tensors.items()}
    stand_in_capture(graphs)
    graphs._capture((4, 4))
    for key, t in pool.tensors.items():
        assert torch.equal(t[: pool.num_slots], before[key]), key


# --------------------------------------------------------------------------------------------------------
# Interpreter checks (one TRITON_INTERPRET=1 subprocess)
# --------------------------------------------------------------------------------------------------------


def _replayed_graphs(family: str, page_size: int) -> dict:
    """The H200 test's workload (five prompts on a 37-token prefix, two calls) with graphs stood in for."""
    model = tiny_hybrid_model(family)
    runner = RadixBatchRunner(model, max_total_tokens=2048, page_size=page_size, attn_backend="triton")
    graphs = runner.model_runner.decode_graphs = DecodeGraphs(runner.engine, max_batch=16)
    stand_in_capture(graphs)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    shared = torch.randint(3, vocab, (37,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 12, 12, 30, 7)]
    same = [_run(runner, model, prompts) for _ in range(2)]
    shapes = [list(key) for key in graphs._graphs]
    return {"ok": all(same) and len(shapes) >= 2, "same": same, "graphs": shapes}


CHECKS = {"qwen3_5_page1": lambda: _replayed_graphs("qwen3_5", 1)}

test_replayed_decode_graphs_equal_transformers = interpreter_test(__file__, CHECKS)

if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)
