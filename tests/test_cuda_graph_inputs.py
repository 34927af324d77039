"""Static inputs of captured graphs, on the CPU: what lands in them before a replay equals the eager batch.

A replay reads its metadata from static buffers that the step's staged upload and device gathers write
directly (no copies from a fresh batch). Here decode and extend graphs run their replay path on the CPU:
static buffers filled as on a GPU, and each "replay" compares them with `build_forward_batch` of the same
padded step in fresh tensors, then runs the step eagerly, so the runner's tokens must equal HF's with
batches that grow, shrink and change buckets.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids
from twin_tables import cpu_and_cuda_tables

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.forward import cuda_graph
from hf_radix.forward.cuda_graph import DecodeGraphs, ExtendGraphs
from hf_radix.forward.engine_view import eager_batch
from hf_radix.forward.staging import ALIGN_BYTES, HostStaging, PackedLayout, StaticBlock
from hf_radix.paged_attention.forward_batch import GraphInputs, build_forward_batch, gather_contexts

NEW = 7


@functools.cache
def _model(arch: str):
    return fresh_model(arch)


class _CheckedReplay:
    """A replay: the static inputs must hold the eager batch's metadata; its logits come from that batch."""

    def __init__(self, graphs, logits: torch.Tensor, loaded: list):
        self.graphs, self.logits, self.loaded = graphs, logits, loaded

    def replay(self) -> None:
        step, inputs = self.loaded[-1]
        eager = build_forward_batch(self.graphs.table, step, inputs.decode)
        if inputs.decode:
            lens, indptr, kv = eager.seq_lens, eager.kv_indptr, eager.kv_indices
        else:
            lens, indptr, kv = eager.prefix_lens, eager.prefix_kv_indptr, eager.prefix_kv_indices
        pairs = [
            (inputs.input_ids, eager.input_ids), (inputs.positions, eager.positions),
            (inputs.out_loc, eager.out_loc), (inputs.logits_indices, eager.logits_indices),
            (inputs.qo_indptr, eager.qo_indptr), (inputs.lens, lens), (inputs.kv_indptr, indptr),
            (inputs.kv[: len(kv)], kv),
        ]
        for static, fresh in pairs:
            assert static.dtype == fresh.dtype and torch.equal(static, fresh), (static, fresh)
        self.graphs.checked += 1
        self.logits.copy_(self.graphs.engine.run_model(eager_batch(self.graphs.engine, step)))


def _replayed_on_host(graphs, loaded: list):
    """`graphs` with their replay path on the CPU (`_CheckedReplay`)."""
    graphs.capture = True
    graphs._allocate_static()
    graphs.checked = 0

    def record(batch):
        logits = torch.empty(len(batch.logits_indices), graphs.engine.vocab_size)
        return _CheckedReplay(graphs, logits, loaded), logits

    graphs._record = record
    return graphs


@pytest.mark.parametrize("arch,page_size,shared", [("llama", 1, False), ("qwen2", 4, True)])
def test_static_inputs_equal_the_eager_batch_as_the_batch_changes(arch: str, page_size: int, shared: bool,
                                                                   monkeypatch):
    loaded: list = []
    real_build = cuda_graph.build_forward_batch

    def load(table, step, context, into=None):
        batch = real_build(table, step, context, into)
        if into is not None:
            loaded.append((step, into))
        return batch

    monkeypatch.setattr(cuda_graph, "build_forward_batch", load)
    model = _model(arch)
    runner = RadixBatchRunner(model, attn_backend="torch", page_size=page_size, max_total_tokens=2048,
                              max_running_requests=5, chunked_prefill_size=24, warm_up=False)
    runner.reset_cache()
    engine, core = runner.engine, runner.model_runner
    core.decode_graphs = _replayed_on_host(DecodeGraphs(engine, 8, shared_prefix=shared), loaded)
    core.extend_graphs = _replayed_on_host(ExtendGraphs(engine, max_rows=4, max_tokens=32), loaded)
    if shared:  # every group read once, whatever the cost rule says at this size
        planner = core.decode_graphs.shared
        planner.cost = dataclasses.replace(planner.cost, keep_all=True)
    gen = torch.Generator().manual_seed(11)
    system = random_ids(gen, 4 * page_size + 3)
    prompts = [(system if i % 3 else []) + random_ids(gen, 2 + 5 * i % 13) for i in range(9)]
    params = [SamplingParams(max_new_tokens=2 + i % 6) for i in range(len(prompts))]
    outs = runner.run(prompts, params)
    runner.check_integrity()
    for prompt, out, p in zip(prompts, outs, params):
        assert out.token_ids == hf_greedy(model, prompt, NEW)[: p.max_new_tokens]
    decode, extend = core.decode_graphs, core.extend_graphs
    assert decode.checked == decode.replays > 0 and extend.checked == extend.replays > 0
    assert len({key[0] for key in decode._graphs}) >= 2  # several buckets, padded rows among them
    if shared:
        assert any(len(key) == 3 for key in decode._graphs)


@pytest.mark.parametrize("room", [0, 40])
def test_an_upload_into_a_static_block_fills_its_layout_and_returns_the_rest(room: int):
    """The static arrays land at the layout's views (a shorter one fills its start); the other arrays come
    back aligned, from the room behind the layout when they fit (one copy) or beside it."""
    staging = HostStaging("cpu")
    layout = PackedLayout([3, 2], [3])
    block = StaticBlock(layout, torch.full((layout.total + room,), -1, dtype=torch.int64))
    rest = staging.upload([np.arange(5), np.arange(2) + 7], [np.array([9, 8], dtype=np.int32)], into=block,
                          into_parts=[np.array([4, 5, 6]), np.array([1])], into_narrow=[np.arange(3)])
    assert [v.tolist() for v in block.views[::2]] == [[4, 5, 6], [0, 1, 2]] and int(block.views[1][0]) == 1
    assert [t.tolist() for t in rest] == [list(range(5)), [7, 8], [9, 8]]
    assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in rest)
    in_block = rest[0].data_ptr() - block.block.data_ptr()
    assert (0 < in_block < block.block.numel() * 8) == bool(room) and staging.uploads == 1


def test_repeated_uploads_into_a_static_block_return_each_uploads_values():
    """Uploads of one shape reuse their layout and, in the block, the same views: each returns its own
    values; another shape in between (or one that does not fit behind the layout) gets its own."""
    staging = HostStaging("cpu")
    layout = PackedLayout([2], [2])
    block = StaticBlock(layout, torch.zeros(layout.total + 8, dtype=torch.int64))
    seen = []
    for step, sizes in enumerate([(3, 2), (3, 2), (4,), (3, 2), (9,)]):
        parts = [np.arange(n) + 10 * step for n in sizes]
        rest = staging.upload(parts, into=block, into_parts=[np.array([step, step])])
        assert [t.tolist() for t in rest] == [p.tolist() for p in parts]
        assert block.views[0].tolist() == [step, step]
        seen.append([t.data_ptr() for t in rest])
    assert seen[0] == seen[1] == seen[3] and seen[2][0] == seen[0][0]
    assert not block.block.data_ptr() <= seen[4][0] < block.block.data_ptr() + 8 * block.block.numel()


@pytest.mark.parametrize("into", [False, True])
def test_gathered_slot_lists_are_each_rows_run_empty_runs_included(into: bool):
    """`gather_contexts` concatenates `slots[rows[i], :lengths[i]]`, rows of no positions skipped."""
    width, rows, lengths = 8, np.array([3, 1, 2, 3, 2]), np.array([2, 0, 0, 8, 1])
    slots = torch.arange(40, dtype=torch.int32) * 3
    indptr = np.r_[0, np.cumsum(lengths)]
    bases = torch.from_numpy(rows * width - indptr[:-1])
    out = torch.full((20,), -1, dtype=torch.int64) if into else None
    got = gather_contexts(slots, bases, torch.from_numpy(indptr.astype(np.int32)), int(indptr[-1]),
                          int(lengths.max()), out=out)
    want = np.concatenate([slots.numpy().reshape(-1, width)[r, :n] for r, n in zip(rows, lengths)])
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert out is None or (got.data_ptr() == out.data_ptr() and out[len(want):].eq(-1).all())

def test_each_shape_lays_out_its_inputs_aligned_in_one_block():
    block, kv = torch.zeros(GraphInputs.layout(9, 32, 9).total, dtype=torch.int64), torch.zeros(64)
    for rows, tokens, logits in [(1, 1, 1), (3, 3, 3), (5, 17, 4), (9, 32, 9)]:
        inputs = GraphInputs(block, kv, rows, tokens, logits, decode=False)
        views = inputs.block.views
        assert [len(v) for v in views] == [tokens] * 3 + [logits, rows + 1, rows, rows + 1]
        assert all(v.data_ptr() % ALIGN_BYTES == 0 for v in views)
        assert all(v.untyped_storage().data_ptr() == block.untyped_storage().data_ptr() for v in views)
        ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
        assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # no overlaps
    with pytest.raises(ValueError, match="static block"):
        GraphInputs(block[:4], kv, 9, 32, 9, decode=True)


# --------------------------------------------------------------------------------------------------------
# On the GPU: the same metadata as on the CPU; replayed logits equal eager ones as the batch changes
# --------------------------------------------------------------------------------------------------------


def _inputs_on(device: str, decode: bool, rows: int, tokens: int, logits: int, room: int = 0) -> GraphInputs:
    words = GraphInputs.layout(rows, tokens, logits).total + room
    block = torch.zeros(words, dtype=torch.int64, device=device)
    kv = torch.zeros(rows * 64, dtype=torch.int64, device=device)
    return GraphInputs(block, kv, rows, tokens, logits, decode)


def _assert_same_inputs(cpu: GraphInputs, cuda: GraphInputs) -> None:
    for a, b in zip([*cpu.block.views, cpu.kv], [*cuda.block.views, cuda.kv]):
        assert a.dtype == b.dtype and torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_static_inputs_on_the_gpu_equal_the_cpu_ones():
    """The staged copy into the static block (and the rest of the upload beside it) and the gathers into
    the static buffers give on CUDA what they give on the CPU: decode steps past the staging ring with
    padded rows, an extend with ids partly from the table."""
    from hf_radix.forward.staging import RING
    from hf_radix.memory.page_table import PADDING_ROW
    from hf_radix.paged_attention.forward_batch import StepRows

    devices = ("cpu", "cuda")
    gen = np.random.default_rng(1)
    tables, rows, lens, contexts, tokens = cpu_and_cuda_tables(gen, first_token=1)
    padded = np.r_[rows, [PADDING_ROW] * 3]
    for k in range(3 * RING):
        for table in tables:
            table.write(rows, lens + k, np.array([c[40 + k % 20] for c in contexts]))
        step = StepRows(rows=padded, prefix_lens=np.r_[lens + k, 0, 0, 0], new_lens=np.ones(8, np.int64),
                        input_ids=np.zeros(8, np.int64), from_table=np.arange(8))
        inputs = [_inputs_on(device, True, 8, 8, 8, room=64) for device in devices]  # one copy
        for table, each in zip(tables, inputs):
            build_forward_batch(table, step, True, into=each)
        _assert_same_inputs(*inputs)
        assert inputs[0].input_ids.tolist() == [*tokens, 0, 0, 0]
    extend = StepRows.of([*rows[:3], PADDING_ROW], [*(lens[:3] - 2), 0],
                         [gen.integers(0, 1000, n) for n in (1, 2, 3, 2)],
                         [np.array([0]), np.array([1]), np.array([2]), np.zeros(0, np.int64)])
    extend.from_table = np.array([0, 2])
    inputs = [_inputs_on(device, False, 4, 8, 3) for device in devices]  # no room: two copies
    for table, each in zip(tables, inputs):
        build_forward_batch(table, extend, False, into=each)
    _assert_same_inputs(*inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shared", [False, True])
def test_replayed_logits_equal_eager_ones_as_the_batch_changes(shared: bool, monkeypatch):
    """Every step that replays a graph (decode, padded to changing buckets; short extends) gives the logits
    an eager forward of the same step gives, while rows finish at different steps and new ones join."""
    from hf_radix.forward.model_runner import ModelRunner

    model = fresh_model("llama").cuda()
    runner = RadixBatchRunner(model, attn_backend="triton", max_total_tokens=8192, max_running_requests=12,
                              chunked_prefill_size=48, warm_up=False, shared_prefix=shared)
    runner.reset_cache()
    core = runner.model_runner
    if shared:
        planner = core.decode_graphs.shared
        planner.cost = dataclasses.replace(planner.cost, keep_all=True)
    compared = []
    real_forward = ModelRunner.forward

    def forward(self, step, eager=None, **options):
        logits = real_forward(self, step, eager, **options)
        if self.graph_fits(step):
            replayed = logits.clone()
            again = self.engine.run_model(eager_batch(self.engine, step))
            rows = step.logits_rows()
            again = again if rows is None else again[torch.as_tensor(rows, device=again.device)]
            torch.testing.assert_close(replayed, again, rtol=1e-4, atol=1e-4)
            compared.append(step.batch_size)
        return logits

    monkeypatch.setattr(ModelRunner, "forward", forward)
    gen = torch.Generator().manual_seed(2)
    system = random_ids(gen, 40)
    prompts = [(system if i % 3 else []) + random_ids(gen, 2 + 5 * i % 13) for i in range(20)]
    params = [SamplingParams(max_new_tokens=3 + i % 9) for i in range(len(prompts))]
    runner.run(prompts, params)
    runner.check_integrity()
    assert core.decode_graphs.replays > 0 and len(set(compared)) >= 3
    if shared:
        assert any(len(key) == 3 for key in core.decode_graphs._graphs)
