"""Triton extend (prefill with a cached prefix) attention over a paged KV pool.

Each row has ``prefix_lens[i]`` cached tokens (read from the pool through ``prefix_kv_indices``) followed
by new tokens (read from the contiguous ``k_new``/``v_new``). One program computes a ``BLOCK_M`` x
``head_dim`` output tile with an online softmax: by default its rows are (token, head) pairs of the query
heads that share one KV head, so K/V are read once per KV head. Rows are sorted into classes by length
on the device: short rows (decode tokens riding along in a prefill, few-token questions) get one small
tile each, longer rows large tiles laid out over the rows from ``qo_indptr``, so no row pays for the
longest one and nothing depends on host-side lengths. Few short query blocks over long prefixes (a
question after a cached few-shot prefix) split each prefix into chunks computed in parallel, merged as in
decode.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import interpreting
from .triton_attention_common import (
    _attend_tile,
    _check_common,
    _check_out,
    _dot_prec,
    _last_dim_contig,
    _launch,
    _load_kv,
    _paged_kv_loop,
    _paged_kv_visible,
    _scales,
    _sinks_log2,
    _sm_count,
    _store_rows,
    _window,
)
from .triton_split_merge import _merge_splits, _split_buffers, pick_num_kv_splits

__all__ = ["extend_attention"]

# Used when the tuned config does not fit the device (e.g. less shared memory than an H100/H200).
_EXTEND_SAFE_CFG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}

# --------------------------------------------------------------------------------------------------------
# Extend (prefill with cached prefix)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _extend_new_loop(
    acc, l_i, m_i, q, K_new, V_new, tok0, lo, hi, new_len, q_rel,
    kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Attend over the row's new tokens [lo, hi) (relative indices, contiguous in k_new/v_new)."""
    for start_n in range(lo, hi, BLOCK_N):
        rel = start_n + offs_n
        tok = (tok0 + rel).to(tl.int64)
        k_ptrs = K_new + tok[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :]
        v_ptrs = V_new + tok[:, None] * stride_vnt + kvh * stride_vnh + offs_dv[None, :]
        n_mask = rel < new_len
        k, v = _load_kv(k_ptrs, v_ptrs, n_mask, d_mask, dv_mask, MASKED, EVEN_D)
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v, n_mask, rel, 0, q_rel, qk_scale, cap_scale,
                                     window, MASKED, True, USE_WINDOW, SOFTCAP, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _extend_new_tokens(
    acc, l_i, m_i, q, K_new, V_new, tok0, first_tok, last_tok, new_len, q_rel,
    kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
    offs_n, offs_d, offs_dv, d_mask, dv_mask,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Attend (causally) over the row's new tokens, read from the contiguous k_new / v_new.

    The tile's queries are the new tokens ``first_tok..last_tok``: key blocks wholly before ``first_tok``
    need no mask (without a window), the blocks up to the diagonal do.
    """
    diag_hi = tl.minimum(last_tok + 1, new_len)
    if USE_WINDOW:
        lo = tl.maximum(first_tok - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = (first_tok // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _extend_new_loop(
            acc, l_i, m_i, q, K_new, V_new, tok0, 0, lo, new_len, q_rel,
            kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, False, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    acc, l_i, m_i = _extend_new_loop(
        acc, l_i, m_i, q, K_new, V_new, tok0, lo, diag_hi, new_len, q_rel,
        kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
        offs_n, offs_d, offs_dv, d_mask, dv_mask, True, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _tile_row(qo_indptr, num_rows, tile, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """The row that owns query tile ``tile``: row ``i`` owns the tiles from ``i + qo_indptr[i] * GP //
    BLOCK_M`` on (at least enough for its ``new_len * GP`` query rows), so ``B + T * GP // BLOCK_M`` tiles
    cover any split of ``T`` tokens into ``B`` rows."""
    count = tile * 0
    for b0 in range(0, num_rows, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        ok = offs < num_rows
        starts = tl.load(qo_indptr + offs, mask=ok, other=0) * GP // BLOCK_M + offs
        count += tl.sum((ok & (starts <= tile)).to(tl.int32), 0)
    row = count - 1
    return row, tile - (row + tl.load(qo_indptr + row) * GP // BLOCK_M)


# Values that change with the batch (row count, split count and the partial-result strides that follow from
# it), the row-class bounds (a tile size, or 2**31 - 1 for the last class) and the window are not
# specialized on (as multiples of 16 or as 1), so new lengths, batch sizes and windows never compile a new
# variant.
@triton.jit(do_not_specialize=["window", "num_splits", "num_rows", "len_lo", "len_hi", "stride_lt",
                               "stride_lh"])
def _extend_kernel(
    Q, K_new, V_new, K_cache, V_cache, Out, Mid_o, Mid_lse, Sinks,
    qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
    qk_scale, cap_scale, window, num_splits, num_rows, len_lo, len_hi,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK_GQA: tl.constexpr, ROW_GRID: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DIRECT: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # Grid (tiles * num_splits, heads). A program computes one BLOCK_M-row query tile: BLOCK_M new tokens
    # of one query head, or with PACK_GQA BLOCK_M (token, head) pairs of the query heads that share one KV
    # head, so each K/V tile is loaded once for all of them. A launch serves the rows whose query rows
    # (new tokens, times the group when packed) number in (len_lo, len_hi]: with ROW_GRID one program per
    # row (short rows, one tile each), else tiles mapped onto rows on the device (see _tile_row), so no
    # row pays for the longest one. The last (heaviest, causal) tiles are scheduled first. With
    # num_splits > 1 each program covers one chunk of the cached prefix (the last one also the new
    # tokens) and writes a partial result that the merge kernel combines.
    GP: tl.constexpr = GROUP if PACK_GQA else 1
    split = tl.program_id(0) % num_splits
    if ROW_GRID:
        row = tl.program_id(0) // num_splits
        mblk = row * 0
    else:
        tile = tl.num_programs(0) // num_splits - 1 - tl.program_id(0) // num_splits
        row, mblk = _tile_row(qo_indptr, num_rows, tile, GP, BLOCK_M, 256)
    tok0 = tl.load(qo_indptr + row)
    new_len = tl.load(qo_indptr + row + 1) - tok0
    m_start = mblk * BLOCK_M
    q_rows = new_len * GP
    if (q_rows <= len_lo) | (q_rows > len_hi) | (m_start >= q_rows):
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kvh = tl.program_id(1)
        tok = offs_m // GROUP
        heads = kvh * GROUP + offs_m % GROUP
    else:
        kvh = tl.program_id(1) // GROUP
        tok = offs_m
        heads = tl.program_id(1) + offs_m * 0
    first_tok = m_start // GP
    last_tok = (m_start + BLOCK_M - 1) // GP

    prefix_len = tl.load(prefix_lens + row)
    kv_base = tl.load(prefix_kv_indptr + row)
    EVEN_D: tl.constexpr = (HEAD_DIM == BLOCK_D) and (HEAD_DIM_V == BLOCK_DV)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = tok < new_len
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM_V

    q_tok = (tok0 + tok).to(tl.int64)
    q_ptrs = Q + q_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Finite start value so fully masked rows/blocks never produce (-inf) - (-inf).
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # ---- this split's chunk of the cached prefix, gathered through the slot array ----
    kv_idx_ptr = prefix_kv_indices + kv_base
    q_pos = prefix_len + tok
    lo = prefix_len * 0
    if USE_WINDOW:
        lo = tl.maximum(prefix_len + first_tok - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(prefix_len - lo, num_splits), BLOCK_N) * BLOCK_N
    lo = lo + split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    # prefix keys precede every query: the masked loops apply the bound and the window, no causal mask
    if USE_WINDOW:
        acc, l_i, m_i = _paged_kv_loop(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi, 0, q_pos,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, True, False, True, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)
    else:
        acc, l_i, m_i = _paged_kv_visible(
            acc, l_i, m_i, q, K_cache, V_cache, kv_idx_ptr, lo, hi,
            kvh, stride_kct, stride_kch, stride_vct, stride_vch, qk_scale, cap_scale,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    if split == num_splits - 1:
        acc, l_i, m_i = _extend_new_tokens(
            acc, l_i, m_i, q, K_new, V_new, tok0, first_tok, last_tok, new_len, tok,
            kvh, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, cap_scale, window,
            offs_n, offs_d, offs_dv, d_mask, dv_mask, USE_WINDOW, SOFTCAP, EVEN_D, BLOCK_N, DOT_PREC)

    _store_rows(acc, l_i, m_i, Out, Mid_o, Mid_lse, Sinks, q_tok[:, None], q_tok, heads, m_mask, offs_dv,
                dv_mask, split, stride_ot, stride_oh, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
                DIRECT, HAS_SINKS)


def _extend_configs(head_dim: int, dtype: torch.dtype, device: torch.device) -> list[dict[str, int]]:
    """Launch configs, one per class of rows, by increasing BLOCK_M: every class but the last serves the
    rows whose query rows fit one of its tiles (and not the previous class's); the last serves the rest."""
    if device.type != "cuda" or interpreting():
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
                {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}]
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return [{"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}]
    if block_d <= 64:
        return [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}]
    if block_d <= 128:
        return [{"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}]
    return [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
            {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}]


def extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """The config of the longest rows' class (for logging / benchmarks)."""
    return _extend_configs(head_dim, dtype, device)[-1]


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_kv_indices: torch.Tensor,
    prefix_kv_indptr: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_new_len: int | None = None,
    max_prefix_len: int | None = None,
    num_splits: int | None = None,
    pack_gqa: bool | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    configs: dict[str, int] | list[dict[str, int]] | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over (cached prefix ++ new tokens) per row.

    q ``[T, Hq, D]``; k_new ``[T, Hkv, D]``; v_new ``[T, Hkv, Dv]`` (V may be narrower than K, as in MLA);
    qo_indptr ``[B+1]``; prefix_lens ``[B]``; prefix_kv_indices/prefix_kv_indptr: CSR slot lists of each
    row's cached prefix. Returns ``[T, Hq, Dv]``. ``sinks`` ``[Hq]``: attention-sink logits (gpt-oss), one
    extra key per head that takes softmax mass and contributes no value.
    The work is laid out on the device from ``qo_indptr`` (no device->host sync, no recompiles for new
    lengths); ``max_new_len`` (max over rows of new tokens), when given, skips launches for row classes
    that cannot occur. A bound on the prefix length (``max_prefix_len``) lets few, short query blocks over
    long prefixes split each prefix into ``num_splits`` chunks run in parallel (default: enough to fill
    the GPU; without a bound, one). ``pack_gqa`` computes the query heads sharing a KV head together
    (default: whenever heads are grouped). ``configs`` replaces the tuned launch configs: one (keys
    BLOCK_M, BLOCK_N, num_warps, num_stages) or a list of them, one per row class (see `_extend_configs`).
    """
    hq, hkv, d, dv = _check_common(q, k_cache, v_cache)
    t = q.shape[0]
    if k_new.shape != (t, hkv, d) or v_new.shape != (t, hkv, dv):
        raise ValueError(
            f"k_new/v_new must be [{t}, {hkv}, {d}] / [{t}, {hkv}, {dv}], got {tuple(k_new.shape)}, "
            f"{tuple(v_new.shape)}"
        )
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise ValueError("k_new / v_new must have q's dtype")
    batch = prefix_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1 or prefix_kv_indptr.shape[0] != batch + 1:
        raise ValueError("qo_indptr and prefix_kv_indptr must have B+1 entries (B = len(prefix_lens))")
    q, k_new, v_new = _last_dim_contig(q), _last_dim_contig(k_new), _last_dim_contig(v_new)
    out = _check_out(out, q, dv)
    sinks, has_sinks = _sinks_log2(sinks, hq, out)
    if t == 0 or batch == 0 or (max_new_len is not None and max_new_len <= 0):
        return out

    qk_scale, cap_scale, use_cap = _scales(scaling, softcap)
    window, use_window = _window(sliding_window)
    group = hq // hkv
    pack = pack_gqa if pack_gqa is not None else group > 1
    gp = group if pack else 1
    heads = hkv if pack else hq
    max_q_rows = t * gp if max_new_len is None else min(max_new_len, t) * gp
    if configs is None:
        configs = _extend_configs(d, q.dtype, q.device)
    elif isinstance(configs, dict):
        configs = [configs]
    classes = _row_classes([dict(c) for c in configs], max_q_rows, batch)
    if num_splits is None:
        num_splits = 1
        if max_prefix_len is not None:
            span = min(max_prefix_len, window + max_q_rows // gp) if use_window else max_prefix_len
            bm = classes[-1][0]["BLOCK_M"]
            tiles = min(batch * triton.cdiv(max_q_rows, bm), t * gp // bm + batch)
            # One wave: an extend's partial results (a tile per split) cost more than decode's.
            num_splits = pick_num_kv_splits(tiles, heads, span, _sm_count(q.device), min_split_tokens=512,
                                            waves=1)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    mid_o, mid_lse, mstrides = _split_buffers(out, num_splits)

    strides = (
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), *mstrides,
    )
    kwargs = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), HEAD_DIM_V=dv,
                  BLOCK_DV=triton.next_power_of_2(dv), PACK_GQA=pack, USE_WINDOW=use_window, SOFTCAP=use_cap,
                  DIRECT=direct, HAS_SINKS=has_sinks, DOT_PREC=_dot_prec(q.dtype))
    for cfg, len_lo, len_hi, row_grid in classes:
        def grid(meta: dict[str, Any], row_grid: bool = row_grid) -> tuple[int, int]:
            tiles = batch if row_grid else t * gp // meta["BLOCK_M"] + batch
            return (tiles * num_splits, heads)

        args = (q, k_new, v_new, k_cache, v_cache, out, mid_o, mid_lse, sinks,
                qo_indptr, prefix_lens, prefix_kv_indices, prefix_kv_indptr,
                qk_scale, cap_scale, window, num_splits, batch, len_lo, len_hi, *strides)
        # a one-tile-per-row class keeps its BLOCK_M (its rows must fit one tile) in the fallback config
        safe = dict(_EXTEND_SAFE_CFG, BLOCK_M=cfg["BLOCK_M"]) if row_grid else _EXTEND_SAFE_CFG
        _launch(f"extend-m{cfg['BLOCK_M']}", _extend_kernel, grid, cfg, safe, d, q.dtype, args,
                dict(kwargs, ROW_GRID=row_grid))
    if not direct:
        _merge_splits(mid_o, mid_lse, out, num_splits, sinks, has_sinks)
    return out


_NO_BOUND = 2**31 - 1
# Batches of at most this many rows (a captured graph's one or two rows and its padding row) take one launch
# of the tiles mapped onto rows: the launches of the other classes would cost more than the few tiles their
# rows waste there.
FEW_ROWS = 3
RowClass = tuple[dict[str, int], int, int, bool]


def _row_classes(configs: list[dict[str, int]], max_q_rows: int, batch: int = FEW_ROWS + 1) -> list[RowClass]:
    """(config, rows' query-row count bounds (lo, hi], one program per row) per launch, for `batch` rows of
    at most ``max_q_rows`` query rows: a class whose tile holds the longest rows ends the list; at most
    `FEW_ROWS` rows that would need several classes take the last class alone. Whether a class runs one
    program per row depends on the class alone (one compiled variant each)."""
    if batch <= FEW_ROWS and len(configs) > 1 and max_q_rows > configs[0]["BLOCK_M"]:
        return [(configs[-1], 0, _NO_BOUND, False)]
    classes, lo = [], 0
    for i, cfg in enumerate(configs):
        row_grid = i < len(configs) - 1
        last = not row_grid or max_q_rows <= cfg["BLOCK_M"]
        classes.append((cfg, lo, _NO_BOUND if last else cfg["BLOCK_M"], row_grid))
        if last:
            break
        lo = cfg["BLOCK_M"]
    return classes
