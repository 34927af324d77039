"""The page table's batched device writes: pending until the step's staged upload, one copy per upload."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids
from twin_tables import cpu_and_cuda_tables

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.forward.staging import HostStaging
from hf_radix.memory.page_table import PADDING_ROW, PageTable
from hf_radix.scheduling.request import Req

NEW = 6


def test_writes_reach_the_device_at_the_next_upload_with_their_last_value():
    table = PageTable(max_width=12, scratch_slot=99)
    row = table.open()
    table.write_row(row, 0, np.array([5, 6, 7]))
    assert table.slots[row, :3].tolist() == [0, 0, 0]  # pending: the device follows at the next upload
    table.write_row(row, 1, np.array([8]))  # the same position twice before an upload: the last value wins
    extra, = table.upload([np.array([1, 2, 3])])
    assert extra.tolist() == [1, 2, 3]
    assert table.slots[row, :3].tolist() == [5, 8, 7]
    assert table.check({row: 3}) is None
    table.write_row(row, 3, np.array([9]))
    assert table.check({row: 4}) is None  # the check flushes first


def test_reserve_keeps_rows_and_pending_writes():
    table = PageTable(max_width=4, scratch_slot=50)
    rows = [table.open() for _ in range(3)]
    for i, row in enumerate(rows):
        table.write_row(row, 0, np.array([i, i + 10]))
    table.reserve(40)
    assert table.capacity >= 41
    more = [table.open() for _ in range(30)]
    assert len(set(rows + more)) == 33 and PADDING_ROW not in rows + more
    assert sorted(rows) == rows and more[0] == rows[-1] + 1  # lowest free rows first
    table.flush()
    assert table.check({row: 2 for row in rows}) is None
    assert table.slots[PADDING_ROW].tolist() == [50] * 4


def test_staging_packs_parts_into_one_upload():
    staging = HostStaging("cpu")
    a, b, c = staging.upload([np.arange(3), np.zeros(0, dtype=np.int64), np.array([7], dtype=np.int32)])
    assert a.tolist() == [0, 1, 2] and b.numel() == 0 and c.tolist() == [7]
    assert a.dtype == c.dtype == torch.int64
    assert staging.uploads == 1


def test_staging_sends_int32_parts_in_the_same_copy():
    """int32 parts share the packed buffer's last words (no cast on the device); odd counts included."""
    staging = HostStaging("cpu")
    wide, *narrow = staging.upload([np.array([5, -6])], [np.array([1, -2, 3], dtype=np.int32), np.zeros(0),
                                                         np.array([2**31 - 1])])
    assert wide.tolist() == [5, -6] and wide.dtype == torch.int64
    assert [n.tolist() for n in narrow] == [[1, -2, 3], [], [2**31 - 1]]
    assert {n.dtype for n in narrow} == {torch.int32} and staging.uploads == 1
    table = PageTable(8, "cpu", scratch_slot=99)
    row = table.open()
    table.write(np.array([row]), np.array([3]), np.array([7]))
    (extra,) = table.upload([], [np.array([4], dtype=np.int32)])  # with the pending write, int32 too
    assert extra.tolist() == [4] and extra.dtype == torch.int32 and table.slots[row, 3] == 7


def test_every_staged_array_and_tile_table_starts_16_byte_aligned():
    """Triton compiles a kernel variant per pointer alignment: views into one packed buffer must not start
    at offsets that follow the batch's sizes (a first run would compile new variants)."""
    from hf_radix.paged_attention.prefix_groups import SharedPrefixBuffers

    staging = HostStaging("cpu")
    for sizes in ([1, 3, 2], [5], [2, 7, 1, 1]):
        out = staging.upload([np.arange(n) for n in sizes], [np.arange(n, dtype=np.int32) for n in sizes])
        assert [t.tolist() for t in out] == [list(range(n)) for n in sizes] * 2
        assert all(t.data_ptr() % 16 == 0 for t in out), [t.data_ptr() % 16 for t in out]
    for rows in (3, 5, 256):
        buffers = SharedPrefixBuffers(rows, rows, 32, 1, "cpu")
        tables = [buffers.prefix_tiles, buffers.prefix_queries, buffers.suffix_tiles, buffers.query_pos,
                  buffers.query_shared, buffers.prefix_tile_leader, buffers.prefix_splits]
        assert all(t.data_ptr() % 16 == 0 for t in tables)


def test_request_ids_follow_its_tokens():
    req = Req(0, [4, 5, 6], SamplingParams(max_new_tokens=3))
    assert req.match_ids.tolist() == [4, 5, 6]
    for token in (7, 8, 9):
        req.append(token)
    assert req.ids.tolist() == req.token_ids == [4, 5, 6, 7, 8, 9]
    assert req.num_generated == 3 and req.generated == [7, 8, 9]
    scoring = Req(1, [1, 2, 3, 4], SamplingParams(max_new_tokens=0), score_from=1)
    assert scoring.match_ids.tolist() == [1, 2] and scoring.ids.tolist() == [1, 2, 3, 4]
    assert req != Req(0, [4, 5, 6], SamplingParams(max_new_tokens=3))  # identity, not field equality


@functools.cache
def _model():
    return fresh_model("llama")


@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_writes_under_eviction_keep_the_table_exact(page_size: int, monkeypatch):
    """A pool too small for every prompt: steps evict, re-point duplicates and grow rows; the device table
    equals the host's after every step, each step sends at most three staged copies, tokens equal HF's."""
    runner = RadixBatchRunner(
        _model(), attn_backend="torch", page_size=page_size, max_total_tokens=160, max_running_requests=3,
        chunked_prefill_size=16,
    )
    runner.reset_cache()
    scheduler, table = runner.scheduler, runner.engine.manager.table
    uploads = []
    real_complete, real_launch = scheduler._complete, scheduler._launch

    def launch(items):
        before = table.staging.uploads
        launched = real_launch(items)
        uploads.append(table.staging.uploads - before)
        return launched

    def complete(launched):
        real_complete(launched)
        runner.check_integrity()

    monkeypatch.setattr(scheduler, "_launch", launch)
    monkeypatch.setattr(scheduler, "_complete", complete)
    gen = torch.Generator().manual_seed(5)
    shared = random_ids(gen, 18)
    prompts = [(shared if i % 2 else []) + random_ids(gen, 5 + 3 * i) for i in range(8)]
    evicted = runner.engine.manager.evicted_tokens
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    assert runner.engine.manager.evicted_tokens > evicted
    assert uploads and max(uploads) <= 3
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(_model(), prompt, NEW)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_never_rewrites_a_buffer_whose_copy_is_in_flight():
    """With the stream held up by a long kernel, more uploads than the ring has buffers each keep their
    own values: a buffer is refilled only after its last copy completed."""
    from hf_radix.forward.staging import RING

    staging = HostStaging("cuda")
    torch.cuda._sleep(200_000_000)  # the copies below queue behind this
    outs = [staging.upload([np.full(1000 + i, i, dtype=np.int64)])[0] for i in range(3 * RING)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert out.shape == (1000 + i,) and bool((out == i).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_metadata_on_the_gpu_equals_the_cpu_one():
    """The staged copy (int64 and int32 parts, the pending table writes) and the device gathers give on
    CUDA exactly the metadata they give on the CPU: decode steps (more than the ring has buffers, a write
    each) and mixed steps with ids from the table, either slot list."""
    import dataclasses

    from hf_radix.forward.staging import RING
    from hf_radix.paged_attention.forward_batch import StepRows, build_forward_batch

    gen = np.random.default_rng(0)
    tables, rows, lens, contexts, _ = cpu_and_cuda_tables(gen)

    def same(step: StepRows, context: bool) -> None:
        cpu, cuda = (build_forward_batch(t, step, context) for t in tables)
        for field in dataclasses.fields(cpu):
            a, b = getattr(cpu, field.name), getattr(cuda, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b.cpu()), field.name
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b), field.name
            else:
                assert a == b, field.name

    for k in range(3 * RING):  # decode: one new slot a row, written before each step
        for table in tables:
            table.write(rows, lens + k, np.array([c[40 + k % 20] for c in contexts]))
        step = StepRows(rows=rows, prefix_lens=lens + k, new_lens=np.ones(5, np.int64),
                        input_ids=np.zeros(5, np.int64), from_table=np.arange(5))
        same(step, k % 2 == 0)
    mixed = StepRows.of(rows[:3], lens[:3] - 2, [gen.integers(0, 1000, n) for n in (1, 2, 3)],
                        [np.array([0]), np.array([]), np.array([1, 2])])
    mixed.from_table = np.array([0])
    for context in (True, False):
        same(mixed, context)


def test_the_table_widens_past_its_first_width_keeping_rows_and_pending_writes():
    """A table starts as wide as the model's context and widens (up to the pool) when a row needs more;
    rows and not-yet-uploaded writes keep their positions; the padding row stays the scratch slot."""
    table = PageTable(64, scratch_slot=99, width=8)
    row = table.open()
    table.write_row(row, 0, np.arange(8))
    table.flush()
    table.write_row(row, 8, np.arange(8, 12))  # pending across the widening
    assert table.width == 16
    table.write(np.array([row]), np.array([40]), np.array([7]))
    assert table.width == 41
    table.flush()
    assert table.slots[row, :12].tolist() == list(range(12)) and int(table.slots[row, 40]) == 7
    assert (table.slots[PADDING_ROW] == 99).all() and (table.host[PADDING_ROW] == 99).all()
    assert table.check({row: 41}) is None
    with pytest.raises(ValueError, match="the page table holds 64"):
        table.write_row(row, 60, np.arange(5))
