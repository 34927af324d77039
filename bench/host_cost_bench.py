"""Host cost of the runner per step, on the CPU: the model's forward replaced by a trivially fast one.

A gsp-shaped workload (8 groups x 32 prompts of a 2,048-token system prompt + 256 own tokens: 256 rows of
2,304-token contexts, 64 new tokens each, greedy, EOS ignored) runs through the real scheduler, cache
manager, page table, metadata builder, padded decode-graph path and sampler; only `engine.run_model`
returns canned logits. What is left is the host work of each step (what `bench/gsp.py` reports as
`decode_step_host_ms` on a GPU) plus the metadata ops that would be device kernels there but execute
synchronously on the CPU here. The timed runs leave the slot lists of whole contexts uninitialized (a few
microseconds of kernels on a GPU, tens of milliseconds on the CPU, unread by the canned forward); another
run counts the aten ops of a step (each a kernel launch on a GPU; the GPU estimate adds `LAUNCH_US` per
op to the host time; the `_net` keys leave out the greedy argmax over the canned logits, CPU work here and
one kernel there); a profiled run (cProfile) gives the top host functions and the Python
calls per step (a count that, unlike the times, does not depend on the machine's load).
`decode` pads rows to a graph bucket and runs the padded batch eagerly (the CPU's path); `decode_replay`
runs what a GPU runs before each graph replay, on the CPU: decode graphs with shared-prefix groups (the
gsp benchmark's path) whose metadata lands in static buffers exactly as on a GPU, a "replay" returning the
canned logits (the graph's output buffer). A 5-shot scoring
workload (512 questions x 4 choices behind one 1,500-token prefix) is measured the same way, per run.
Run: `python bench/host_cost_bench.py --json bench/results/host_cost_cpu.json`.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import int_options, parser_for, timed, timer, write_result  # noqa: E402

from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402
from hf_radix.forward.cuda_graph import DecodeGraphs  # noqa: E402
from hf_radix.paged_attention import forward_batch  # noqa: E402
from hf_radix.tiny import tiny_model  # noqa: E402

VOCAB = 1024
LAUNCH_US = 5.0  # host time of one CUDA kernel launch, for the GPU estimate


def _fake_forward(engine) -> None:
    """`engine.run_model` returns canned logits of the right shape (one row per logits index)."""
    bank = torch.randn(16384, VOCAB, generator=torch.Generator().manual_seed(0))

    def run_model(batch):
        return bank[: len(batch.logits_indices)]

    engine.run_model = run_model


class _Replayed:
    """A captured graph's replay, as far as the host sees it: one call."""

    def replay(self) -> None:
        pass


class HostReplayedDecodeGraphs(DecodeGraphs):
    """Decode graphs whose replay path runs on the CPU: static buffers (CPU tensors) filled as on a GPU,
    graphs "captured" by one eager forward of the static batch whose output stands for the graph's."""

    def __init__(self, engine, max_batch: int, shared_prefix: bool):
        super().__init__(engine, max_batch, shared_prefix=shared_prefix)
        self.capture = True
        self._allocate_static()

    def _record(self, batch):
        return _Replayed(), self._forward(batch)


def _runner(args, replay: bool = False) -> RadixBatchRunner:
    model = tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096, eos_token_id=None)
    model.generation_config.eos_token_id = None
    runner = RadixBatchRunner(
        model, page_size=args.page_size, max_total_tokens=args.pool_tokens, attn_backend="torch",
        max_running_requests=256, chunked_prefill_size=8192, overlap=not args.no_overlap, warm_up=False,
    )
    _fake_forward(runner.engine)
    # the GPU's decode path: rows padded to a captured bucket (run eagerly off CUDA, or replay-like)
    graphs = HostReplayedDecodeGraphs(runner.engine, 256, shared_prefix=True) if replay else None
    runner.model_runner.decode_graphs = graphs or DecodeGraphs(runner.engine, 256)
    return runner


def _prompts(groups: int, per_group: int, system: int, own: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        shared = torch.randint(2, VOCAB, (system,), generator=gen).tolist()
        out += [shared + torch.randint(2, VOCAB, (own,), generator=gen).tolist() for _ in range(per_group)]
    return out


class _OpTimer(TorchDispatchMode):
    """Counts the aten ops run inside it and the seconds they took (on a GPU: kernel launches)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with timer(sync=False) as t:
            out = func(*args, **(kwargs or {}))
        self.seconds += t.seconds
        self.ops += 1
        return out


@contextlib.contextmanager
def _argmax_seconds(spent: list[float]):
    """Appends the seconds each `Tensor.argmax` inside it takes: the greedy pick over the canned logits,
    CPU work here, one asynchronous kernel on a GPU (counted as an aten op)."""
    real = torch.Tensor.argmax

    def argmax(self, *args, **kwargs):
        with timer(sync=False) as t:
            out = real(self, *args, **kwargs)
        spent[-1] += t.seconds
        return out

    spent.append(0.0)
    torch.Tensor.argmax = argmax
    try:
        yield
    finally:
        torch.Tensor.argmax = real


def _top(profile: cProfile.Profile, count: int = 20) -> str:
    buffer = io.StringIO()
    pstats.Stats(profile, stream=buffer).sort_stats("tottime").print_stats(count)
    return buffer.getvalue()


def _timed_steps(runner, prompts, params, is_decode, hook) -> tuple[list[float], float]:
    """Runs `prompts`; `hook()` (a context manager) wraps each launch that `is_decode(items)`. A decode
    step's time is its schedule-free launch plus the completion of its results."""
    scheduler = runner.scheduler
    real_launch, real_complete = scheduler._launch, scheduler._complete
    launches, completions = [], []

    def launch(items):
        if not is_decode(items):
            return real_launch(items)
        with timer(sync=False) as t, hook():
            launched = real_launch(items)
        launches.append(t.seconds)
        return launched

    def complete(launched):
        with timer(sync=False) as t:
            real_complete(launched)
        if launched.decode:
            completions.append(t.seconds)

    scheduler._launch, scheduler._complete = launch, complete
    runner.reset_cache()
    try:
        wall, _ = timed(lambda: runner.run(prompts, params, progress=False), sync=False)
    finally:
        del scheduler._launch, scheduler._complete
    runner.check_integrity()
    return [a + b for a, b in zip(launches, completions)], wall


@contextlib.contextmanager
def _stub_slot_lists():
    """The slot lists of whole contexts (O(rows x context) device work, unread by the canned forward) are
    left uninitialized: on a GPU they are a few microseconds of kernels, on the CPU they would hide the
    host work."""
    real = forward_batch.gather_contexts

    def gather(flat_slots, bases, indptr, total, longest, out=None):
        return torch.empty(total, dtype=torch.int64) if out is None else out[:total]

    forward_batch.gather_contexts = gather
    try:
        yield
    finally:
        forward_batch.gather_contexts = real


def measure_decode(args, replay: bool = False) -> dict:
    """Per decode step at 256 rows: host time (slot lists stubbed), aten ops (not stubbed), a cProfile;
    `replay`: the graph replay path (see the module's docstring)."""
    runner = _runner(args, replay)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    runner.run(_prompts(8, 32, 2048, 256, seed=1), params, progress=False)  # first run: tables grow
    prompts = _prompts(8, 32, 2048, 256, seed=2)
    scheduler = runner.scheduler

    def is_decode(items):
        return bool(items) and len(items) == len(scheduler.queues.running)

    counter = _OpTimer()
    _timed_steps(runner, prompts, params, is_decode, lambda: counter)
    argmax: list[float] = []
    with _stub_slot_lists():
        wall_steps, wall = _timed_steps(runner, prompts, params, is_decode, lambda: _argmax_seconds(argmax))
        profile = cProfile.Profile()
        _timed_steps(runner, prompts, params, is_decode, lambda: _profiling(profile))
        calls: list[int] = []
        _timed_steps(runner, prompts, params, is_decode, lambda: _counting_calls(calls))
    steps = len(wall_steps)
    host_ms = 1e3 * statistics.median(wall_steps)
    net_ms = 1e3 * statistics.median(t - a for t, a in zip(wall_steps, argmax))
    ops = counter.ops / steps
    return {
        "rows": len(prompts),
        "context_tokens": 2304,
        "decode_steps": steps,
        "decode_step_host_ms_cpu": host_ms,
        "decode_step_aten_ops": ops,
        "decode_step_host_ms_gpu_estimate": host_ms + ops * LAUNCH_US / 1e3,
        # the same without the greedy argmax over the canned logits (CPU work here, a kernel on a GPU)
        "decode_step_host_ms_cpu_net": net_ms,
        "decode_step_host_ms_gpu_estimate_net": net_ms + ops * LAUNCH_US / 1e3,
        "decode_step_python_calls": pstats.Stats(profile).total_calls / steps,
        # a steady step's (the mean above includes the steps that plan shared-prefix groups anew)
        "decode_step_python_calls_median": statistics.median(calls),
        "run_wall_s": wall,
        "profile_top": _top(profile),
    }


@contextlib.contextmanager
def _counting_calls(counts: list[int]):
    """Appends the Python and builtin calls made inside it."""
    count = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)
        counts.append(count[0])


@contextlib.contextmanager
def _profiling(profile: cProfile.Profile):
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def measure_scoring(args) -> dict:
    """512 questions x 4 choices behind one 1,500-token prefix: host cost of the whole scoring run."""
    runner = _runner(args)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(2, VOCAB, (1500,), generator=gen).tolist()
    pairs = []
    for _ in range(args.questions):
        question = prefix + torch.randint(2, VOCAB, (40,), generator=gen).tolist()
        pairs += [(question, torch.randint(2, VOCAB, (3,), generator=gen).tolist()) for _ in range(4)]
    runner.loglikelihood(pairs, progress=False)  # first run

    def run(hook) -> float:
        runner.reset_cache()
        with timer(sync=False) as t:
            with hook():
                runner.loglikelihood(pairs, progress=False)
            runner.check_integrity()
        return t.seconds

    forwards_before = runner.stats.forward_calls
    wall = run(contextlib.nullcontext)
    forwards = runner.stats.forward_calls - forwards_before
    op_timer = _OpTimer()
    run(lambda: op_timer)
    profile = cProfile.Profile()
    run(lambda: _profiling(profile))
    return {
        "pairs": len(pairs),
        "forwards": forwards,
        "host_s_cpu": wall,
        "aten_ops": op_timer.ops,
        "aten_s_cpu": op_timer.seconds,
        "python_s": wall - op_timer.seconds,
        "host_s_gpu_estimate": wall - op_timer.seconds + op_timer.ops * LAUNCH_US / 1e6,
        "python_calls": pstats.Stats(profile).total_calls,
        "profile_top": _top(profile),
    }


def main() -> None:
    parser = int_options(parser_for(__doc__), page_size=1, pool_tokens=110_000, new_tokens=64, questions=512)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--skip-scoring", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        "torch": torch.__version__,
        "page_size": args.page_size,
        "overlap": not args.no_overlap,
        "launch_us_assumed": LAUNCH_US,
        "decode": measure_decode(args),
        "decode_replay": measure_decode(args, replay=True),
    }
    if not args.skip_scoring:
        results["scoring"] = measure_scoring(args)
    for name in ("decode", "decode_replay", "scoring"):
        if name in results:
            print(f"== {name}\n{results[name]['profile_top']}")
            print(json.dumps({k: v for k, v in results[name].items() if k != "profile_top"}, indent=1))
    write_result(results, args.json, echo=False)


if __name__ == "__main__":
    main()
