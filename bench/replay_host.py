"""Where a gsp-8x32 decode step's host time goes: the CUDA-graph replay call against the rest.

Runs gsp.py's runner and shared workload (a first run, then the steady run) with `CUDAGraph.replay` and
the scheduler's parts timed on the host (each call's inclusive seconds, wrappers patched in): the decode
graph's replay call and the rest against the decode step's host time (`step_summary`).

    python bench/replay_host.py --json bench/results/replay_host_h200.json
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timer, timing_wrapper, write_result  # noqa: E402
from gsp import make_prompts, run_radix, step_summary  # noqa: E402

import hf_radix.forward.cuda_graph  # noqa: E402
import hf_radix.forward.staging  # noqa: E402
import hf_radix.memory.cache_manager  # noqa: E402
import hf_radix.scheduler  # noqa: E402
import hf_radix.scheduling.sampling  # noqa: E402
from hf_radix import RadixBatchRunner  # noqa: E402

replay_ms: list[tuple[int, float]] = []
_replay = torch.cuda.CUDAGraph.replay
PARTS = [
    (hf_radix.scheduler.Scheduler, "_schedule"),
    (hf_radix.scheduler.Scheduler, "_launch"),
    (hf_radix.scheduler.Scheduler, "_complete"),
    (hf_radix.scheduler.Scheduler, "_advance"),
    (hf_radix.scheduler.Scheduler, "_step_rows"),
    (hf_radix.memory.cache_manager.CacheManager, "allocate"),
    (hf_radix.forward.cuda_graph.DecodeGraphs, "run"),
    (hf_radix.forward.cuda_graph, "build_forward_batch"),
    (hf_radix.scheduling.sampling.Sampler, "sample"),
    (hf_radix.forward.model_runner, "copy_to_host"),
    (hf_radix.forward.staging.HostStaging, "upload"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Event, "record"),
]
part_ms: dict[str, list[float]] = collections.defaultdict(list)


def timing(owner, name: str):
    inner = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    return inner, timing_wrapper(inner, lambda seconds: part_ms[label].append(1e3 * seconds))


def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
    with timer(sync=False) as spent:
        _replay(graph)
    replay_ms.append((id(graph), spent.ms))


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU self-check: tiny model and shapes")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = (2, 4, 48, 8, 4) if args.tiny else (8, 32, 2048, 256, 64)
    model = build_llama(args.tiny, device)
    runner = RadixBatchRunner(model, max_total_tokens=200_000 if not args.tiny else 4096, mem_fraction=0.4,
                              chunked_prefill_size=8192, profile=not args.tiny)
    vocab = model.config.vocab_size
    groups, per_group, system, question, new = shape
    warm = make_prompts(groups, per_group, system, question, vocab, shared=True, seed=2)
    run_radix(runner, warm, new, device)
    torch.cuda.CUDAGraph.replay = timed_replay
    originals = []
    for owner, name in PARTS:
        inner, wrapper = timing(owner, name)
        originals.append((owner, name, inner))
        setattr(owner, name, wrapper)
    steps_before = len(runner.step_times.host_s)
    run_radix(runner, make_prompts(groups, per_group, system, question, vocab, shared=True), new, device)
    torch.cuda.CUDAGraph.replay = _replay
    for owner, name, inner in originals:
        setattr(owner, name, inner)
    steps = step_summary(runner, steps_before)
    by_graph = collections.defaultdict(list)
    for key, ms in replay_ms:
        by_graph[key].append(ms)
    decode = max(by_graph.values(), key=len, default=[])
    result = {
        "device": torch.cuda.get_device_name() if not args.tiny else "cpu",
        "torch": torch.__version__,
        **steps,
        "decode_graph_replays": len(decode),
        "replay_call_host_ms_in_run": statistics.median(decode) if decode else None,
        "parts_ms": {label: {"calls": len(v), "median": statistics.median(v), "total": sum(v)}
                     for label, v in part_ms.items()},
        "raw_in_run_ms": [round(x, 3) for x in decode],
    }
    write_result(result, args.json)


if __name__ == "__main__":
    main()
