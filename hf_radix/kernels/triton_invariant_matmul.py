"""Batch-invariant matrix product ``x @ weight.T (+ bias)``: one tile shape for every row count.

A GEMM library picks its kernel (tile shape, split along K) by the problem's shape, so a row's product can
round differently when the call holds 3 rows than when it holds 3,000. Here every output element is one
program's fp32 accumulation over K in blocks of ``BLOCK_K``, in increasing order, with no split along K, so a
row's result depends on that row and the weight only (deterministic mode's linear layers). The tile shape
(`linear_config`) may follow the problem's shape; the split of K never does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import FP_FUSION, interpreting
from .triton_attention_common import _dot_prec, _sm_count

__all__ = ["FEW_ROWS", "candidate_configs", "invariant_matmul", "linear_config"]


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of output tile ``tile``: GROUP_M row tiles of one column tile come back to
    back, so the weight tile stays in L2 for them."""
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = tile // per_group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % size_m) * BLOCK_M, (tile % per_group) // size_m * BLOCK_N


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    X, W, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PREC: tl.constexpr,
):
    off_m, off_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)  # rows past M re-read valid ones; their results are not stored
    cols = (offs_n % N).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc, w_desc, out_desc, Bias, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # Tensor-memory loads (tiles past the edges read 0, stores past them are dropped); with NUM_PROGRAMS > 0
    # persistent: each program walks the tiles NUM_PROGRAMS apart (`_tile_origin`'s order).
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    step = NUM_PROGRAMS if NUM_PROGRAMS > 0 else tiles
    for tile in tl.range(tl.program_id(0), tiles, step, flatten=NUM_PROGRAMS > 0,
                         warp_specialize=WARP_SPECIALIZE):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


FEW_ROWS = 8  # products of up to this many rows (small decode steps) take the last-but-one candidate
_FILL = 0.8  # a tile shape fills the GPU when it gives at least this share of the SMs a tile


@functools.cache
def candidate_configs(dtype: torch.dtype, device: torch.device) -> tuple[dict, ...]:
    """The launch configs `linear_config` picks from, largest tiles first; all split K alike."""
    if device.type != "cuda" or interpreting():
        return ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4, "num_stages": 1},)
    if dtype == torch.float32:
        return ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},)
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    narrow = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    thin = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6}
    if torch.cuda.get_device_capability(device)[0] < 9:
        return big, narrow, thin
    # Hopper: tensor-memory loads; the largest tiles persistent and warp-specialized (bench/linear_bench.py)
    wide = {**big, "BLOCK_N": 256, "TMA": True, "NUM_PROGRAMS": _sm_count(device), "WARP_SPECIALIZE": True}
    return wide, {**big, "num_stages": 4, "TMA": True}, {**narrow, "TMA": True}, thin


def linear_config(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The launch config of a product of `rows` rows and `columns` output columns: the largest tiles that
    still give most SMs a tile (row tiles no taller than the rows need), the most tiles where none does;
    `FEW_ROWS` rows or fewer take the last-but-one candidate. Every candidate splits K alike, so each output
    element accumulates the same products in the same order under any of them: a row's bits do not depend on
    the pick (tests/test_deterministic_gpu.py and bench/linear_bench.py check it)."""
    configs = candidate_configs(dtype, device)
    if len(configs) == 1:
        return configs[0]
    if rows <= FEW_ROWS:
        return configs[-2]
    fitting = [c for c in configs if c["BLOCK_M"] <= max(rows, 64)]
    tiles = [triton.cdiv(rows, c["BLOCK_M"]) * triton.cdiv(columns, c["BLOCK_N"]) for c in fitting]
    for config, count in zip(fitting, tiles):
        if count >= _FILL * _sm_count(device):
            return config
    return fitting[tiles.index(max(tiles))]


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each row's result independent of the other rows (module doc).

    x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None; fp32 accumulation, the output in x's dtype.
    """
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.view(*x.shape[:-1], n)
    cfg = dict(config if config is not None else linear_config(m, n, weight.dtype, x.device))
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    common = dict(HAS_BIAS=bias is not None, DOT_PREC=_dot_prec(x.dtype), enable_fp_fusion=FP_FUSION)
    bias_arg = bias if bias is not None else out
    # tensor-memory loads need 16-byte aligned row strides: a weight shape without them takes the other kernel
    if cfg.pop("TMA", False) and k * x.element_size() % 16 == 0 and n * x.element_size() % 16 == 0:
        if rows.data_ptr() % 16:  # tensor-memory loads need 16-byte aligned rows: a fresh copy has them
            rows = rows.clone()
        programs = cfg.get("NUM_PROGRAMS", 0)
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        _matmul_tma_kernel[(min(tiles, programs) if programs else tiles,)](
            TensorDescriptor.from_tensor(rows, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]), bias_arg, m, n, k,
            **common, **{"NUM_PROGRAMS": 0, "WARP_SPECIALIZE": False, **cfg},
        )
    else:
        _matmul_kernel[(tiles,)](
            rows, weight, bias_arg, out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
            EVEN_K=k % cfg["BLOCK_K"] == 0, **common, **cfg,
        )
    return out.view(*x.shape[:-1], n)
