"""Merging split-KV partial results: the kernel that combines per-split partial outputs and their
log2-sum-exps into a row's output, the partial buffers, and the split heuristic (the decode, extend and
shared-prefix kernels of the default mode)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION
from .triton_attention_common import _sm_count

__all__ = ["pick_num_kv_splits"]


# split counts (and the strides that follow them) vary with the batch: not specialized on, no recompiles
@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _merge_splits_kernel(
    Mid_o, Mid_lse, Out, Sinks, num_splits, num_heads,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # One program merges BLOCK_H heads of one row: few programs, each streaming [heads, D] tiles per part.
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = heads < num_heads
    d_mask = offs_d < HEAD_DIM
    lse_row = Mid_lse + row * stride_lb + heads * stride_lh
    lse = tl.load(lse_row[:, None] + offs_s[None, :], mask=h_mask[:, None] & (offs_s[None, :] < num_splits),
                  other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:
        sink = tl.load(Sinks + heads, mask=h_mask, other=float("-inf"))
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    o_rows = Mid_o + row * stride_mb + heads[:, None] * stride_mh + offs_d[None, :]
    for part in range(0, num_splits):
        lse_p = tl.load(lse_row + part, mask=h_mask, other=float("-inf"))
        seen = h_mask & (lse_p != float("-inf"))  # a part that saw no key weighs 0: its values are not read
        o_p = tl.load(o_rows + part * stride_ms, mask=seen[:, None] & d_mask[None, :], other=0.0)
        acc += o_p * tl.exp2(lse_p - m)[:, None]
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_ptrs = Out + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def _split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Per-split partial outputs ``[N, Hq, S, Dv]`` and log2-sum-exps ``[N, Hq, S]`` (fp32) for ``out``
    ``[N, Hq, Dv]``, and their strides as the kernels take them; with one split, unused placeholders."""
    if num_splits == 1:
        return out, out, (0, 0, 0, 0, 0)
    n, hq, dv = out.shape
    mid_o = torch.empty((n, hq, num_splits, dv), dtype=torch.float32, device=out.device)
    mid_lse = torch.empty((n, hq, num_splits), dtype=torch.float32, device=out.device)
    return mid_o, mid_lse, (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
                            mid_lse.stride(1))


def pick_num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int = 132,
                       min_split_tokens: int = 256, max_splits: int = 64, waves: int = 2) -> int:
    """Number of KV splits so that ``batch * kv_heads * splits`` programs fill at most ``waves`` waves of
    SMs (a program more would start a wave of its own), keeping each split at least ``min_split_tokens``
    long."""
    progs = max(1, batch * num_kv_heads)
    want = waves * num_sms // progs
    by_len = max(1, triton.cdiv(max(max_kv_len, 1), min_split_tokens))
    return int(max(1, min(want, by_len, max_splits)))


MERGE_MIN_BLOCK_S = 16  # split counts up to this share one compiled merge kernel
MERGE_TILE_ELEMENTS = 4096  # most [heads, D] values one merge program holds a part of


def _merge_heads_per_program(rows: int, heads: int, block_d: int, device: torch.device) -> int:
    """Heads a merge program takes: as many as fit a tile while the grid keeps two programs an SM."""
    block_h = min(triton.next_power_of_2(heads), max(1, MERGE_TILE_ELEMENTS // block_d))
    while block_h > 1 and rows * triton.cdiv(heads, block_h) < 2 * _sm_count(device):
        block_h //= 2
    return block_h


def _merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                  sinks: torch.Tensor, has_sinks: bool) -> None:
    """Combines per-split partial outputs ``[N, Hq, S, D]`` (and their log2-sum-exps) into ``out``; the
    sinks (log2 units) join the softmax denominator here, once."""
    n, hq, _, d = mid_o.shape
    block_d = triton.next_power_of_2(d)
    block_h = _merge_heads_per_program(n, hq, block_d, mid_o.device)
    _merge_splits_kernel[(n, triton.cdiv(hq, block_h))](
        mid_o, mid_lse, out, sinks, num_splits, hq, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(MERGE_MIN_BLOCK_S, triton.next_power_of_2(num_splits)),
        BLOCK_H=block_h, HAS_SINKS=has_sinks,
        num_warps=4, enable_fp_fusion=FP_FUSION,
    )
