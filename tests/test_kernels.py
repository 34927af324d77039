"""CPU tests for hf_radix.kernels: Triton attention kernels under TRITON_INTERPRET=1 and the KV store.

The Triton checks run in one interpreter subprocess (`tests/interpreter.py`); each pytest test asserts on its
own case.

This file also holds the float64 reference and case builders, reused by ``tests/test_kernels_gpu.py`` and
``bench/kernel_bench.py``.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from interpreter import interpreter_test, report_checks

pytestmark = pytest.mark.slow  # no transformers version changes what this tests: run once

# --------------------------------------------------------------------------------------------------------
# Case builders and float64 reference
# --------------------------------------------------------------------------------------------------------


def make_pool(num_slots: int, hkv: int, d: int, dtype: torch.dtype, device: str | torch.device,
              gen: torch.Generator, dv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache ``[num_slots, hkv, d]``, v_cache ``[num_slots, hkv, dv]``), random contents; with equal
    head sizes, views of one ``[2, num_slots, hkv, d]`` tensor."""
    if dv is None or dv == d:
        pool = torch.randn((2, num_slots, hkv, d), generator=gen, dtype=torch.float32)
        pool = pool.to(dtype=dtype, device=device)
        return pool[0], pool[1]
    k = torch.randn((num_slots, hkv, d), generator=gen).to(dtype=dtype, device=device)
    v = torch.randn((num_slots, hkv, dv), generator=gen).to(dtype=dtype, device=device)
    return k, v


def _sinks(hq: int, gen: torch.Generator, device: str | torch.device, wanted: bool) -> torch.Tensor | None:
    """Attention-sink logits per query head (gpt-oss), large enough to take real softmax mass."""
    return (2.0 * torch.randn(hq, generator=gen)).to(device) if wanted else None


def alloc_slots(total_tokens: list[int], page_size: int, gen: torch.Generator,
                extra_pages: int = 3) -> tuple[list[torch.Tensor], int]:
    """Per-row slot lists (int64, position order) from shuffled pages; returns (slots per row, num_slots)."""
    pages_per_row = [max(1, math.ceil(n / page_size)) for n in total_tokens]
    num_pages = sum(pages_per_row) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    out, p = [], 0
    for n, npg in zip(total_tokens, pages_per_row, strict=True):
        pages = perm[p:p + npg]
        p += npg
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
        out.append(slots.to(torch.int64))
    return out, num_pages * page_size


def make_extend_case(rows: list[tuple[int, int]], hq: int, hkv: int, d: int, page_size: int = 1,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                     index_dtype: torch.dtype = torch.int32, dv: int | None = None,
                     sinks: bool = False) -> dict[str, Any]:
    """rows: list of (prefix_len, new_len). New tokens' K/V are also written into the pool.

    ``dv``: V head size (default ``d``; MLA has V narrower than K). ``sinks``: random attention sinks."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d
    totals = [p + n for p, n in rows]
    slots, num_slots = alloc_slots(totals, page_size, gen)
    k_cache, v_cache = make_pool(num_slots, hkv, d, dtype, device, gen, dv)
    t = sum(n for _, n in rows)
    q = torch.randn((t, hq, d), generator=gen).to(dtype=dtype, device=device)
    k_new = torch.randn((t, hkv, d), generator=gen).to(dtype=dtype, device=device)
    v_new = torch.randn((t, hkv, dv), generator=gen).to(dtype=dtype, device=device)
    new_slots = torch.cat([s[p:] for s, (p, _) in zip(slots, rows, strict=True)]).to(device)
    k_cache[new_slots] = k_new
    v_cache[new_slots] = v_new
    qo_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for _, n in rows]), 0).tolist()),
                             dtype=torch.int32)
    prefix_lens = torch.tensor([p for p, _ in rows], dtype=torch.int32)
    prefix_kv_indptr = torch.tensor([0] + list(torch.cumsum(prefix_lens, 0).tolist()), dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int64)
    prefix_kv_indices = torch.cat([s[:p] for s, (p, _) in zip(slots, rows, strict=True)] + [empty])
    return {
        "q": q, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache,
        "qo_indptr": qo_indptr.to(device), "prefix_lens": prefix_lens.to(device),
        "prefix_kv_indices": prefix_kv_indices.to(dtype=index_dtype, device=device),
        "prefix_kv_indptr": prefix_kv_indptr.to(device),
        "rows": rows, "slots": slots, "sinks": _sinks(hq, gen, device, sinks),
    }


def make_decode_case(seq_lens: list[int], hq: int, hkv: int, d: int, page_size: int = 1,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                     index_dtype: torch.dtype = torch.int32, dv: int | None = None,
                     sinks: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    slots, num_slots = alloc_slots(seq_lens, page_size, gen)
    k_cache, v_cache = make_pool(num_slots, hkv, d, dtype, device, gen, dv)
    q = torch.randn((len(seq_lens), hq, d), generator=gen).to(dtype=dtype, device=device)
    kv_indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(seq_lens), 0).tolist()), dtype=torch.int32)
    kv_indices = torch.cat(slots + [torch.zeros(0, dtype=torch.int64)])
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache,
            "kv_indices": kv_indices.to(dtype=index_dtype, device=device), "kv_indptr": kv_indptr.to(device),
            "seq_lens": seq_lens, "slots": slots, "sinks": _sinks(hq, gen, device, sinks)}


def ref_attention_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scaling: float,
                      sliding_window: int | None, softcap: float | None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference for one row. q [n, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv] (positions 0..L-1),
    q_pos [n]; sinks [Hq]: one extra softmax logit per head whose value is zero."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0])
    keep = kpos[None, :] <= q_pos[:, None]
    if sliding_window is not None and sliding_window > 0:
        keep &= (q_pos[:, None] - kpos[None, :]) < sliding_window
    s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double().cpu()[:, None, None].expand(-1, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def ref_extend(case: dict[str, Any], scaling: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
    q = case["q"].cpu()
    kc, vc = case["k_cache"].cpu(), case["v_cache"].cpu()
    outs, t0 = [], 0
    for (p, n), slots in zip(case["rows"], case["slots"], strict=True):
        if n == 0:
            continue
        qpos = torch.arange(p, p + n)
        outs.append(
            ref_attention_row(q[t0:t0 + n], kc[slots], vc[slots], qpos, scaling, sliding_window, softcap,
                              case.get("sinks"))
        )
        t0 += n
    if not outs:
        return torch.zeros((*q.shape[:2], vc.shape[-1]), dtype=torch.float64)
    return torch.cat(outs)


def ref_decode(case: dict[str, Any], scaling: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
    q = case["q"].cpu()
    kc, vc = case["k_cache"].cpu(), case["v_cache"].cpu()
    outs = []
    for i, (n, slots) in enumerate(zip(case["seq_lens"], case["slots"], strict=True)):
        qpos = torch.tensor([n - 1])
        outs.append(
            ref_attention_row(q[i:i + 1], kc[slots], vc[slots], qpos, scaling, sliding_window, softcap,
                              case.get("sinks"))
        )
    return torch.cat(outs)


def run_extend(case: dict[str, Any], scaling: float, **kw: Any) -> torch.Tensor:
    from hf_radix.kernels.triton_attention import extend_attention

    return extend_attention(case["q"], case["k_new"], case["v_new"], case["k_cache"], case["v_cache"],
                            case["qo_indptr"], case["prefix_lens"], case["prefix_kv_indices"],
                            case["prefix_kv_indptr"], scaling, sinks=case.get("sinks"), **kw)


def run_decode(case: dict[str, Any], scaling: float, **kw: Any) -> torch.Tensor:
    from hf_radix.kernels.triton_attention import decode_attention

    return decode_attention(
        case["q"], case["k_cache"], case["v_cache"], case["kv_indices"], case["kv_indptr"], scaling,
        sinks=case.get("sinks"), **kw
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------
# Interpreter cases (executed in a subprocess with TRITON_INTERPRET=1)
# --------------------------------------------------------------------------------------------------------

# name -> (kind, builder kwargs, kernel kwargs)
INTERP_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # ragged rows: with and without prefixes, an empty row, prefix not a multiple of the block
    "extend_ragged": ("extend", dict(rows=[(0, 5), (19, 7), (0, 0), (16, 33)], hq=2, hkv=2, d=16), {}),
    "extend_gqa_pages": ("extend", dict(rows=[(21, 18), (3, 1), (0, 17)], hq=4, hkv=2, d=16, page_size=4,
                                        index_dtype=torch.int64), {}),
    "extend_window_softcap": (
        "extend", dict(rows=[(29, 20), (0, 35), (5, 2)], hq=2, hkv=1, d=16, page_size=2),
        dict(sliding_window=9, softcap=3.0),
    ),
    "extend_d24": ("extend", dict(rows=[(11, 9), (0, 18)], hq=3, hkv=1, d=24, page_size=2), {}),
    "extend_fp16": ("extend", dict(rows=[(17, 6), (0, 3)], hq=2, hkv=1, d=16, dtype=torch.float16), {}),
    "extend_bm32": ("extend", dict(rows=[(40, 45), (7, 0), (3, 33)], hq=2, hkv=1, d=16, page_size=4),
                    dict(_cfg={"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})),
    "extend_bm32_window": ("extend", dict(rows=[(40, 45), (0, 3)], hq=2, hkv=1, d=16),
                           dict(sliding_window=20,
                                _cfg={"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})),
    # the prefix split into chunks computed in parallel and merged; empty chunks, rows and splits
    "extend_splits": ("extend", dict(rows=[(40, 5), (0, 3), (7, 0), (19, 20)], hq=4, hkv=2, d=16,
                                     page_size=2), dict(num_splits=4)),
    "extend_splits_window_softcap": (
        "extend", dict(rows=[(45, 6), (3, 17)], hq=2, hkv=1, d=16),
        dict(num_splits=3, sliding_window=11, softcap=3.0,
             _cfg={"BLOCK_M": 16, "BLOCK_N": 8, "num_warps": 4, "num_stages": 1}),
    ),
    # the window's masked prefix loop with head sizes that are not their block sizes, and in fp16
    "extend_d24_window_splits": (
        "extend", dict(rows=[(45, 6), (3, 17), (0, 9)], hq=4, hkv=2, d=24, page_size=2),
        dict(sliding_window=13, softcap=3.0, num_splits=3),
    ),
    "extend_fp16_window_splits": (
        "extend", dict(rows=[(45, 6), (3, 17)], hq=4, hkv=2, d=16, dtype=torch.float16),
        dict(sliding_window=10, num_splits=2),
    ),
    # grouped query heads packed into one program (few new tokens), and not
    "extend_gqa_unpacked": ("extend", dict(rows=[(21, 18), (3, 1), (0, 17)], hq=4, hkv=2, d=16, page_size=4),
                            dict(pack_gqa=False)),
    "extend_pack_group3_window_softcap": (
        "extend", dict(rows=[(29, 20), (0, 11), (5, 2)], hq=6, hkv=2, d=16, page_size=2),
        dict(pack_gqa=True, sliding_window=9, softcap=3.0, num_splits=2),
    ),
    "extend_pack_splits": ("extend", dict(rows=[(70, 9), (0, 0), (33, 40)], hq=8, hkv=2, d=16),
                           dict(pack_gqa=True, num_splits=3,
                                _cfg={"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})),
    "extend_splits_auto": ("extend", dict(rows=[(600, 4)], hq=2, hkv=2, d=16), dict(max_prefix_len=600)),
    # rows of 1..100 new tokens behind prefixes of several lengths (an empty one too), four query heads per
    # KV head packed: short rows take the one-tile-per-row launch, long ones the tiles mapped onto rows
    "extend_row_classes": ("extend", dict(rows=[(37, 1), (0, 100), (5, 3), (64, 1), (0, 2), (130, 17),
                                                (9, 64), (0, 1)], hq=8, hkv=2, d=16, page_size=4), {}),
    "extend_row_classes_splits_window": (
        "extend", dict(rows=[(50, 1), (0, 20), (33, 6), (40, 45)], hq=8, hkv=2, d=16, sinks=True),
        dict(num_splits=2, sliding_window=30,
             _cfg=[{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
                   {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
                   {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}]),
    ),
    # two rows (a graph's row and its padding row, say), one long and one short: one launch of the tiles
    # mapped onto rows serves both, the prefix split in two
    "extend_few_rows_one_launch": ("extend", dict(rows=[(70, 40), (5, 2)], hq=8, hkv=2, d=16),
                                   dict(num_splits=2)),
    # decode-like rows only: one launch, one program per row and KV head
    "extend_decode_like": ("extend", dict(rows=[(40, 1), (0, 1), (7, 2)], hq=4, hkv=1, d=16, page_size=2),
                           {}),
    # no max_new_len: every class launches and the tiles are found on the device alone
    "extend_no_max_new_len": ("extend", dict(rows=[(3, 50), (21, 2), (0, 9)], hq=6, hkv=2, d=16),
                              dict(_no_max_new=True)),
    "decode_splits": ("decode", dict(seq_lens=[1, 37, 70, 16], hq=8, hkv=2, d=16, page_size=4),
                      dict(num_kv_splits=3)),
    "decode_auto": ("decode", dict(seq_lens=[33, 5], hq=4, hkv=4, d=24, page_size=1), {}),
    "decode_window_softcap": ("decode", dict(seq_lens=[50, 9, 64], hq=4, hkv=1, d=16, page_size=2,
                                             index_dtype=torch.int64),
                              dict(sliding_window=21, softcap=2.5, num_kv_splits=2)),
    "decode_one_split_fp16": ("decode", dict(seq_lens=[40, 2], hq=2, hkv=1, d=16, dtype=torch.float16),
                              dict(num_kv_splits=1, max_kv_len=40)),
    "decode_many_splits": ("decode", dict(seq_lens=[20, 3], hq=2, hkv=2, d=16), dict(num_kv_splits=8)),
    # rows enough that a merge program takes several heads (rows of one key: an empty split each)
    "decode_merge_head_tiles": ("decode", dict(seq_lens=[1 + i % 5 for i in range(66)], hq=8, hkv=1, d=16,
                                               sinks=True), dict(num_kv_splits=2)),
    # attention sinks (gpt-oss): in the direct epilogue and, once, in the merge of splits
    "extend_sinks": ("extend", dict(rows=[(21, 18), (0, 17), (5, 2)], hq=4, hkv=2, d=16, page_size=2,
                                    sinks=True), dict(sliding_window=9)),
    "extend_sinks_splits": ("extend", dict(rows=[(40, 5), (0, 3), (19, 20)], hq=4, hkv=2, d=16, sinks=True),
                            dict(num_splits=3)),
    "decode_sinks": ("decode", dict(seq_lens=[1, 37, 16], hq=4, hkv=2, d=16, page_size=4, sinks=True),
                     dict(num_kv_splits=1, max_kv_len=37, sliding_window=9)),
    "decode_sinks_splits": ("decode", dict(seq_lens=[1, 37, 70], hq=4, hkv=2, d=16, sinks=True),
                            dict(num_kv_splits=3)),
    # MLA-style K and V head sizes (K wider; neither a power of two)
    "extend_mla": ("extend", dict(rows=[(21, 18), (0, 5), (7, 0)], hq=4, hkv=4, d=24, dv=8, page_size=2), {}),
    "extend_mla_splits_pack": ("extend", dict(rows=[(45, 6), (3, 17)], hq=4, hkv=2, d=24, dv=12),
                               dict(num_splits=2, pack_gqa=True)),
    "decode_mla": ("decode", dict(seq_lens=[33, 5], hq=4, hkv=4, d=24, dv=8), dict(num_kv_splits=1)),
    "decode_mla_splits_sinks": ("decode", dict(seq_lens=[33, 70], hq=4, hkv=1, d=24, dv=12, sinks=True),
                                dict(num_kv_splits=3)),
}


def _tol(dtype: torch.dtype) -> float:
    return 2e-6 if dtype == torch.float32 else 2e-3


def _run_case(name: str) -> dict[str, Any]:

    kind, bkw, kkw = INTERP_CASES[name]
    kkw = dict(kkw)
    cfg = kkw.pop("_cfg", None)
    if kind == "extend" and not kkw.pop("_no_max_new", False):
        kkw["max_new_len"] = max(n for _, n in bkw["rows"])
    scaling = 1.0 / math.sqrt(bkw["d"])
    t0 = time.time()
    if kind == "extend":
        case = make_extend_case(**bkw)
        out = run_extend(case, scaling, configs=cfg, **kkw)
        ref = ref_extend(case, scaling, kkw.get("sliding_window"), kkw.get("softcap"))
    else:
        case = make_decode_case(**bkw)
        out = run_decode(case, scaling, **kkw)
        ref = ref_decode(case, scaling, kkw.get("sliding_window"), kkw.get("softcap"))
    err = rel_err(out, ref) if ref.numel() else 0.0
    dtype = bkw.get("dtype", torch.float32)
    want_shape = (*case["q"].shape[:2], case["v_cache"].shape[-1])
    ok = tuple(out.shape) == want_shape and out.dtype == case["q"].dtype and bool(torch.isfinite(out).all())
    ok = ok and err <= _tol(dtype)
    return {"ok": ok, "err": err, "tol": _tol(dtype), "secs": round(time.time() - t0, 2)}


test_triton_interpreter = interpreter_test(__file__, INTERP_CASES)


# --------------------------------------------------------------------------------------------------------
# Triton wrappers: argument checks (no kernel launch)
# --------------------------------------------------------------------------------------------------------


def test_extend_rejects_bad_shapes() -> None:
    from hf_radix.kernels.triton_attention import extend_attention

    case = make_extend_case([(2, 3)], hq=3, hkv=2, d=16)
    with pytest.raises(ValueError, match="multiple"):
        run_extend(case, 1.0)
    case = make_extend_case([(2, 3)], hq=2, hkv=1, d=16)
    with pytest.raises(ValueError, match="k_new"):
        extend_attention(case["q"], case["k_new"][:2], case["v_new"], case["k_cache"], case["v_cache"],
                         case["qo_indptr"], case["prefix_lens"], case["prefix_kv_indices"],
                         case["prefix_kv_indptr"], 1.0)


def test_launch_falls_back_when_config_does_not_fit() -> None:
    from triton.runtime.errors import OutOfResources

    import hf_radix.kernels.triton_attention_common as ta

    calls: list[dict[str, Any]] = []

    class FakeKernel:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> None:
                calls.append({"grid": grid(kw) if callable(grid) else grid, **kw})
                if kw["BLOCK_M"] == 128:
                    raise OutOfResources(300000, 232448, "shared memory")

            return launch

    big = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    safe = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    grid = lambda meta: (4, 2, 1000 // meta["BLOCK_M"])  # noqa: E731
    ta._launch("test", FakeKernel(), grid, big, safe, 999, torch.float16, (1, 2), {"X": 1})
    assert [c["BLOCK_M"] for c in calls] == [128, 64] and calls[1]["grid"] == (4, 2, 15)
    ta._launch("test", FakeKernel(), grid, big, safe, 999, torch.float16, (1, 2), {"X": 1})
    assert [c["BLOCK_M"] for c in calls] == [128, 64, 64]  # remembered: no second attempt
    ta._too_big.discard(("test", 999, str(torch.float16)))


def test_pick_num_kv_splits() -> None:
    from hf_radix.kernels.triton_attention import pick_num_kv_splits

    assert pick_num_kv_splits(256, 8, 2048) == 1
    assert pick_num_kv_splits(1, 8, 32768) == 33
    assert pick_num_kv_splits(1, 8, 100) == 1
    assert 1 <= pick_num_kv_splits(4, 8, 4096) <= 16
    # generate's time-to-first-token extend: 2 tiles x 8 KV heads fill one wave of 132 SMs with 8 splits
    # (9 would start a second wave for 16 programs)
    assert pick_num_kv_splits(2, 8, 8192, 132, min_split_tokens=512, waves=1) == 8


def test_extend_row_classes() -> None:
    from hf_radix.kernels.triton_extend import _NO_BOUND, _row_classes

    c16, c64, c128 = ({"BLOCK_M": m, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1} for m in (16, 64, 128))
    assert _row_classes([c16, c64, c128], 1000) == [(c16, 0, 16, True), (c64, 16, 64, True),
                                                     (c128, 64, _NO_BOUND, False)]
    assert _row_classes([c16, c64, c128], 64) == [(c16, 0, 16, True), (c64, 16, _NO_BOUND, True)]
    assert _row_classes([c16, c64, c128], 3) == [(c16, 0, _NO_BOUND, True)]
    assert _row_classes([c128], 3) == [(c128, 0, _NO_BOUND, False)]
    # a graph's one row (and its padding row): one launch of the tiles mapped onto rows, unless one small
    # tile holds every row
    assert _row_classes([c16, c64, c128], 1000, batch=2) == [(c128, 0, _NO_BOUND, False)]
    assert _row_classes([c16, c64, c128], 3, batch=2) == [(c16, 0, _NO_BOUND, True)]


@settings(max_examples=60, deadline=None)
@given(new_lens=st.lists(st.integers(0, 300), min_size=1, max_size=20), group=st.integers(1, 8),
       block_m=st.sampled_from([16, 32, 64, 128]))
def test_extend_tiles_cover_every_row(new_lens: list[int], group: int, block_m: int) -> None:
    """The kernel's tile layout (``_tile_row``): row i owns tiles [i + qo[i]*G//BM, i+1 + qo[i+1]*G//BM),
    which hold its new_len*G query rows, and B + T*G//BM tiles cover all rows."""
    qo = [0]
    for n in new_lens:
        qo.append(qo[-1] + n)
    starts = [i + qo[i] * group // block_m for i in range(len(qo))]
    assert starts[0] == 0 and starts[-1] == len(new_lens) + qo[-1] * group // block_m
    for i, n in enumerate(new_lens):
        assert (starts[i + 1] - starts[i]) * block_m >= n * group


# --------------------------------------------------------------------------------------------------------
# KV store
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_store_kv_torch_exact(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    from hf_radix.kernels.store import store_kv

    gen = torch.Generator().manual_seed(1)
    pool = torch.zeros((2, 64, 3, 8), dtype=dtype)
    k_cache, v_cache = pool[0], pool[1]
    k = torch.randn((10, 3, 8), generator=gen).to(dtype)
    v = torch.randn((10, 3, 8), generator=gen).to(dtype)
    loc = torch.randperm(64, generator=gen)[:10].to(index_dtype)
    store_kv(k_cache, v_cache, loc, k, v, backend="torch")
    assert torch.equal(k_cache[loc.long()], k) and torch.equal(v_cache[loc.long()], v)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[loc.long()] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    # "auto" on CPU uses the torch path.
    store_kv(k_cache, v_cache, loc, k * 2, v * 2, backend="auto")
    assert torch.equal(k_cache[loc.long()], k * 2)


def test_store_kv_torch_separate_k_and_v_sizes() -> None:
    """MLA pools: K rows and V rows of different sizes (latent + rotary key, or expanded K wider than V)."""
    from hf_radix.kernels.store import store_kv

    k_cache, v_cache = torch.zeros((32, 1, 16)), torch.zeros((32, 1, 8))
    k, v = torch.randn((5, 1, 16)), torch.randn((5, 1, 8))
    loc = torch.tensor([31, 0, 4, 9, 2])
    store_kv(k_cache, v_cache, loc, k, v, backend="auto")
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    with pytest.raises(ValueError, match="v must be"):
        store_kv(k_cache, v_cache, loc, k, torch.randn((5, 1, 16)))


def test_store_kv_checks() -> None:
    from hf_radix.kernels.store import store_kv

    k_cache = torch.zeros((8, 2, 4))
    v_cache = torch.zeros((8, 2, 4))
    k = torch.ones((3, 2, 4))
    loc = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k_cache, v_cache, loc, k.half(), k)
    with pytest.raises(ValueError, match="out_loc"):
        store_kv(k_cache, v_cache, loc.float(), k, k)
    with pytest.raises(ValueError, match="shape"):
        store_kv(k_cache, v_cache, loc, torch.ones((3, 2, 5)), k)
    with pytest.raises(ValueError, match="backend"):
        store_kv(k_cache, v_cache, loc, k, k, backend="bogus")
    with pytest.raises(RuntimeError, match="CUDA"):
        store_kv(k_cache, v_cache, loc, k, k, backend="cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_store_cu_compiles(tmp_path: Path) -> None:
    from hf_radix.kernels.store import compile_store_kernel

    so = compile_store_kernel(tmp_path / "store_test.so", arch="sm_90")
    assert so.exists() and so.stat().st_size > 0


if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks({name: lambda name=name: _run_case(name) for name in INTERP_CASES})
