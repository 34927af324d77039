"""Triton attention kernels over a paged KV pool (the public entry points; the kernels live in
:mod:`.triton_extend`, :mod:`.triton_decode` and :mod:`.triton_attention_common`).

Two entry points:

* :func:`extend_attention` -- prefill/extend: each row has ``prefix_lens[i]`` cached tokens (read from the
  pool through ``prefix_kv_indices``) followed by new tokens (read from the contiguous ``k_new``/``v_new``).
  One program computes a ``BLOCK_M`` x ``head_dim`` output tile for one query head with an online softmax.
  Few short query blocks over long prefixes (a question after a cached few-shot prefix) split each prefix
  into chunks computed in parallel, merged as in decode.
* :func:`decode_attention` -- one query token per row, split-KV (flash-decoding). Stage 1 computes a
  normalized partial output and a log2-sum-exp per (row, query-head, split); all query heads that share a KV
  head are handled by the same program, so each K/V tile is read once per KV head. A merge kernel combines
  the splits.

Pool layout: ``k_cache``/``v_cache`` are ``[num_slots, num_kv_heads, head_dim]``; a row's keys live at
arbitrary slots given in position order. All softmax math is fp32, in base 2 (``log2(e)`` is folded into
the scale). Sliding windows follow Hugging Face semantics: query position ``p`` sees key position ``k``
iff ``k <= p`` and ``p - k < window``. Soft-capping (Gemma 2) is ``softcap * tanh(scores / softcap)``,
applied after scaling and before masking.
"""

from __future__ import annotations

from typing import Any

import torch

from .triton_decode import decode_attention, decode_config
from .triton_extend import extend_attention, extend_config
from .triton_split_merge import pick_num_kv_splits

__all__ = ["extend_attention", "decode_attention", "pick_num_kv_splits", "kernel_configs"]


def kernel_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Launch configs that would be used (for logging / benchmarks)."""
    return {
        "extend": extend_config(head_dim, dtype, device),
        "decode": decode_config(head_dim, dtype, device),
    }

