"""The paged KV pool: one tensor holding every layer's keys and values, addressed by slot index."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from ..kernels.store import store_kv

logger = logging.get_logger(__name__)

CPU_DEFAULT_TOKENS = 32768


@dataclass(frozen=True)
class KVShape:
    """Per-token K/V geometry of a decoder: layers, KV heads, the K head size and the V head size.

    ``latent``: the layers cache compressed latents (MLA, DeepSeek-V2/V3 in transformers) that the model
    expands into K/V after reading them back, so a forward must be handed every row's whole context.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim
    latent: bool = False

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

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
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.value_dim) * element


def pool_size_tokens(
    shape: KVShape,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int,
    max_total_tokens: int | None,
    mem_fraction: float,
    reserve_bytes: int = 0,
) -> int:
    """Pool capacity in tokens: `max_total_tokens`, else `mem_fraction` of the free GPU memory left after
    `reserve_bytes` (what the engine's CUDA graphs will take), else a default."""
    if max_total_tokens is not None:
        if max_total_tokens < page_size:
            raise ValueError(f"max_total_tokens={max_total_tokens} is smaller than one page ({page_size})")
        return max_total_tokens
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(free - reserve_bytes, 0) * mem_fraction) // shape.bytes_per_token(dtype)
    return CPU_DEFAULT_TOKENS


class KVPool:
    """K/V storage of every layer, addressed by slot; knows nothing of tokens.

    One flat `buffer`: all layers' keys `[layers, slots, kv_heads, head_dim]`, then all layers' values
    `[layers, slots, kv_heads, value_dim]` (with equal head sizes, the layout of
    `[2, layers, pages, page_size, kv_heads, head_dim]`). Slot `p * page_size + i` is row i of page p.
    Allocated as a normal tensor even inside `torch.inference_mode()`, so that radix calls made later
    outside it can still write to it.
    """

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
        slots = num_pages * page_size
        k_shape = (shape.num_layers, slots, shape.num_kv_heads, shape.head_dim)
        v_shape = (shape.num_layers, slots, shape.num_kv_heads, shape.value_dim)
        k_numel = k_shape[0] * k_shape[1] * k_shape[2] * k_shape[3]
        v_numel = v_shape[0] * v_shape[1] * v_shape[2] * v_shape[3]
        with torch.inference_mode(False), torch.no_grad():
            self.buffer = torch.zeros(k_numel + v_numel, dtype=dtype, device=device)
            self._k_all = self.buffer[:k_numel].view(k_shape)
            self._v_all = self.buffer[k_numel:].view(v_shape)
            self._k = list(self._k_all.unbind(0))
            self._v = list(self._v_all.unbind(0))
        # no message here: the engine announces the pool once, its managed tokens (scratch page excluded)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (keys and values of every layer)."""
        return self.buffer.numel() * self.buffer.element_size()

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
        src_t = torch.as_tensor(src, device=self.device)
        dst_t = torch.as_tensor(dst, device=self.device)
        with torch.no_grad():
            self._k_all[:, dst_t] = self._k_all[:, src_t]
            self._v_all[:, dst_t] = self._v_all[:, src_t]

    @property
    def keys(self) -> torch.Tensor:
        """Every layer's keys, `[layers, slots, kv_heads, head_dim]` (a view of `buffer`)."""
        return self._k_all

    @property
    def values(self) -> torch.Tensor:
        """Every layer's values, `[layers, slots, kv_heads, value_dim]` (a view of `buffer`)."""
        return self._v_all

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer: int) -> None:
        """Writes one layer's `k` (`[T, kv_heads, head_dim]`) and `v` (`[T, kv_heads, value_dim]`)."""
        k, v = k.to(self.dtype), v.to(self.dtype)
        with torch.no_grad():
            store_kv(self._k[layer], self._v[layer], out_loc, k, v, self.store_backend)
