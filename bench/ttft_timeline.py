"""Where a radix time-to-first-token call's milliseconds go, without a profiler slowing the host.

generate_bench's workload (Llama-3.1-8B shape, random bf16 weights, a cached 4,096-token prefix, 64-token
questions, `generate(max_new_tokens=1)`, each radix call after a default call). Host clock stamps at the
call's milestones (the step run ahead launched, generate's first model call, its return, `finish`), and
CUDA events on the streams that ran them (the extend graph done, the call's last kernel), all in ms from the
call's start. Then the extend graph replayed alone (its GPU time), and a profiler table of the GPU kernels
of one call, sorted by GPU time.

    python bench/ttft_timeline.py --json bench/results/ttft_timeline_h200.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timer, timing_wrapper, write_result  # noqa: E402
from generate_bench import distinct_questions  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import engine  # noqa: E402
from hf_radix.forward import cuda_graph, model_runner, staging  # noqa: E402
from hf_radix.integrations import generate_hook, generate_rows, generate_session  # noqa: E402
from hf_radix.kernels import triton_slots  # noqa: E402
from hf_radix.memory import cache_manager, page_table, radix_tree  # noqa: E402
from hf_radix.paged_attention import forward_batch  # noqa: E402


class Stamps:
    """Host timestamps (perf_counter, ms since `begin`) and CUDA events of one call's milestones: a
    timeline rather than durations, so not `common.timer`."""

    def __init__(self) -> None:
        self.host: dict[str, float] = {}
        self.events: dict[str, torch.cuda.Event] = {}
        self.start_event: torch.cuda.Event | None = None
        self.t0 = 0.0
        self.spent: dict[str, float] = {}  # function -> ms inside it during the call (inclusive)

    def begin(self) -> None:
        self.host, self.events, self.spent = {}, {}, {}
        self.start_event = torch.cuda.Event(enable_timing=True)
        self.t0 = time.perf_counter()
        self.start_event.record()

    def mark(self, name: str, event: bool = False) -> None:
        self.host.setdefault(name, 1e3 * (time.perf_counter() - self.t0))
        if event and name not in self.events:
            self.events[name] = torch.cuda.Event(enable_timing=True)
            self.events[name].record()

    def read(self) -> dict[str, float]:
        out = {f"host_{k}": v for k, v in self.host.items()}
        out.update({f"in_{k}": v for k, v in self.spent.items()})
        out.update({f"gpu_{k}": self.start_event.elapsed_time(e) for k, e in self.events.items()})
        return out


STAMPS = Stamps()


def instrument() -> None:
    """Wraps the milestones of a radix generate call with `STAMPS` marks."""
    cls, rows = generate_session.RadixGenerateCache, generate_rows.GenerateRows

    def wrap(owner, name: str, before: str | None, after: str | None, event_after: bool = False) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if before:
                STAMPS.mark(before)
            out = original(*args, **kwargs)
            if after:
                STAMPS.mark(after, event=event_after)
            return out

        setattr(owner, name, wrapper)

    wrap(cls, "prefill_ahead", "ahead_start", "ahead_launched")
    wrap(cls, "forward", "generate_forward_called", "generate_forward_returned")
    wrap(cls, "finish", "finish_start", "finish_done")
    wrap(cuda_graph._CapturedForwards, "_replay", "graph_replay_start", "graph_replay_launched", True)
    timed_functions = [
        (generate_hook, "_effective_config"), (generate_hook, "_check_supported"),
        (generate_hook, "get_engine"), (generate_hook, "_route_forward"), (cls, "__init__"),
        (model_runner.ModelRunner, "ensure_warm"),
        (cls, "_open_rows"), (generate_session, "host_inputs"), (rows, "open"), (rows, "check_capacity"),
        (rows, "step"), (rows, "allocate"), (rows, "cache_prompts"), (cls, "_prepare_next"),
        (cache_manager.CacheManager, "match"), (cache_manager.CacheManager, "lock"),
        (cache_manager.CacheManager, "open_row"), (cache_manager.CacheManager, "allocate"),
        (cache_manager.CacheManager, "cache_req"), (model_runner.ModelRunner, "forward"),
        (model_runner.ModelRunner, "graph_fits"), (cuda_graph.ExtendGraphs, "run"),
        (cuda_graph.ExtendGraphs, "_pad"), (cuda_graph, "build_forward_batch"),
        (engine.RadixEngine, "side_stream"), (generate_session, "_wait_for"),
        (page_table.PageTable, "upload"), (staging.HostStaging, "upload"), (forward_batch, "gather_contexts"),
        (triton_slots, "gather_runs"), (model_runner.ModelRunner, "_graphs_for"),
        (radix_tree.MatchHandle, "matched_indices"), (page_table.PageTable, "write_row"),
        (generate_hook, "_radix_generate"), (engine.RadixEngine, "radix_attention"),
    ]
    for owner, name in timed_functions:
        accumulate(owner, name)


def accumulate(owner, name: str) -> None:
    """Adds the ms spent inside `owner.name` during a call to `STAMPS.spent`."""
    original = getattr(owner, name)
    key = f"{getattr(owner, '__name__', owner)}.{name}".rsplit(".", 2)[-2:]
    key = ".".join(key)

    def add(seconds: float) -> None:
        STAMPS.spent[key] = STAMPS.spent.get(key, 0.0) + 1e3 * seconds

    setattr(owner, name, timing_wrapper(original, add))


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of two profiled calls here")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_llama(False, dev, torch.bfloat16)
    radix_engine = hf_radix.configure(model, mem_fraction=0.5, warm_up=False)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, vocab, (4096,), generator=gen).tolist()
    questions = iter(distinct_questions(gen, 4 * args.calls + 16, 64, vocab))

    def call(radix: bool) -> None:
        ids = prefix + next(questions)
        extra = dict(cache_implementation="radix") if radix else {}
        STAMPS.mark("call_start")
        with torch.inference_mode():
            ids_t = torch.tensor([ids], device=dev)
            STAMPS.mark("ids_on_device")
            model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=1, do_sample=False,
                           **extra)

    for _ in range(4):
        call(False)
        call(True)
    torch.cuda.synchronize()
    instrument()
    rows = []
    for _ in range(args.calls):
        call(False)
        torch.cuda.synchronize()
        STAMPS.begin()
        call(True)
        STAMPS.mark("generate_returned", event=True)
        torch.cuda.synchronize()
        STAMPS.mark("synced")
        rows.append(STAMPS.read())
    timeline = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}

    # the extend graph alone, replayed back to back
    graphs = radix_engine.model_runner.extend_graphs
    captured = graphs._graphs[(1, 64)]
    for _ in range(3):
        captured[0].replay()
    with timer(events=True) as replays:
        for _ in range(20):
            captured[0].replay()
    graph_ms = replays.ms / 20

    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with timer("cuda"):
        call(False)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            with timer("cuda"):
                call(True)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us())
    table = sorted(((sum(v) / 2, len(v) / 2, k) for k, v in kernels.items()), reverse=True)
    print("\n===== kernels of one radix call, by GPU time (us, count) =====")
    for total, count, name in table[:30]:
        print(f"{total:9.1f} {count:6.0f}  {name[:110]}")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "timeline_median_ms": timeline,
        "extend_graph_replay_ms": graph_ms,
        "kernels_us_per_call": [{"name": n, "us": t, "count": c} for t, c, n in table[:40]],
        "rows": rows,
    }
    print(json.dumps({k: result[k] for k in ("timeline_median_ms", "extend_graph_replay_ms")}, indent=1))
    write_result(result, args.json, echo=False)


if __name__ == "__main__":
    main()
