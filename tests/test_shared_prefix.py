"""Shared-prefix attention: host grouping (numpy) and the Triton kernels under TRITON_INTERPRET=1.

The kernels are checked against a float64 torch reference (with sliding windows, soft-capping and
attention sinks) and against the per-row decode/extend kernels (fp32 within 1e-5); the other launch orders
(``mode``: merge, overlap, fused) equal the fold path; a row's result must not depend on which other rows
share its group. The case builders are reused by tests/test_shared_prefix_gpu.py.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from interpreter import assert_check_passed, interpreter_report, report_checks

from hf_radix.paged_attention.prefix_groups import (
    SharedPrefixBuffers,
    SharedPrefixCost,
    build_shared_prefix_plan,
)

pytestmark = pytest.mark.slow  # kernels alone: no transformers version changes them

# --------------------------------------------------------------------------------------------------------
# Case builder and float64 reference
# --------------------------------------------------------------------------------------------------------

# A group: (shared prefix length, rows); a row: (private cached tokens, new tokens). node None: no tree node.
Group = tuple[int, list[tuple[int, int]]]


def make_shared_case(groups: list[Group], hq: int, hkv: int, d: int, page_size: int = 1,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                     order: list[int] | None = None, alone: list[tuple[int, int]] = (),
                     dv: int | None = None) -> dict[str, Any]:
    """A pool where each group's rows hold the same prefix pages, then pages of their own (shuffled).

    ``alone`` rows have no tree node. ``order`` permutes the batch (rows of groups interleave). ``dv``: the
    value head size, if not ``d`` (MLA).
    """
    gen = torch.Generator().manual_seed(seed)
    pages = lambda n: -(-n // page_size)  # noqa: E731
    rows = [(g, p, c, n) for g, (p, members) in enumerate(groups) for c, n in members]
    rows += [(-1, 0, c, n) for c, n in alone]
    num_pages = sum(pages(p) for p, _ in groups) + sum(pages(c + n) for _, _, c, n in rows) + 2
    perm = torch.randperm(num_pages, generator=gen)
    used = 0

    def take(n: int) -> torch.Tensor:
        nonlocal used
        got = perm[used:used + pages(n)]
        used += pages(n)
        return (got[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]

    prefix_slots = [take(p) for p, _ in groups]
    row_slots = [torch.cat([prefix_slots[g] if g >= 0 else take(0), take(c + n)]) for g, _, c, n in rows]
    order = list(range(len(rows))) if order is None else order
    rows, row_slots = [rows[i] for i in order], [row_slots[i] for i in order]
    keys = torch.randn((num_pages * page_size, hkv, d), generator=gen).to(dtype=dtype, device=device)
    values = torch.randn((num_pages * page_size, hkv, dv or d), generator=gen).to(dtype=dtype, device=device)
    t = sum(n for *_, n in rows)
    seq = [p + c + n for _, p, c, n in rows]
    kv_indptr = np.concatenate([[0], np.cumsum(seq)])
    return {
        "q": torch.randn((t, hq, d), generator=gen).to(dtype=dtype, device=device),
        "k_cache": keys, "v_cache": values,
        "slots": torch.cat(row_slots).to(device), "row_slots": row_slots,
        "node_ids": np.array([g for g, *_ in rows]), "shared_lens": np.array([p for _, p, _, _ in rows]),
        "seq_lens": np.array(seq), "new_lens": np.array([n for *_, n in rows]), "kv_starts": kv_indptr[:-1],
        "kv_indptr": kv_indptr, "hq": hq, "hkv": hkv, "d": d, "page_size": page_size,
    }


def subset_case(case: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The batch of ``case``'s rows ``rows`` (one new token each), in that order, over the same pool."""
    sub = dict(case, q=case["q"][rows], row_slots=[case["row_slots"][i] for i in rows])
    sub["slots"] = torch.cat(sub["row_slots"]).to(case["slots"].device)  # row_slots live on the host
    for key in ("node_ids", "shared_lens", "seq_lens", "new_lens"):
        sub[key] = case[key][rows]
    sub["kv_indptr"] = np.concatenate([[0], np.cumsum(sub["seq_lens"])])
    sub["kv_starts"] = sub["kv_indptr"][:-1]
    return sub


def case_plan(case: dict[str, Any], tile_rows: int = 128, prefix_parts: int = 1, **kw: Any):
    dtype_bytes = case["q"].element_size()
    # kernel tests keep every group: they must not depend on the cost model's verdict
    cost = SharedPrefixCost(case["hq"], case["hkv"], case["d"], dtype_bytes, prefix_parts=prefix_parts,
                            tile_rows=tile_rows, keep_all=True, **kw)
    return build_shared_prefix_plan(case["node_ids"], case["shared_lens"], case["kv_starts"],
                                    case["seq_lens"], case["new_lens"], cost=cost,
                                    page_size=case["page_size"], slots=case["slots"].cpu().numpy())


def run_shared(case: dict[str, Any], scaling: float, plan: Any = None, tile_rows: int = 128,
               **kw: Any) -> torch.Tensor:
    from hf_radix.kernels.triton_shared_prefix import shared_prefix_attention

    plan = plan if plan is not None else case_plan(case, tile_rows, kw.get("num_prefix_splits", 1))
    tiles = SharedPrefixBuffers.from_plan(plan, case["q"].device)
    return shared_prefix_attention(case["q"], case["k_cache"], case["v_cache"], case["slots"], tiles, scaling,
                                   **kw)


def ref_shared(case: dict[str, Any], scaling: float, sliding_window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of each row's new tokens over its whole context (sinks: extra softmax logits)."""
    q = case["q"].cpu().double()
    kc, vc = case["k_cache"].cpu().double(), case["v_cache"].cpu().double()
    group = case["hq"] // case["hkv"]
    outs, t0 = [], 0
    for slots, seq, n in zip(case["row_slots"], case["seq_lens"], case["new_lens"], strict=True):
        k = kc[slots].repeat_interleave(group, dim=1)
        v = vc[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[t0:t0 + n], k) * scaling
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos, kpos = torch.arange(seq - n, seq)[:, None], torch.arange(seq)[None, :]
        keep = kpos <= qpos
        if sliding_window:
            keep &= qpos - kpos < sliding_window
        s = s.masked_fill(~keep[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :seq]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        t0 += n
    return torch.cat(outs)


def run_per_row(case: dict[str, Any], scaling: float, **kw: Any) -> torch.Tensor:
    """The existing per-row kernel on the same batch: decode when every row adds one token, else extend."""
    from hf_radix.kernels.triton_attention import decode_attention, extend_attention

    dev = case["q"].device
    seq, new = case["seq_lens"], case["new_lens"]
    if (new == 1).all():
        indptr = torch.as_tensor(case["kv_indptr"], dtype=torch.int32, device=dev)
        return decode_attention(case["q"], case["k_cache"], case["v_cache"], case["slots"], indptr, scaling,
                                **kw)
    cached = seq - new
    new_slots = torch.cat([s[c:] for s, c in zip(case["row_slots"], cached, strict=True)]).long().to(dev)
    i32 = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32, device=dev)  # noqa: E731
    return extend_attention(
        case["q"], case["k_cache"][new_slots], case["v_cache"][new_slots], case["k_cache"], case["v_cache"],
        i32(np.concatenate([[0], np.cumsum(new)])), i32(cached),
        torch.cat([s[:c] for s, c in zip(case["row_slots"], cached, strict=True)]).to(dev),
        i32(np.concatenate([[0], np.cumsum(cached)])), scaling, **kw)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------
# Interpreter cases (one TRITON_INTERPRET=1 subprocess)
# --------------------------------------------------------------------------------------------------------

DECODE_GROUPS: list[Group] = [(24, [(0, 1), (5, 1), (17, 1)]), (8, [(3, 1), (0, 1)]), (40, [(9, 1)]),
                              (16, [(2, 1)] * 5)]
EXTEND_GROUPS: list[Group] = [(20, [(0, 3), (4, 0), (7, 5), (0, 1)]), (32, [(2, 6), (0, 2)]), (12, [(5, 4)])]

# name -> (builder kwargs, kernel kwargs, plan kwargs)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "decode_p1": (dict(groups=DECODE_GROUPS, hq=4, hkv=2, d=16, alone=[(30, 1)],
                       order=[3, 9, 0, 7, 1, 10, 4, 8, 2, 11, 5, 6]), {}, {}),
    "decode_p4_splits_tiles": (
        dict(groups=DECODE_GROUPS, hq=4, hkv=2, d=16, page_size=4, alone=[(13, 1)]),
        dict(num_prefix_splits=3), dict(tile_rows=8)),
    "decode_merge_window_softcap_sinks": (
        dict(groups=DECODE_GROUPS, hq=6, hkv=2, d=16, page_size=4, alone=[(45, 1)]),
        dict(num_prefix_splits=2, num_suffix_splits=3, sliding_window=19, softcap=3.0, sinks=True),
        dict(tile_rows=12)),
    "decode_fp16_final_window_sinks_d24": (
        dict(groups=[DECODE_GROUPS[0], DECODE_GROUPS[3]], hq=2, hkv=1, d=24, page_size=4,
             dtype=torch.float16),
        dict(num_prefix_splits=2, sliding_window=13, sinks=True), {}),
    "extend_p1": (dict(groups=EXTEND_GROUPS, hq=4, hkv=2, d=16, alone=[(6, 9)],
                       order=[4, 0, 7, 2, 6, 1, 5, 3]),
                  {}, dict(tile_rows=8)),
    "extend_p4_merge_window_softcap_sinks": (
        dict(groups=EXTEND_GROUPS, hq=4, hkv=2, d=16, page_size=4),
        dict(num_prefix_splits=2, num_suffix_splits=2, sliding_window=11, softcap=2.5, sinks=True),
        dict(tile_rows=8)),
    "extend_mla_dv": (dict(groups=EXTEND_GROUPS[:2], hq=4, hkv=1, d=32, dv=16, page_size=4),
                      dict(num_suffix_splits=2), {}),
    "extend_fp16_window": (dict(groups=EXTEND_GROUPS, hq=4, hkv=1, d=16, page_size=4, dtype=torch.float16),
                           dict(sliding_window=9), {}),
}


# launch orders checked against the fold path on a case (same plan and kernel arguments)
CASE_MODES: dict[str, tuple[str, ...]] = {
    "decode_p1": ("merge", "fused"),
    "decode_fp16_final_window_sinks_d24": ("overlap", "fused"),
    "extend_p4_merge_window_softcap_sinks": ("fused",),
}


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-3


def _run_case(name: str) -> dict[str, Any]:
    bkw, kkw, pkw = CASES[name]
    kkw = dict(kkw)
    t0 = time.time()
    case = make_shared_case(**bkw)
    scaling = 1.0 / math.sqrt(bkw["d"])
    if kkw.pop("sinks", False):
        kkw["sinks"] = torch.randn(bkw["hq"], generator=torch.Generator().manual_seed(5)) * 2.0
    plan = case_plan(case, prefix_parts=kkw.get("num_prefix_splits", 1), **pkw)
    out = run_shared(case, scaling, plan=plan, **kkw)
    ref = ref_shared(case, scaling, kkw.get("sliding_window"), kkw.get("softcap"), kkw.get("sinks"))
    dtype = bkw.get("dtype", torch.float32)
    res: dict[str, Any] = {"err_ref": rel_err(out, ref), "shared_groups": plan.num_shared_groups,
                           "prefix_tiles": len(plan.prefix_tiles)}
    ok = out.dtype == dtype and bool(torch.isfinite(out).all()) and res["err_ref"] <= _tol(dtype)
    ok = ok and plan.num_shared_groups >= 2
    for mode in CASE_MODES.get(name, ()):
        res[f"diff_{mode}"] = float((run_shared(case, scaling, plan=plan, mode=mode, **kkw).double()
                                     - out.double()).abs().max())
        ok = ok and res[f"diff_{mode}"] <= _tol(dtype)
    if "sinks" not in kkw:
        per_row = run_per_row(case, scaling, sliding_window=kkw.get("sliding_window"),
                              softcap=kkw.get("softcap"))
        res["err_per_row"] = float((out.double() - per_row.double()).abs().max())
        ok = ok and res["err_per_row"] <= _tol(dtype)
    res.update(ok=ok, secs=round(time.time() - t0, 2))
    return res


def _membership_check() -> dict[str, Any]:
    """The same rows in different groups (other members, other order, other tile splits): same results."""
    groups: list[Group] = [(16, [(3, 1), (0, 1), (5, 1), (1, 1), (8, 1), (2, 1), (4, 1)])]
    scaling = 0.25
    kw = dict(num_prefix_splits=2, sliding_window=14, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    full = make_shared_case(groups, hq=4, hkv=2, d=16, page_size=4, seed=3)
    base = run_shared(full, scaling, tile_rows=6, **kw)
    worst = 0.0
    for rows in ([5, 0, 2], [6, 3, 1, 0, 5, 2], [4, 0]):
        out = run_shared(subset_case(full, rows), scaling, tile_rows=4, **kw)
        worst = max(worst, float((out - base[rows]).abs().max()))
    return {"ok": worst == 0.0, "max_abs_diff": worst}


def _device_split_count_check() -> dict[str, Any]:
    """Launched with more prefix splits than the tables hold (a captured graph's grid), the kernels split
    each prefix into the tables' count: results equal a launch of exactly that many (bit for bit when the
    suffix program folds the parts, as in decode graphs; merged, the empty parts move the sum's order),
    also in one fused launch."""
    from hf_radix.kernels.triton_shared_prefix import shared_prefix_attention

    case = make_shared_case(DECODE_GROUPS, hq=4, hkv=2, d=16, page_size=4, seed=9)
    diffs = {}
    for suffix_splits, mode in ((1, "fold"), (3, "fold"), (1, "fused")):
        plan = case_plan(case, prefix_parts=2)
        exact = run_shared(case, 0.25, plan=plan, num_prefix_splits=2, num_suffix_splits=suffix_splits,
                           mode=mode)
        tiles = SharedPrefixBuffers.from_plan(plan, case["q"].device)
        tiles.load(plan, prefix_splits=2)
        wide = shared_prefix_attention(case["q"], case["k_cache"], case["v_cache"], case["slots"], tiles,
                                       0.25, num_prefix_splits=8, num_suffix_splits=suffix_splits, mode=mode)
        diffs[f"{mode}_{suffix_splits}"] = float((wide - exact).abs().max())
    ok = diffs["fold_1"] == 0.0 and diffs["fold_3"] <= 1e-6 and diffs["fused_1"] <= 1e-6
    return {"ok": ok, "max_abs_diff": diffs}


def _interp_main() -> None:
    checks = {name: lambda name=name: _run_case(name) for name in CASES}
    checks["membership"] = _membership_check
    checks["device_split_count"] = _device_split_count_check
    report_checks(checks)


@pytest.fixture(scope="module")
def interp_report() -> dict[str, Any]:
    return interpreter_report(__file__)


@pytest.mark.parametrize("name", [*CASES, "membership", "device_split_count"])
def test_triton_interpreter(interp_report: dict[str, Any], name: str) -> None:
    assert_check_passed(interp_report, name)


# --------------------------------------------------------------------------------------------------------
# sm_90 compile checks (no GPU needed): the configs the GPU would use fit an H100/H200
# --------------------------------------------------------------------------------------------------------

H100_SMEM = 232448  # bytes of shared memory a block may use on sm_90


@pytest.mark.parametrize(
    "block_m,tile_q,window,softcap,sinks,final,head_dim,mode",
    [(128, 32, False, False, False, False, 128, "fold"), (128, 32, True, True, True, False, 128, "overlap"),
     (16, 1, True, True, True, True, 128, "fold"), (128, 64, True, False, True, False, 256, "overlap")],
)
def test_kernels_compile_for_sm90(block_m: int, tile_q: int, window: bool, softcap: bool, sinks: bool,
                                  final: bool, head_dim: int, mode: str) -> None:
    compile_test = pytest.importorskip("test_kernels_compile")
    import triton

    from hf_radix.kernels import triton_shared_prefix as sp

    group = block_m // tile_q if block_m >= tile_q * 4 else 4
    pointers = {name: "*bf16" for name in ("Q", "K_cache", "V_cache", "Out")}
    pointers.update({name: "*i32" for name in ("Tiles", "Queries", "QPos", "QShared", "PrefixSplits")})
    pointers.update(Slots="*i64", Sinks="*fp32", Mid_o="*fp32", Mid_lse="*fp32", qk_scale="fp32",
                    cap_scale="fp32")
    block_d = triton.next_power_of_2(head_dim)
    cfg = sp.tile_config(block_m, head_dim, torch.bfloat16, torch.device("cuda"), mode)
    constexprs = dict(GROUP=group, TILE_Q=tile_q, HEAD_DIM=head_dim, BLOCK_D=block_d, HEAD_DIM_V=head_dim,
                      BLOCK_DV=block_d, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], USE_WINDOW=window,
                      SOFTCAP=softcap, HAS_SINKS=sinks, FINAL=final, IS_PREFIX=not final, DOT_PREC="tf32")
    kernel = compile_test._compile(sp._shared_prefix_tile_kernel, pointers, constexprs, cfg["num_warps"],
                                   cfg["num_stages"])
    assert "mma" in kernel.asm["ptx"] and kernel.asm["cubin"]
    assert kernel.metadata.shared <= H100_SMEM, kernel.metadata.shared


def test_fused_kernel_compiles_for_sm90() -> None:
    """The one-grid prefix + suffix kernel (mode "fused") with its beside-config register cap."""
    compile_test = pytest.importorskip("test_kernels_compile")
    from hf_radix.kernels import triton_shared_prefix as sp

    pointers = {name: "*bf16" for name in ("Q", "K_cache", "V_cache", "Out")}
    tables = ("PrefixTiles", "PrefixQueries", "SuffixTiles", "QPos", "QShared", "PrefixSplits")
    pointers.update({name: "*i32" for name in tables})
    pointers.update(Slots="*i64", Sinks="*fp32", Mid_o="*fp32", Mid_lse="*fp32", qk_scale="fp32",
                    cap_scale="fp32")
    constexprs = dict(GROUP=4, NUM_KV_HEADS=8, PREFIX_TILE_Q=32, SUFFIX_TILE_Q=1, HEAD_DIM=128, BLOCK_D=128,
                      HEAD_DIM_V=128, BLOCK_DV=128, PREFIX_BLOCK_M=128, SUFFIX_BLOCK_M=16, PREFIX_BLOCK_N=64,
                      SUFFIX_BLOCK_N=64, USE_WINDOW=True, SOFTCAP=False, HAS_SINKS=True, DOT_PREC="tf32")
    kernel = compile_test._compile(sp._shared_prefix_fused_kernel, pointers, constexprs, 8, 3)
    assert "mma" in kernel.asm["ptx"] and kernel.asm["cubin"]
    assert kernel.metadata.shared <= H100_SMEM, kernel.metadata.shared


if __name__ == "__main__":
    if "--interp" in sys.argv:
        _interp_main()
