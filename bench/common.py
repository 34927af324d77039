"""Shared by the benchmarks: timing (`timer`, `measure`), arguments (`--json PATH` and the rest), result files
that record the command and git commit, and the Llama-3.1-8B shape with random weights built on the device.

Timing. Every benchmark times through `timer` (one block) or `measure` (a function called repeatedly):

    with timer() as t:              # waits for the GPU before and after (when CUDA is in use)
        model.generate(...)
    t.seconds
    seconds, out = timed(lambda: model.generate(...))   # the same, for one call

    timing = measure(lambda: runner.run(prompts), warmup=1, repeats=5)
    timing.first_s, timing.median_s, timing.steady_s   # first (cold) call beside the steady ones

`timer(sync=False)` times host work alone (what launching costs, the GPU left running); `timer(events=True)`
times the GPU work the block launched with CUDA events (graph replays, kernels), no host overhead counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from hf_radix.tiny import tiny_config

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=0)


# ------------------------------------------------------------------------------------------------- timing
def cuda_in_use(device: torch.device | str | None = None) -> bool:
    """Whether there is GPU work to wait for: `device` is a CUDA device, or (None) CUDA is initialized."""
    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync(device: torch.device | str | None = None) -> None:
    """Waits for the GPU's queued work (nothing on the CPU, or before CUDA is initialized)."""
    if cuda_in_use(device):
        torch.cuda.synchronize(device)


class Timer:
    """A context manager timing its block (made by `timer`): `seconds` (also `ms`, `us`) once it ends.

    A class rather than a generator, and the clock read first thing on exit: the timer adds about 0.1 us
    inside the span it times (per-op hooks and microsecond tree operations stay accurate).
    """

    def __init__(self, device: torch.device | str | None, sync: bool, events: bool,
                 clock: Callable[[], float] = time.perf_counter):
        self.device, self.events, self.clock = device, events, clock
        self.wait = sync and (events or cuda_in_use(device))
        self.seconds = float("nan")

    def __enter__(self) -> Timer:
        if self.wait:
            _sync(self.device)
        if self.events:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._end_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._start = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        end = self.clock()
        if self.events:
            self._end_event.record()
            self._end_event.synchronize()
            self.seconds = self._start_event.elapsed_time(self._end_event) / 1e3
            return
        if self.wait:
            _sync(self.device)
            end = self.clock()
        self.seconds = end - self._start

    @property
    def ms(self) -> float:
        return self.seconds * 1e3

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def timer(device: torch.device | str | None = None, *, sync: bool = True, events: bool = False,
          clock: Callable[[], float] = time.perf_counter) -> Timer:
    """Times a `with` block; the seconds are in the `Timer` it yields once the block ends.

    `sync` (default): waits for the GPU before and after the block when CUDA is in use (`device`, or any
    initialized CUDA), so the time counts the GPU work the block launched. `sync=False`: host time alone.
    `events=True`: GPU time from CUDA events recorded on the current stream before and after the block
    (`sync` waits for earlier work first); needs CUDA. `clock`: another clock than `time.perf_counter`
    (`time.thread_time`: this thread's CPU time).
    """
    return Timer(device, sync, events, clock)


_sync = sync  # `timer`'s own parameter is called sync


def timing_wrapper(fn: Callable, record: Callable[[float], None]) -> Callable:
    """`fn`, with each call's host seconds (the GPU left running) passed to `record`, failed calls too: for
    patching into a library to see where a step's host time goes."""

    def wrapper(*args, **kwargs):
        spent = timer(sync=False)
        try:
            with spent:
                return fn(*args, **kwargs)
        finally:
            record(spent.seconds)

    return wrapper


def timed(fn: Callable[[], Any], device: torch.device | str | None = None, *, sync: bool = True
          ) -> tuple[float, Any]:
    """One call of `fn` timed by `timer`: (seconds, what it returned)."""
    with timer(device, sync=sync) as t:
        value = fn()
    return t.seconds, value


@dataclass
class Timing:
    """What `measure` measured: the first (cold) call, the steady calls after the warm-up, the last value."""

    first_s: float
    steady_s: list[float] = field(default_factory=list)
    value: Any = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.steady_s)

    @property
    def min_s(self) -> float:
        return min(self.steady_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.steady_s)

    def summary(self) -> dict[str, Any]:
        """For a result file: first, median, min and every steady time, in seconds."""
        return {"first_s": self.first_s, "median_s": self.median_s, "min_s": self.min_s,
                "steady_s": list(self.steady_s)}


def measure(fn: Callable[[], Any], *, repeats: int = 1, warmup: int = 0,
            device: torch.device | str | None = None, sync: bool = True, events: bool = False) -> Timing:
    """Calls `fn` `warmup + repeats` times, each timed by `timer` (same `device`, `sync`, `events`).

    `first_s` is the first call's time (the cold one: compiles, captures, allocations); `steady_s` are the
    last `repeats` calls' (with `warmup=0` the first call is one of them); `value` is the last call's result.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError("measure needs repeats >= 1 and warmup >= 0")
    times, value = [], None
    for _ in range(warmup + repeats):
        with timer(device, sync=sync, events=events) as t:
            value = fn()
        times.append(t.seconds)
    return Timing(first_s=times[0], steady_s=times[warmup:], value=value)


_START = time.perf_counter()


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- arguments
def parser_for(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring as the description, shown as written, and `--json PATH`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results (JSON) here")
    return parser


def int_options(parser: argparse.ArgumentParser, **defaults: int) -> argparse.ArgumentParser:
    """`--some-name N` for each `some_name=default` (an int option with that default)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, metavar="N")
    return parser


def generate_parser(doc: str | None) -> argparse.ArgumentParser:
    """`parser_for(doc)` with the options of the benchmarks that time radix `generate` against the default
    cache; their workload sizes default to None, filled in by `generate_device`."""
    parser = parser_for(doc)
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model, small workload (CPU check)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--attn-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--max-total-tokens", type=int, default=None, help="pool size (default: half free)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="radix forwards run eagerly")
    return parser


def generate_device(args: argparse.Namespace, full: dict[str, int], tiny: dict[str, int]) -> torch.device:
    """The device of a `generate_parser` benchmark: CUDA unless `--cpu` or none; on the CPU, at most four
    threads. Sizes left unset take their `tiny` value with `--tiny` (and a pool of 8,192 tokens unless
    `--max-total-tokens` says otherwise), else their `full` one."""
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.max_total_tokens = args.max_total_tokens or 8192
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 4))
    return device


def model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--tiny, --layers, --page-size and --seed (the warm-start and chat benchmarks)."""
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: a self-check")
    parser.add_argument("--layers", type=int, help="8B width with this many layers (a smaller shape)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def bench_device(args: argparse.Namespace) -> str:
    return "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"


# ------------------------------------------------------------------------------------------- result files
def command_line() -> str:
    """The command that runs this benchmark, as a result file records it."""
    return " ".join(["python", *sys.argv])


def git_commit() -> str:
    """The commit the benchmark ran at: $HF_RADIX_COMMIT where set (a copy of the tree whose .git, if any,
    is not its own: `bench/run_gpu.sh` passes it on), else from git (`-dirty` with uncommitted changes),
    else "unknown"."""
    if os.environ.get("HF_RADIX_COMMIT", "unknown") != "unknown":
        return os.environ["HF_RADIX_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict[str, str]:
    """What every result file records: the command and the git commit."""
    return {"command": command_line(), "git_commit": git_commit()}


def write_result(result: dict, json_path: Path | None, echo: bool = True) -> None:
    """Writes a benchmark's result as JSON to `json_path`, with the command and commit that made it; `echo`
    also prints it (benchmarks that print a table of their own pass False)."""
    result.update(provenance())
    text = json.dumps(result, indent=1, default=str)
    if echo:
        print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
        print(f"wrote {json_path}")


def cpu_machine() -> dict[str, str]:
    """The Python, numpy and CPU a CPU benchmark ran on."""
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpu": platform.processor() or platform.machine()}


class ResultFile:
    """The benchmark's JSON, rewritten after every part: what finished survives a part that fails."""

    def __init__(self, path: Path | None, args: argparse.Namespace, **header):
        device = bench_device(args)
        model = f"Llama-3.1-8B shape ({args.layers or 32} layers), random bf16"
        self.path = path
        self.data: dict = {
            **provenance(),
            "config": {
                "model": "tiny llama fp32" if args.tiny else model,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "page_size": args.page_size,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            **header,
            "results": {},
            "errors": {},
            "complete": False,
        }
        self.write()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Runs one part; an exception is recorded (and printed) instead of ending the benchmark."""
        say(f"{name}: start")
        try:
            with timer(sync=False) as t:
                yield
        except Exception:  # noqa: BLE001 - the other parts still run; the error is in the JSON
            self.data["errors"][name] = traceback.format_exc()
            say(f"{name}: FAILED\n{self.data['errors'][name]}")
        else:
            say(f"{name}: done in {t.seconds:.1f}s")
        self.write()

    def finish(self) -> dict:
        """Marks the file complete; exits with status 1 if any part failed."""
        self.data["complete"] = True
        self.write()
        if self.data["errors"]:
            say(f"parts that failed: {', '.join(self.data['errors'])}")
            sys.exit(1)
        return self.data

    def write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1))


# ------------------------------------------------------------------------------------------------- models
def build_llama(
    tiny: bool, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None
) -> torch.nn.Module:
    """A tiny fp32 Llama (CPU self-checks) or the Llama-3.1-8B shape in `dtype` (`layers` deep, default 32),
    random weights, on `device`.

    EOS is unset: random weights would otherwise stop generations at arbitrary points.
    """
    if tiny:
        config = tiny_config("llama", eos_token_id=None)
    else:
        config = transformers.LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": layers or 32})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def seeded_model(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The benchmark's model with weights from `args.seed`: every process that builds it gets the same."""
    torch.manual_seed(args.seed)
    return build_llama(args.tiny, device, layers=args.layers)
