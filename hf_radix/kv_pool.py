"""The paged KV pool: one tensor holding every layer's keys and values, addressed by slot index."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from .kernels.store import store_kv

logger = logging.get_logger(__name__)

CPU_DEFAULT_TOKENS = 32768


@dataclass(frozen=True)
class KVShape:
    """Per-token K/V geometry of a decoder: layers, KV heads and head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVShape:
        """Reads the geometry from a transformers (text) config."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def pool_size_tokens(
    shape: KVShape,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int,
    max_total_tokens: int | None,
    mem_fraction: float,
) -> int:
    """Pool capacity in tokens: `max_total_tokens`, else `mem_fraction` of free GPU memory, else a default."""
    if max_total_tokens is not None:
        if max_total_tokens < page_size:
            raise ValueError(f"max_total_tokens={max_total_tokens} is smaller than one page ({page_size})")
        return max_total_tokens
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * mem_fraction) // shape.bytes_per_token(dtype)
    return CPU_DEFAULT_TOKENS


class KVPool:
    """K/V storage `[2, layers, pages, page_size, kv_heads, head_dim]`; knows nothing of tokens."""

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        store_backend: str = "auto",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.store_backend = store_backend
        self.buffer = torch.zeros(
            (2, shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim),
            dtype=dtype,
            device=device,
        )
        slots = num_pages * page_size
        self._k = [
            self.buffer[0, layer].view(slots, shape.num_kv_heads, shape.head_dim)
            for layer in range(shape.num_layers)
        ]
        self._v = [
            self.buffer[1, layer].view(slots, shape.num_kv_heads, shape.head_dim)
            for layer in range(shape.num_layers)
        ]
        logger.info(
            "KV pool: %d tokens, %.2f GiB", slots, self.buffer.numel() * self.buffer.element_size() / 2**30
        )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of one layer as `[slots, kv_heads, head_dim]`."""
        return self._k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of one layer as `[slots, kv_heads, head_dim]`."""
        return self._v[layer]

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies every layer's K/V from slots `src` to slots `dst`."""
        if len(src) == 0:
            return
        flat = self.buffer.view(2, self.shape.num_layers, self.num_slots, self.shape.num_kv_heads, -1)
        src_t = torch.as_tensor(src, device=self.device)
        flat[:, :, torch.as_tensor(dst, device=self.device)] = flat[:, :, src_t]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Writes `k`, `v` (`[T, kv_heads, head_dim]`) of one layer to the slots `out_loc`."""
        store_kv(
            self._k[layer], self._v[layer], out_loc, k.to(self.dtype), v.to(self.dtype), self.store_backend
        )
