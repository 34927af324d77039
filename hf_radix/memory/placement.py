"""KV pools for models whose layers live on several devices (accelerate `device_map`, e.g. "auto").

Each layer's K/V stay on the device that layer runs on: `PlacedKVPool` holds one `KVPool` chunk per device,
covering that device's layers, all with the same slot numbering, so the radix tree and the cache manager
(which deal in slots, not devices) need not know. The store kernel and the attention of a layer run on
its device, under that device's guard (`layer_device`); `ForwardBatch` metadata is copied to each device
once per forward (`RadixCache.batch_on`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers.utils import logging

from ..integrations.distributed import min_over_group
from .kv_pool import KVPool, KVShape, pool_size_tokens

logger = logging.get_logger(__name__)


def _as_device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _hook_devices(model: torch.nn.Module) -> dict[str, torch.device]:
    """Execution devices of accelerate's hooks by module name (where weights may be offloaded)."""
    found = {}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for h in [hook, *getattr(hook, "hooks", ())]:
            device = getattr(h, "execution_device", None)
            if device is not None:
                found[name] = _as_device(device)
                break
    return found


def _module_device(
    name: str, module: torch.nn.Module, hooked: dict[str, torch.device]
) -> torch.device | None:
    """Where `module` computes: its (or its nearest hooked ancestor's) accelerate execution device, else
    the device of its first parameter or buffer."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        device = hooked.get(".".join(parts[:end]))
        if device is not None:
            return device
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return None if tensor is None else tensor.device


def layer_devices(model: torch.nn.Module, num_layers: int, default: torch.device) -> list[torch.device]:
    """The device each attention layer (`layer_idx` 0..num_layers-1) runs on; `default` for any not found."""
    hooked = _hook_devices(model)
    devices: dict[int, torch.device] = {}
    for name, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or not 0 <= index < num_layers or index in devices:
            continue
        device = _module_device(name, module, hooked)
        if device is not None and device.type != "meta":
            devices[index] = device
    return [devices.get(i, default) for i in range(num_layers)]


def hidden_output_device(model: torch.nn.Module, default: torch.device) -> torch.device:
    """Where the decoder's final hidden states (which `logits_to_keep` indexes) come out."""
    hooked = _hook_devices(model)
    names = {module: name for name, module in model.named_modules()}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for module in (getattr(decoder, "norm", None), model.get_output_embeddings()):
        if isinstance(module, torch.nn.Module) and module in names:
            device = _module_device(names[module], module, hooked)
            if device is not None and device.type != "meta":
                return device
    return default


def batch_to(batch, device: torch.device):
    """A copy of a (dataclass) forward batch with every tensor field on `device`."""
    moved = {
        f.name: getattr(batch, f.name).to(device, non_blocking=True)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model's modules by a device map."""
    return bool(getattr(model, "hf_device_map", None)) or bool(_hook_devices(model))


@contextlib.contextmanager
def _device_guard(device: torch.device) -> Iterator[None]:
    """Makes `device` current for kernels that launch on the current CUDA device and stream."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def pool_devices(pool) -> list[torch.device]:
    """The devices holding the pool's K/V (one for a `KVPool`)."""
    return list(pool.chunks) if isinstance(pool, PlacedKVPool) else [pool.device]


def require_one_device(pool, feature: str) -> None:
    """Refuses `feature` for a pool split over several devices (it reads one pool buffer)."""
    if isinstance(pool, PlacedKVPool):
        raise NotImplementedError(
            f"hf_radix: {feature} is not supported for a KV pool split over several devices "
            f"({', '.join(str(d) for d in pool.chunks)}: a device_map model whose layers span them); "
            "place the model on one device, or go without it"
        )


def layer_device(pool, layer: int):
    """Context for running one layer's kernels on the pool's device for that layer (a no-op for KVPool)."""
    if isinstance(pool, PlacedKVPool):
        return _device_guard(pool.layer_devices[layer])
    return contextlib.nullcontext()


class PlacedKVPool:
    """K/V pool split by device: layer l's K/V live on `layer_devices[l]`; the `KVPool` interface."""

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        layer_devices: Sequence[torch.device | str],
        store_backend: str = "auto",
    ):
        if len(layer_devices) != shape.num_layers:
            raise ValueError(f"got {len(layer_devices)} layer devices for {shape.num_layers} layers")
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.layer_devices = [_as_device(d) for d in layer_devices]
        self.chunks: dict[torch.device, KVPool] = {}
        self._where: list[tuple[KVPool, int]] = []  # layer -> (its chunk, its index inside the chunk)
        for device in dict.fromkeys(self.layer_devices):
            layers = [i for i, d in enumerate(self.layer_devices) if d == device]
            chunk_shape = dataclasses.replace(shape, num_layers=len(layers))
            with _device_guard(device):
                self.chunks[device] = KVPool(chunk_shape, num_pages, page_size, dtype, device, store_backend)
        local = {device: 0 for device in self.chunks}
        for device in self.layer_devices:
            self._where.append((self.chunks[device], local[device]))
            local[device] += 1

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def store_backend(self) -> str:
        return next(iter(self.chunks.values())).store_backend

    @store_backend.setter
    def store_backend(self, name: str) -> None:
        for chunk in self.chunks.values():
            chunk.store_backend = name

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.chunks.values())).dtype

    @property
    def device(self) -> torch.device:
        """The device of layer 0 (where the batch metadata is built)."""
        return self.layer_devices[0]

    @property
    def nbytes(self) -> int:
        """Bytes held on all devices together."""
        return sum(chunk.nbytes for chunk in self.chunks.values())

    def k_cache(self, layer: int) -> torch.Tensor:
        chunk, index = self._where[layer]
        return chunk.k_cache(index)

    def v_cache(self, layer: int) -> torch.Tensor:
        chunk, index = self._where[layer]
        return chunk.v_cache(index)

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies every layer's K/V from slots `src` to slots `dst`, on each device."""
        for device, chunk in self.chunks.items():
            with _device_guard(device):
                chunk.copy_slots(src, dst)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Writes one layer's new K/V; `out_loc` on that layer's device."""
        chunk, index = self._where[layer]
        with _device_guard(self.layer_devices[layer]):
            chunk.store_kv(k, v, out_loc, index)


def placed_pool_tokens(
    shape: KVShape,
    dtype: torch.dtype,
    devices: Sequence[torch.device],
    page_size: int,
    max_total_tokens: int | None,
    mem_fraction: float,
    reserve_bytes: int = 0,
) -> int:
    """Pool capacity for layers on `devices`: what the tightest device affords for its share of layers
    (`reserve_bytes` kept free on each)."""
    counts: dict[torch.device, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    return min(
        pool_size_tokens(
            dataclasses.replace(shape, num_layers=n), dtype, device, page_size, max_total_tokens,
            mem_fraction, reserve_bytes,
        )
        for device, n in counts.items()
    )


def kv_devices(model: torch.nn.Module, num_layers: int, default_device: torch.device) -> list[torch.device]:
    """The device of each layer's K/V: where accelerate dispatched the layer, else `default_device`."""
    if is_dispatched(model):
        return layer_devices(model, num_layers, default_device)
    return [default_device] * num_layers


def make_kv_pool(
    devices: list[torch.device],
    shape: KVShape,
    dtype: torch.dtype,
    default_device: torch.device,
    page_size: int,
    max_total_tokens: int | None,
    mem_fraction: float,
    store_backend: str,
    group=None,
    reserve_bytes: int = 0,
) -> tuple[KVPool | PlacedKVPool, int]:
    """The engine's pool (one page past `num_pages`, for padded graph rows) and its number of managed pages.

    Layers on other `devices` (`kv_devices`) than `default_device` get a `PlacedKVPool`; otherwise one
    `KVPool` on `default_device`. With a (tensor-parallel) `group`, every rank takes the smallest rank's
    capacity, so all make the same scheduling decisions.
    """
    tokens = placed_pool_tokens(
        shape, dtype, devices, page_size, max_total_tokens, mem_fraction, reserve_bytes
    )
    if group is not None:
        tokens = min_over_group(tokens, group)
    num_pages = tokens // page_size
    if set(devices) == {default_device}:  # one device (a device map onto one GPU included): one buffer
        return KVPool(shape, num_pages + 1, page_size, dtype, default_device, store_backend), num_pages
    logger.info("hf_radix: KV pool split over %s", sorted({str(d) for d in devices}))
    return PlacedKVPool(shape, num_pages + 1, page_size, dtype, devices, store_backend), num_pages
