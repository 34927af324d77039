"""Shared by the GPU benchmarks: the Llama-3.1-8B shape with random weights built on the device, and the
set-up the warm-start and chat benchmarks share (arguments, device, seeded model, a JSON kept current)."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers

from hf_radix.tiny import tiny_config

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


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


# ------------------------------------------------------------------- warm-start and chat benchmarks
def model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--tiny, --layers, --page-size, --seed and --out."""
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: a self-check")
    parser.add_argument("--layers", type=int, help="8B width with this many layers (a smaller shape)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results (JSON) here, after every part")
    return parser


def bench_device(args: argparse.Namespace) -> str:
    return "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"


def seeded_model(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The benchmark's model with weights from `args.seed`: every process that builds it gets the same."""
    torch.manual_seed(args.seed)
    return build_llama(args.tiny, device, layers=args.layers)


def command_line() -> str:
    """The command that runs this benchmark, as a result file records it."""
    return " ".join(["python", *sys.argv])


def write_result(result: dict, json_path: Path | None, echo: bool = True) -> None:
    """Writes a benchmark's result as JSON to `json_path`, with the command that made it; `echo` also
    prints it (benchmarks that print a table of their own pass False)."""
    result["command"] = command_line()
    text = json.dumps(result, indent=2)
    if echo:
        print(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")


def cpu_machine() -> dict[str, str]:
    """The Python, numpy and CPU a CPU benchmark ran on."""
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpu": platform.processor() or platform.machine()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_START = time.perf_counter()


def say(message: str) -> None:
    """A progress line, stamped with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", flush=True)


class ResultFile:
    """The benchmark's JSON, rewritten after every part: what finished survives a part that fails."""

    def __init__(self, path: Path | None, args: argparse.Namespace, **header):
        device = bench_device(args)
        model = f"Llama-3.1-8B shape ({args.layers or 32} layers), random bf16"
        self.path = path
        self.data: dict = {
            "command": command_line(),
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
        start = time.perf_counter()
        say(f"{name}: start")
        try:
            yield
        except Exception:  # noqa: BLE001 - the other parts still run; the error is in the JSON
            self.data["errors"][name] = traceback.format_exc()
            say(f"{name}: FAILED\n{self.data['errors'][name]}")
        else:
            say(f"{name}: done in {time.perf_counter() - start:.1f}s")
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
