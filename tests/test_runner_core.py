"""The runner core: mixed prefill+decode rounds, overlap on/off, staggered finishes, the device page table."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import fresh_model, hf_greedy, random_ids

from hf_radix import IntegrityError, RadixBatchRunner, SamplingParams
from hf_radix.forward.cuda_graph import DecodeGraphs, ExtendGraphs
from hf_radix.scheduling.request import RequestStatus

NEW = 7


@functools.cache
def _model(arch: str):
    return fresh_model(arch)


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(_model(arch), list(prompt), NEW)


def _runner(arch: str = "llama", **options) -> RadixBatchRunner:
    options = {"attn_backend": "torch", "max_total_tokens": 2048, **options}
    runner = RadixBatchRunner(_model(arch), **options)
    runner.reset_cache()
    return runner


def _checked_every_step(runner: RadixBatchRunner, monkeypatch) -> list[int]:
    """Runs the integrity check (tree, rows, free pages, device page table; every request's status and
    lengths) after every completed step."""
    scheduler = runner.scheduler
    completed = []
    real = scheduler._complete

    def complete(launched):
        real(launched)
        runner.check_integrity()
        completed.append(len(scheduler.queues.running))

    monkeypatch.setattr(scheduler, "_complete", complete)
    return completed


def _prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = random_ids(gen, 21)
    return [(system if i % 2 else []) + random_ids(gen, 3 + 5 * i % 17) for i in range(count)]


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("qwen2", 4)])
def test_mixed_rounds_match_hf(arch: str, page_size: int, monkeypatch):
    """Decode tokens of running requests ride in prefill rounds (one forward) and keep HF's greedy tokens."""
    runner = _runner(arch, page_size=page_size, max_running_requests=3, chunked_prefill_size=12)
    engine = runner.engine
    mixed = []
    real_forward = engine.run_model

    def forward(batch):
        new = np.diff(batch.qo_indptr_host)
        mixed.append(bool(np.any(new == 1) and np.any(new > 1)))
        return real_forward(batch)

    monkeypatch.setattr(engine, "run_model", forward)
    steps = _checked_every_step(runner, monkeypatch)
    prompts = _prompts(1, 9)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    assert any(mixed), "no forward held decode rows and prefill chunks together"
    assert steps
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference(arch, tuple(prompt))


def test_staggered_stops_with_new_prefills_joining(monkeypatch):
    """Requests stop at different steps (stop ids) while queued ones are admitted into the freed rows."""
    runner = _runner("llama", max_running_requests=3, chunked_prefill_size=32)
    _checked_every_step(runner, monkeypatch)
    prompts = _prompts(2, 8)
    params, expected = [], []
    for i, prompt in enumerate(prompts):
        ref = _reference("llama", tuple(prompt))
        stop = ref[i % NEW]
        params.append(SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop], ignore_eos=True))
        expected.append(ref[: ref.index(stop) + 1])
    outs = runner.run(prompts, params)
    runner.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert [o.finish_reason for o in outs] == ["stop"] * len(prompts)
    assert runner.engine.manager.num_rows == 0


@pytest.mark.parametrize("ignoring", [(True, False, True, False), (True,) * 4])
def test_eos_stops_the_requests_that_do_not_ignore_it(ignoring: tuple[bool, ...]):
    """The model's EOS stops each request that does not ignore it at its first occurrence; the others (in
    the same run, or every request of a run) go on to their length."""
    prompts = _prompts(4, len(ignoring))
    refs = [_reference("llama", tuple(p)) for p in prompts]
    model = fresh_model("llama")
    model.generation_config.eos_token_id = eos = refs[1][3]
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=2048)
    outs = runner.run(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=i) for i in ignoring])
    for ref, out, ignores in zip(refs, outs, ignoring):
        stops = not ignores and eos in ref
        assert out.token_ids == (ref[: ref.index(eos) + 1] if stops else ref)
        assert out.finish_reason == ("stop" if stops else "length")


@pytest.mark.parametrize("page_size", [1, 2])
def test_overlap_on_and_off_give_identical_outputs(page_size: int, monkeypatch):
    prompts = _prompts(3, 10)
    gen_ref = [_reference("llama", tuple(p)) for p in prompts]
    params = []
    for i, ref in enumerate(gen_ref):
        if i % 3 == 0:
            params.append(SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=20, seed=100 + i))
        else:
            stop = [ref[i % NEW]]
            params.append(SamplingParams(max_new_tokens=NEW - i % 4, stop_token_ids=stop, ignore_eos=True))
    results = {}
    for overlap in (False, True):
        runner = _runner("llama", page_size=page_size, max_running_requests=4, chunked_prefill_size=16,
                         overlap=overlap)
        _checked_every_step(runner, monkeypatch)
        outs = runner.run(prompts, params)
        runner.check_integrity()
        results[overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        again = runner.run(prompts, params)  # from the cache this time
        assert [(o.token_ids, o.finish_reason) for o in again] == results[overlap]
        monkeypatch.undo()
    assert results[True] == results[False]


def test_graph_paths_run_padded_on_cpu():
    """Decode and extend graphs (padded batches, eager off CUDA) give HF's greedy tokens in the runner."""
    runner = _runner("gemma2", page_size=2, max_running_requests=3, chunked_prefill_size=24)
    engine = runner.engine
    runner.model_runner.decode_graphs = DecodeGraphs(engine, max_batch=4)
    runner.model_runner.extend_graphs = ExtendGraphs(engine, max_rows=4, max_tokens=32)
    prompts = _prompts(4, 7)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference("gemma2", tuple(prompt))
    assert runner.model_runner.decode_graphs.replays > 0
    assert runner.model_runner.extend_graphs.replays > 0


def test_page_table_disagreement_is_caught():
    runner = _runner("llama")
    manager = runner.engine.manager
    handle = manager.match([1, 2, 3, 4])
    manager.lock(handle)
    row = manager.open_row(handle)
    manager.allocate([row], [4])
    runner.check_integrity()
    manager.table.slots[row, 2] += 1  # the device copy drifts from the host's
    with pytest.raises(IntegrityError, match="page-table row"):
        runner.check_integrity()
    manager.table.slots[row, 2] -= 1
    manager.cache_req(row, [1, 2, 3, 4], 0, finished=True)
    runner.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_up_fits_a_small_page_table(page_size: int):
    """Warm-up forwards stay inside a page table narrower than its longest prefill (a small pool)."""
    runner = RadixBatchRunner(fresh_model("llama"), page_size=page_size, max_total_tokens=256)
    assert runner.engine.manager.table.width < 512
    times = runner.model_runner.warm_up()
    assert set(times) == {"eager_s", "capture_s"}
    runner.check_integrity()
    prompt = random_ids(torch.Generator().manual_seed(3), 20)
    out = runner.run([prompt], SamplingParams(max_new_tokens=NEW))[0]
    assert out.token_ids == hf_greedy(runner.engine.model, prompt, NEW)
    runner.check_integrity()


def test_a_forward_that_cannot_be_captured_runs_eagerly(monkeypatch, caplog):
    """A graph capture that fails (the model copies to the host, say) gives up graphs for the engine with
    one warning; the step and every later one run eagerly with the same tokens."""
    from hf_radix.forward.cuda_graph import GraphCaptureError

    runner = _runner("llama")
    core = runner.model_runner
    core.decode_graphs = DecodeGraphs(runner.engine, max_batch=4)
    core.extend_graphs = ExtendGraphs(runner.engine, max_rows=4, max_tokens=32)

    def refuse(self, step, **_):
        raise GraphCaptureError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(DecodeGraphs, "run", refuse)
    monkeypatch.setattr(ExtendGraphs, "run", refuse)
    prompts = _prompts(3, 5)
    with caplog.at_level("WARNING"):
        outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW))
    runner.check_integrity()
    assert not core.has_graphs
    assert [o.token_ids for o in outs] == [_reference("llama", tuple(p)) for p in prompts]
    assert sum("cannot be captured" in r.getMessage() for r in caplog.records) == 1


def test_steady_decode_steps_reuse_the_running_arrays(monkeypatch):
    """While the running requests stay the same, a decode step reuses their arrays (built once) and sends
    one staged copy; the counters written back when they change cache every computed token."""
    from hf_radix.scheduling import request_queues as queues_module

    runner = _runner("llama", page_size=1, max_running_requests=4, chunked_prefill_size=256)
    scheduler, staging = runner.scheduler, runner.engine.manager.table.staging
    built: list[int] = []
    real_rows, real_launch = queues_module.RunningRows, scheduler._launch

    def running_rows(reqs):
        built.append(len(reqs))
        return real_rows(reqs)

    uploads: list[int] = []

    def launch(items):
        decode, before = len(items) == len(scheduler.queues.running), staging.uploads
        launched = real_launch(items)
        if decode:
            uploads.append(staging.uploads - before)
        return launched

    monkeypatch.setattr(queues_module, "RunningRows", running_rows)
    monkeypatch.setattr(scheduler, "_launch", launch)
    gen = torch.Generator().manual_seed(5)
    prompts = [random_ids(gen, 5 + 3 * i) for i in range(4)]  # no shared prefix: admitted in one round
    outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_reference("llama", tuple(p)) for p in prompts]
    assert built.count(len(prompts)) == 1 and len(uploads) == NEW - 1
    assert uploads[0] == 2 and set(uploads[1:]) == {1}  # the rows of the sampled tokens: sent once
    runner.check_integrity()
    again = runner.run([p + o.token_ids for p, o in zip(prompts, outs)], SamplingParams(max_new_tokens=1))
    assert [o.cached_tokens for o in again] == [len(p) + NEW - 1 for p in prompts]


def test_statuses_follow_the_lifecycle_and_a_bad_request_fails_alone(monkeypatch):
    """WAITING -> PREFILLING -> DECODING -> DRAINING -> FINISHED (a one-token request skips DECODING); bad
    requests are FAILED up front with their messages and the others complete with HF's tokens."""
    runner = _runner("llama", page_size=1, max_running_requests=2, chunked_prefill_size=8)
    scheduler = runner.scheduler
    queues = scheduler.queues
    steps = _checked_every_step(runner, monkeypatch)
    moves: dict[int, list[str]] = {}
    real_admit, real_move = queues.admit, queues.move

    def admit(req, *args):
        assert req.status is RequestStatus.WAITING
        moves.setdefault(req.index, []).append("PREFILLING")
        real_admit(req, *args)

    def move(req, status):
        moves.setdefault(req.index, []).append(status.name)
        real_move(req, status)

    monkeypatch.setattr(queues, "admit", admit)
    monkeypatch.setattr(queues, "move", move)
    good = _prompts(3, 4)
    vocab = runner.engine.vocab_size
    prompts = [good[0], [1, vocab + 5], good[1], [], good[2], [2.5, 3], good[3]]
    params = [SamplingParams(max_new_tokens=NEW)] * len(prompts)
    params[4] = SamplingParams(max_new_tokens=1)
    outs = runner.run(prompts, params)
    assert steps and not queues
    bad = {1: "token ids must lie in", 3: "empty prompt", 5: "token ids must be integers"}
    for i, out in enumerate(outs):
        if i in bad:
            assert out.finish_reason == "error" and out.error.startswith(bad[i]) and i not in moves
            continue
        assert out.finish_reason == "length" and out.error is None
        assert out.token_ids == _reference("llama", tuple(prompts[i]))[: params[i].max_new_tokens]
        prefill = moves[i][: moves[i].index("DECODING")] if "DECODING" in moves[i] else moves[i][:-1]
        assert set(prefill) == {"PREFILLING"} and prefill[0] == "PREFILLING"
        assert moves[i][len(prefill):] == (["DRAINING"] if i == 4 else ["DECODING", "DRAINING"])
