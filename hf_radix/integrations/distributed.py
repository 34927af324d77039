"""The few torch.distributed collectives hf_radix uses (tensor collectives only: nothing is pickled)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def collective_device(group=None, device: torch.device | None = None) -> torch.device:
    """Where the group's collectives take tensors: the host for gloo, else `device` or the current GPU."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_json(obj, group=None, device: torch.device | None = None) -> list:
    """Every rank's JSON-serializable `obj`, in rank order, on every rank (NCCL groups: through `device`)."""
    device = collective_device(group, device)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(bytes(p[:n].cpu().numpy())) for p, n in zip(parts, lengths)]


def min_over_group(value: int, group=None) -> int:
    """The smallest of every rank's `value`."""
    tensor = torch.tensor([value], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def broadcast_from_first(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The group's first rank's `tensor` (same shape and dtype on every rank), on every rank."""
    device = collective_device(group)
    moved = tensor.to(device).contiguous()
    dist.broadcast(moved, group=group, group_src=0)
    return moved.to(tensor.device)
