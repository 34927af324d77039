"""Why generate_bench's radix time to first token varies: the same radix call after different neighbours.

generate_bench alternates radix and default calls. This times radix `generate(max_new_tokens=1)` calls
(generate_bench's model, 4,096-token cached prefix, 64-token questions) after each kind of neighbour, the
kinds interleaved round by round in one process: after a default call (as generate_bench), back to back
after another radix call, after 130 ms of idle host and GPU, after 130 ms of GPU matmuls, and after a
default call followed by `gc.collect()`. Medians in ms. Then `timeline`: radix calls after default calls
under torch.profiler (which slows the host), split into host time before the first kernel, GPU busy time,
GPU idle gaps inside the call, and host time after the last kernel; and the Python profile of such calls.

    python bench/ttft_interleave.py --json bench/results/ttft_interleave_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama  # noqa: E402
from generate_bench import distinct_questions  # noqa: E402

import hf_radix  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_llama(False, dev, torch.bfloat16)
    hf_radix.configure(model, mem_fraction=0.5)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, vocab, (4096,), generator=gen).tolist()
    other = torch.randint(2, vocab, (4096,), generator=gen).tolist()
    questions = iter(distinct_questions(gen, 16 * args.rounds + 16, 64, vocab))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def call(ids: list[int], radix: bool) -> None:
        extra = dict(cache_implementation="radix") if radix else {}
        with torch.inference_mode():
            ids_t = torch.tensor([ids], device=dev)
            model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=1, do_sample=False,
                           **extra)

    def timed_radix() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(prefix + next(questions), True)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    def gpu_work() -> None:  # ~130 ms of matmuls
        for _ in range(95):
            a @ a
        torch.cuda.synchronize()

    before = {
        "after_default_call": lambda: call(prefix + next(questions), False),
        "back_to_back": lambda: call(prefix + next(questions), True),
        "after_idle_130ms": lambda: time.sleep(0.13),
        "after_gpu_matmuls_130ms": gpu_work,
        "after_default_call_and_gc": lambda: (call(prefix + next(questions), False), gc.collect()),
    }
    for radix in (False, True):  # warm-up on another prefix, then the shared prefix computed once
        for _ in range(3):
            call(other + next(questions), radix)
        call(prefix + next(questions), radix)
    torch.cuda.synchronize()
    start = time.perf_counter()
    gpu_work()
    matmul_ms = 1e3 * (time.perf_counter() - start)
    times: dict[str, list[float]] = {name: [] for name in before}
    for _ in range(args.rounds):
        for name, neighbour in before.items():
            neighbour()
            times[name].append(timed_radix())
    timeline = profile_calls(call, prefix, questions)
    result = {
        "timeline_ms": timeline,
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gpu_matmuls_ms": matmul_ms,
        "radix_ttft_median_ms": {name: statistics.median(v) for name, v in times.items()},
        "raw_ms": {name: [round(x, 2) for x in v] for name, v in times.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def profile_calls(call, prefix: list[int], questions) -> dict[str, float]:
    """Medians over 6 radix calls (each after a default call) of where their wall time goes; prints the
    Python profile of 6 more."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(6):
            call(prefix + next(questions), False)
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"radix_call_{i}"):
                call(prefix + next(questions), True)
                torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("radix_call_")]
    parts: dict[str, list[float]] = {"wall": [], "host_before_first_kernel": [], "gpu_busy": [],
                                     "gpu_gaps": [], "after_last_kernel": []}
    counts = []
    for span in (e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("radix_call_")):
        start, end = span.time_range.start, span.time_range.end
        inside = sorted((k.time_range.start, k.time_range.end) for k in kernels
                        if start <= k.time_range.start <= end)
        busy, reach = 0.0, inside[0][0]
        for k_start, k_end in inside:
            busy += max(0.0, k_end - max(k_start, reach))
            reach = max(reach, k_end)
        parts["wall"].append(end - start)
        parts["host_before_first_kernel"].append(inside[0][0] - start)
        parts["gpu_busy"].append(busy)
        parts["gpu_gaps"].append(reach - inside[0][0] - busy)
        parts["after_last_kernel"].append(end - reach)
        counts.append(len(inside))
        inside_names = sorted((k.time_range.start, k.time_range.end, k.name) for k in kernels
                              if start <= k.time_range.start <= end)
    print_gaps(span, inside_names, events)
    stats = cProfile.Profile()
    for _ in range(6):
        call(prefix + next(questions), False)
        torch.cuda.synchronize()
        stats.enable()
        call(prefix + next(questions), True)
        torch.cuda.synchronize()
        stats.disable()
    out = io.StringIO()
    pstats.Stats(stats, stream=out).sort_stats("cumulative").print_stats(50)
    print("\n".join(out.getvalue().splitlines()[:75]))
    medians = {name: statistics.median(v) / 1e3 for name, v in parts.items()}
    return {**medians, "kernels": statistics.median(counts)}


def print_gaps(span, kernels: list[tuple[float, float, str]], events) -> None:
    """The GPU's idle gaps over 40 us in one profiled call, each with the host ops that started in it."""
    from torch.autograd import DeviceType

    start = span.time_range.start
    host = sorted((e.time_range.start, e.name) for e in events if e.device_type == DeviceType.CPU
                  and start <= e.time_range.start <= span.time_range.end)
    marks = [(start, start, "call start"), *kernels, (span.time_range.end, span.time_range.end, "call end")]
    print("\n===== GPU gaps over 40 us in the last profiled radix call (ms from call start) =====")
    for (_, end_a, name_a), (start_b, _, name_b) in zip(marks, marks[1:], strict=False):
        if start_b - end_a > 40:
            ops = [name for t, name in host if end_a <= t < start_b]
            print(f"{(end_a - start) / 1e3:7.3f} +{(start_b - end_a) / 1e3:6.3f} ms after {name_a[:40]!r} "
                  f"before {name_b[:40]!r}; host: {', '.join(ops[:12])}")
    print(f"busy spans: {len(kernels)} kernels, first at {(kernels[0][0] - start) / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
