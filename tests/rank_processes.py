"""Tests over several processes: each rank of one process group runs a function whose result (JSON) the
test reads back, by rank."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(tmp_path: Path, backend: str, body: Callable[..., dict], *args: Any, world: int = 2) -> list:
    """Runs ``body(rank, device, *args)`` on each of `world` ranks (gloo: the CPU; nccl: GPU ``rank``), as
    torchrun would start them, and returns their results by rank. `body` must be a module-level function
    (it is pickled by name into the spawned processes)."""
    spawn_args = (world, str(tmp_path / "init"), str(tmp_path), backend, body, args)
    mp.spawn(_rank_main, args=spawn_args, nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, backend: str, body: Callable[..., dict],
               args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = body(rank, device, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
