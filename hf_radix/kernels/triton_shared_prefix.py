"""Shared-prefix (cascade) attention over the paged KV pool, for decode and extend.

Rows whose cached prefix is the same tree node read that prefix once per *tile of queries* instead of
once per row. A batch is described by two tile tables built on the host
(:mod:`hf_radix.paged_attention.prefix_groups`):

* **prefix tiles** -- one per (group, chunk of up to ``prefix_tile_q`` of the group's query tokens): the
  group's shared prefix K/V are loaded once per (tile, KV head, split) and attended by every query of the
  tile and every query head of that KV head, packed into the M dimension of ``tl.dot``. Each query gets a
  normalized partial output and its log2-sum-exp per split ("part").
* **suffix tiles** -- one per (row, chunk of up to ``suffix_tile_q`` of its new tokens): the row's own
  context after the shared prefix (its private cached tokens and its new tokens), split-KV like today's
  per-row kernels. With one suffix split the suffix program folds the prefix parts (and the attention
  sink) into its own result and writes the final output; with several, every part goes to the split-KV
  merge kernel shared with the per-row kernels (parts of queries without a shared prefix are emptied).

The launch order is a ``mode`` (`MODES`, equal results): the prefix launch, then the suffix launch folding
its parts in ("fold"), or writing its own part for the merge kernel ("merge"); that, with the prefix launch
on a side stream beside the suffix launch ("overlap"), or with both in one grid ("fused"), so that the few
long prefix programs do not leave the GPU underfilled while the suffix programs wait for them.

A tile row of the table is ``(kv_start, kv_pos0, kv_len, q_start, q_len)``: keys ``j < kv_len`` live at
slots ``slots[kv_start + j]`` and have absolute positions ``kv_pos0 + j``; the queries are the token
indices (rows of ``q``) ``prefix_queries[q_start : q_start + q_len]`` of a prefix tile, the consecutive
tokens ``q_start .. q_start + q_len - 1`` of a suffix tile, at absolute positions ``query_pos[token]``.
Masks are by absolute position (causal, and Hugging Face sliding windows: ``p`` sees ``k`` iff ``k <= p``
and ``p - k < window``), so a window shorter than the prefix reads only the window. Tables are padded with
``q_len == 0`` rows (no work), so a batch of any shape up to the buffers' capacity runs in one static grid
inside a CUDA graph; every size the launch needs is a python int known to the caller (no host sync).

Attention sinks (gpt-oss ``s_aux``: one logit per query head added to the softmax denominator only) are
added exactly once, where the parts are combined. K and V may have different head sizes (MLA). All
softmax math is fp32 in base 2, as in :mod:`hf_radix.kernels.triton_attention`, whose device helpers
(``triton_attention_common``) these kernels share.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from ..paged_attention.prefix_groups import MODES, TILE_FIELDS, SharedPrefixBuffers
from . import interpreting
from .triton_attention_common import (
    _check_common,
    _check_out,
    _dot_prec,
    _last_dim_contig,
    _launch,
    _scales,
    _sinks_log2,
    _window,
)
from .triton_decode import decode_config
from .triton_shared_prefix_kernels import _shared_prefix_fused_kernel, _shared_prefix_tile_kernel
from .triton_split_merge import _merge_splits

__all__ = ["MODES", "shared_prefix_attention", "tile_config"]


_SAFE_CFG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


# --------------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------------


def _block_m(tile_q: int, group: int) -> int:
    return max(16, triton.next_power_of_2(tile_q * group))


def tile_config(block_m: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                mode: str = "fold") -> dict[str, int]:
    """Launch config of the tile kernel for ``block_m`` (query, head) rows per program.

    Narrow tiles (one row's query heads: decode suffix tiles, ``block_m`` 16) are bandwidth-bound like the
    per-row decode kernel's programs, of the same shape, and take its config (``decode_config``; on sm_90
    BLOCK_N 64, 4 warps, 3 stages: 98% of HBM bandwidth in its sweep), as off CUDA. Wide tiles (a group's
    queries, 128 rows) are tensor-core tiles like the extend kernel's BLOCK_M 128 tiles: BLOCK_N 64 with 8
    warps (a 128x128 fp32 accumulator is 64 registers a thread) and 3 stages (64 KB of shared memory at
    head_dim 128 in bf16; at head_dim 256, 2 stages and 128 KB, as the extend kernel's tuned d256 config).
    Beside the suffix launch (``mode`` "overlap", "fused") wide tiles cap their registers at 160 a thread
    (231 uncapped on sm_90 at head_dim 128, no spill at 160) so that suffix programs fit on an SM beside a
    prefix program. On the side stream ("overlap") they take BLOCK_N 128 in 2 stages (half the iterations
    of a prefix; in the gsp-8x32 layer's sweep 109.9 us against 113.2 us for BLOCK_N 64 in 3 stages).
    """
    if block_m < 128 or device.type != "cuda" or interpreting():
        return decode_config(head_dim, dtype, device)
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if triton.next_power_of_2(head_dim) <= 128:
        if mode == "overlap":
            return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "maxnreg": 160}
        cfg = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        return {**cfg, "maxnreg": 160} if mode == "fused" else cfg
    return {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def _check_tiles(tiles: SharedPrefixBuffers, num_tokens: int) -> None:
    for name in ("prefix_tiles", "suffix_tiles"):
        t = getattr(tiles, name)
        if t.dim() != 2 or t.shape[1] != TILE_FIELDS or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 [N, {TILE_FIELDS}] tensor")
    for name in ("prefix_queries", "query_pos", "query_shared"):
        if getattr(tiles, name).dtype != torch.int32:
            raise ValueError(f"{name} must be int32")
    if tiles.query_pos.shape[0] < num_tokens or tiles.query_shared.shape[0] < num_tokens:
        raise ValueError(f"query_pos / query_shared must cover the {num_tokens} query tokens")


class _Launches:
    """The launches of one shared-prefix attention call, with its partial results allocated up front
    (before any stream fork, on the caller's stream): the prefix tiles, the suffix tiles (folding the
    prefix parts in and writing the output when ``final``), the merge of every part (when not ``final``),
    or both tile kinds in one grid (``fused``). Benchmarks time them one by one."""

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 tiles: SharedPrefixBuffers, scaling: float, num_prefix_splits: int, num_suffix_splits: int,
                 sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                 out: torch.Tensor | None, mode: str, side_stream: torch.cuda.Stream | None = None,
                 configs: dict[int, dict[str, int]] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        hq, self.hkv, d, dv = _check_common(q, k_cache, v_cache)
        num_tokens = q.shape[0]
        _check_tiles(tiles, num_tokens)
        if num_prefix_splits < 1 or num_suffix_splits < 1:
            raise ValueError("split counts must be >= 1")
        self.q = _last_dim_contig(q)
        self.out = _check_out(out, self.q, dv)
        self.sinks, self.has_sinks = _sinks_log2(sinks, hq, self.out)
        self.empty = num_tokens == 0 or tiles.suffix_tiles.shape[0] == 0
        self.tiles, self.k_cache, self.v_cache, self.slots = tiles, k_cache, v_cache, slots
        self.group = hq // self.hkv
        self.prefix_parts = num_prefix_splits if tiles.prefix_tiles.shape[0] > 0 else 0
        self.prefix_splits, self.suffix_splits = num_prefix_splits, num_suffix_splits
        self.final = num_suffix_splits == 1 and (mode == "fold" or not self.prefix_parts)
        self.mode = mode if self.prefix_parts else "fold"
        self.num_parts = self.prefix_parts + (0 if self.final else num_suffix_splits)
        if self.num_parts and not self.empty:
            f32 = dict(dtype=torch.float32, device=q.device)
            self.mid_o = torch.empty((num_tokens, hq, self.num_parts, dv), **f32)
            self.mid_lse = torch.empty((num_tokens, hq, self.num_parts), **f32)
            m, lse = self.mid_o, self.mid_lse
            self.mstrides = (m.stride(0), m.stride(1), m.stride(2), lse.stride(0), lse.stride(1))
        else:
            self.mid_o, self.mid_lse, self.mstrides = self.out, self.out, (0, 0, 0, 0, 0)  # placeholders
        self.qk_scale, self.cap_scale, self.use_cap = _scales(scaling, softcap)
        self.window, self.use_window = _window(sliding_window)
        self.d, self.dv = d, dv
        self.side_stream = side_stream
        self.configs = configs or {}

    def _common(self) -> tuple[tuple, tuple, dict[str, Any]]:
        """(leading pointers, trailing strides, constexprs) the tile kernels share."""
        q, kc, vc, out = self.q, self.k_cache, self.v_cache, self.out
        strides = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                   out.stride(0), out.stride(1), *self.mstrides)
        consts = dict(HEAD_DIM=self.d, BLOCK_D=triton.next_power_of_2(self.d), HEAD_DIM_V=self.dv,
                      BLOCK_DV=triton.next_power_of_2(self.dv), USE_WINDOW=self.use_window,
                      SOFTCAP=self.use_cap, HAS_SINKS=self.has_sinks, DOT_PREC=_dot_prec(q.dtype))
        return (q, kc, vc, self.slots), strides, consts

    def _cfg(self, block_m: int) -> dict[str, int]:
        if block_m in self.configs:
            return dict(self.configs[block_m])
        return tile_config(block_m, max(self.d, self.dv), self.q.dtype, self.q.device, self.mode)

    def _tiles(self, is_prefix: bool) -> None:
        t = self.tiles
        table, tile_q = (t.prefix_tiles, t.prefix_tile_q) if is_prefix else (t.suffix_tiles, t.suffix_tile_q)
        splits = self.prefix_splits if is_prefix else self.suffix_splits
        part0 = 0 if is_prefix else self.prefix_parts
        head, strides, consts = self._common()
        # the suffix programs do not read the query list (their tokens are consecutive)
        args = (*head, table, t.prefix_queries, t.query_pos, t.query_shared, t.prefix_splits, self.sinks,
                self.out, self.mid_o, self.mid_lse, self.qk_scale, self.cap_scale, self.window, part0, part0,
                *strides)
        block_m = _block_m(tile_q, self.group)
        kwargs = dict(consts, GROUP=self.group, TILE_Q=tile_q, BLOCK_M=block_m,
                      FINAL=self.final and not is_prefix, IS_PREFIX=is_prefix)
        _launch(f"shared_prefix_m{block_m}", _shared_prefix_tile_kernel, (table.shape[0], self.hkv, splits),
                self._cfg(block_m), _SAFE_CFG, self.d, self.q.dtype, args, kwargs)

    def prefix(self) -> None:
        """The prefix tiles' launch: every split's partial result of each shared query."""
        if self.prefix_parts:
            self._tiles(True)

    def suffix(self) -> None:
        """The suffix tiles' launch: the output (``final``) or the suffix's partial results."""
        self._tiles(False)

    def merge(self) -> None:
        """Every part of each query into the output (no-op when ``final``)."""
        if not self.final:
            _merge_splits(self.mid_o, self.mid_lse, self.out, self.num_parts, self.sinks, self.has_sinks)

    def fused(self) -> None:
        """Prefix and suffix tiles in one grid (the suffix's results partial)."""
        t = self.tiles
        head, strides, consts = self._common()
        n_pre, n_suf = t.prefix_tiles.shape[0], t.suffix_tiles.shape[0]
        args = (*head, t.prefix_tiles, t.prefix_queries, t.suffix_tiles, t.query_pos,
                t.query_shared, t.prefix_splits, self.sinks, self.out, self.mid_o, self.mid_lse,
                self.qk_scale, self.cap_scale, self.window, self.prefix_parts, self.prefix_parts, n_pre,
                n_suf, self.prefix_splits, self.suffix_splits, *strides)
        pre_m, suf_m = _block_m(t.prefix_tile_q, self.group), _block_m(t.suffix_tile_q, self.group)
        pre_cfg, suf_cfg = self._cfg(pre_m), self._cfg(suf_m)
        kwargs = dict(consts, GROUP=self.group, NUM_KV_HEADS=self.hkv, PREFIX_TILE_Q=t.prefix_tile_q,
                      SUFFIX_TILE_Q=t.suffix_tile_q, PREFIX_BLOCK_M=pre_m, SUFFIX_BLOCK_M=suf_m)
        cfg = {"PREFIX_BLOCK_N": pre_cfg["BLOCK_N"], "SUFFIX_BLOCK_N": suf_cfg["BLOCK_N"],
               "num_warps": max(pre_cfg["num_warps"], suf_cfg["num_warps"]),
               "num_stages": min(pre_cfg["num_stages"], suf_cfg["num_stages"])}
        if "maxnreg" in pre_cfg:  # every program gets the registers of a prefix one: two an SM
            cfg["maxnreg"] = min(pre_cfg["maxnreg"], 128)
        safe = {"PREFIX_BLOCK_N": 32, "SUFFIX_BLOCK_N": 32, "num_warps": cfg["num_warps"], "num_stages": 2}
        grid = ((n_pre * self.prefix_splits + n_suf * self.suffix_splits) * self.hkv,)
        _launch(f"shared_prefix_fused_m{pre_m}_m{suf_m}", _shared_prefix_fused_kernel, grid, cfg, safe,
                self.d, self.q.dtype, args, kwargs)

    def run(self) -> torch.Tensor:
        if self.empty:
            return self.out
        if self.mode == "fused":
            self.fused()
        elif self.mode == "overlap" and self.side_stream is not None and self.q.device.type == "cuda":
            # Fork/join (also inside CUDA-graph capture): the prefix launch on a side stream beside the
            # suffix launch. Every tensor the side stream reads was allocated on the caller's stream, which
            # waits for the side stream before anything after this call can reuse their memory.
            main, side = torch.cuda.current_stream(self.q.device), self.side_stream
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self.prefix()
            self.suffix()
            main.wait_stream(side)
        else:  # "fold", "merge" (and "overlap" without a side stream: the launches write disjoint parts)
            self.prefix()
            self.suffix()
        self.merge()
        return self.out


def shared_prefix_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    tiles: SharedPrefixBuffers,
    scaling: float,
    *,
    num_prefix_splits: int = 1,
    num_suffix_splits: int = 1,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    mode: str = "fold",
    side_stream: torch.cuda.Stream | None = None,
    configs: dict[int, dict[str, int]] | None = None,
) -> torch.Tensor:
    """Attention of the query tokens ``q`` ``[T, Hq, D]`` over the pool, shared prefixes read once per tile.

    ``k_cache`` ``[slots, Hkv, D]``, ``v_cache`` ``[slots, Hkv, Dv]``; ``slots`` is the flat slot array the
    tiles index (e.g. a batch's ``kv_indices``, or the flattened request-to-slot table); the K/V of the new
    tokens must already be in the pool. ``tiles`` is the batch's
    :class:`~paged_attention.prefix_groups.SharedPrefixBuffers`. ``sinks`` ``[Hq]`` are attention-sink logits
    (natural log units), counted once in each softmax denominator. Split counts are python ints chosen by
    the caller (:func:`~hf_radix.kernels.triton_attention.pick_num_kv_splits` over tiles and longest range);
    prefixes are split into the smaller of ``num_prefix_splits`` and the count the tables hold on the device
    (``tiles.prefix_splits``, set by their ``load``), so a captured graph launched with the largest count
    replays batches of any. ``mode`` (one of `MODES`; equal results) orders the launches: ``"fold"`` the
    prefix launch, then the suffix launch folding its parts in (one suffix split); ``"merge"`` the same,
    every part merged by the merge kernel; ``"overlap"`` the prefix launch on a side stream beside the
    suffix launch (on CUDA, given ``side_stream``, best of high priority so that the SMs take the long
    prefix programs first; without one the launches run one after the other), then the merge; ``"fused"``
    both in one launch, then the merge. ``configs`` replaces the tuned launch configs by BLOCK_M (keys
    BLOCK_N, num_warps, num_stages; see `tile_config`).
    Returns ``[T, Hq, Dv]`` in ``q``'s dtype; rows of tokens outside every suffix tile are undefined.
    """
    return _Launches(q, k_cache, v_cache, slots, tiles, scaling, num_prefix_splits, num_suffix_splits,
                     sliding_window, softcap, sinks, out, mode, side_stream, configs).run()
