"""Shared-prefix attention kernels vs the per-row kernels on one GPU (target: H200), Llama-3-8B heads, bf16.

(a) decode, gsp-8x32: 256 rows in 8 groups, each row a 2,048-token shared prefix + a 256-token suffix
    (its new token included), page sizes 1 and 16. Per-row: ``decode_attention`` over each row's whole
    context (the rows of a group point at the same prefix slots, as in the runner). Shared:
    ``shared_prefix_attention`` with a few prefix split counts and tile configs. Both are timed as CUDA-graph
    replays (``triton.testing.do_bench_cudagraph``, median), so host launch cost is not counted. Reported:
    time, speedup, and the bytes actually needed (each group's prefix K/V once + every row's suffix K/V)
    over time as a fraction of 4.3 TB/s (goal >= 70%).
(b) extend: 8 groups x 32 rows x 64 new tokens behind a 1,500-token cached prefix (page 16: 1,488 shared,
    page-aligned, + 12 cached tokens of each row's own), vs ``extend_attention``.

Usage: python bench/shared_prefix_bench.py [--out PATH] [--quick]   (JSON to PATH, default $OUT/...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hf_radix.kernels import triton_attention as ta  # noqa: E402
from hf_radix.kernels import triton_shared_prefix as sp  # noqa: E402
from hf_radix.prefix_groups import SharedPrefixBuffers, SharedPrefixCost, build_shared_prefix_plan  # noqa: E402

PEAK_BW = 4.3e12  # bytes/s, measured device-to-device copy rate on the H200 here
HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # K + V, one layer, bf16


def graph_ms(fn: Any) -> float:
    """Median milliseconds of one call, replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def pages_of(tokens: int, page: int, take: list[int], perm: torch.Tensor) -> torch.Tensor:
    """Slots of ``tokens`` positions on the next whole pages of the shuffled page list."""
    n = triton.cdiv(tokens, page)
    got = perm[take[0]:take[0] + n]
    take[0] += n
    return (got[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:tokens]


def build(groups: int, rows_per_group: int, shared: int, own: int, page: int, seed: int) -> dict[str, Any]:
    """Pool and slot lists: a group's rows share ``shared`` prefix slots, then have ``own`` slots each."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * rows_per_group
    num_pages = groups * triton.cdiv(shared, page) + rows * triton.cdiv(own, page) + 1
    perm, take = torch.randperm(num_pages, generator=gen), [0]
    prefix = [pages_of(shared, page, take, perm) for _ in range(groups)]
    row_slots = [torch.cat([prefix[r // rows_per_group], pages_of(own, page, take, perm)])
                 for r in range(rows)]
    pool = torch.randn((2, num_pages * page, HKV, D), device="cuda", dtype=DTYPE)
    seq = np.full(rows, shared + own)
    return {
        "pool": pool, "row_slots": row_slots, "slots": torch.cat(row_slots).to(torch.int32).cuda(),
        "seq": seq, "kv_indptr": np.concatenate([[0], np.cumsum(seq)]),
        "node_ids": np.repeat(np.arange(groups), rows_per_group), "shared": np.full(rows, shared),
    }


def shared_fn(case: dict[str, Any], q: torch.Tensor, new_lens: np.ndarray, prefix_splits: int,
              suffix_splits: int) -> tuple[Any, dict[str, Any]]:
    def plan_with(cost: SharedPrefixCost) -> Any:
        return build_shared_prefix_plan(case["node_ids"], case["shared"], case["kv_indptr"][:-1], case["seq"],
                                        new_lens, cost=cost)

    # timed with every group shared; the cost rule's own choice is reported
    cost = SharedPrefixCost(HQ, HKV, D, 2, prefix_parts=prefix_splits)
    ruled = plan_with(cost)
    plan = plan_with(dataclasses.replace(cost, keep_all=True))
    tiles = SharedPrefixBuffers.from_plan(plan, "cuda")
    pool, out = case["pool"], torch.empty_like(q)

    def fn() -> torch.Tensor:
        return sp.shared_prefix_attention(q, pool[0], pool[1], case["slots"], tiles, D**-0.5,
                                          num_prefix_splits=prefix_splits, num_suffix_splits=suffix_splits,
                                          out=out)

    info = {"cost_rule_picks_shared": ruled.use_shared, "modelled_gain_us": plan.gain_s * 1e6,
            "prefix_tiles": len(plan.prefix_tiles), "suffix_tiles": len(plan.suffix_tiles)}
    return fn, info


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_decode(page: int, quick: bool) -> dict[str, Any]:
    groups, per_group, prefix, suffix = 8, 32, 2048, 256
    case = build(groups, per_group, prefix, suffix, page, seed=page)
    rows = groups * per_group
    q = torch.randn((rows, HQ, D), device="cuda", dtype=DTYPE)
    indptr = torch.as_tensor(case["kv_indptr"], dtype=torch.int32, device="cuda")
    pool = case["pool"]
    splits_row = ta.pick_num_kv_splits(rows, HKV, prefix + suffix, torch.cuda.get_device_properties(0)
                                       .multi_processor_count)

    def per_row() -> torch.Tensor:
        return ta.decode_attention(q, pool[0], pool[1], case["slots"], indptr, D**-0.5,
                                   num_kv_splits=splits_row)

    ref = per_row()
    ms_row = graph_ms(per_row)
    needed = (groups * prefix + rows * suffix) * KV_BYTES_PER_TOKEN
    res: dict[str, Any] = {
        "page_size": page, "rows": rows, "groups": groups, "prefix": prefix, "suffix": suffix,
        "per_row_ms": ms_row, "per_row_splits": splits_row, "bytes_needed": needed,
        "bytes_per_row_reads": rows * (prefix + suffix) * KV_BYTES_PER_TOKEN, "variants": [],
    }
    print(f"decode p{page}: per-row {ms_row * 1e3:7.1f} us (splits {splits_row})", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto = ta.pick_num_kv_splits(groups, HKV, prefix, sms)
    split_list = [auto] if quick else sorted({2, 4, auto, 8})
    cfgs: list[dict[int, dict[str, int]]] = [{}]
    if not quick:
        cfgs += [{128: {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}},
                 {128: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}},
                 {16: {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}}]
    for cfg in cfgs:
        for splits in split_list if not cfg else [auto]:
            sp._CFG_OVERRIDE = cfg
            try:
                fn, info = shared_fn(case, q, np.ones(rows, dtype=np.int64), splits, 1)
                out = fn()
                ms = graph_ms(fn)
            except Exception as exc:  # noqa: BLE001 - e.g. a config that does not fit: report, go on
                res["variants"].append({"cfg": cfg, "splits": splits, "error": str(exc)[:200]})
                continue
            finally:
                sp._CFG_OVERRIDE = {}
            v = {"cfg": {str(k): c for k, c in cfg.items()}, "prefix_splits": splits,
                 "default": not cfg and splits == auto, "ms": ms, "speedup": ms_row / ms,
                 "frac_peak": needed / (ms * 1e-3) / PEAK_BW, "rel_err_vs_per_row": err(out, ref), **info}
            res["variants"].append(v)
            print(f"  shared splits={splits} {cfg or 'default cfg'}: {ms * 1e3:7.1f} us  "
                  f"x{v['speedup']:.2f}  {v['frac_peak']:.0%} of 4.3 TB/s (needed bytes)  "
                  f"err {v['rel_err_vs_per_row']:.1e}", flush=True)
    res["default_configs"] = {bm: sp.tile_config(bm, D, DTYPE, q.device) for bm in (16, 128)}
    return res


def bench_extend(page: int) -> dict[str, Any]:
    groups, per_group, cached, new = 8, 32, 1500, 64
    shared = cached // page * page
    case = build(groups, per_group, shared, cached - shared + new, page, seed=100 + page)
    rows, pool = groups * per_group, case["pool"]
    t = rows * new
    q = torch.randn((t, HQ, D), device="cuda", dtype=DTYPE)
    new_slots = torch.cat([s[cached:] for s in case["row_slots"]]).long().cuda()
    k_new, v_new = pool[0][new_slots], pool[1][new_slots]
    qo = torch.arange(0, (rows + 1) * new, new, dtype=torch.int32, device="cuda")
    prefix_lens = torch.full((rows,), cached, dtype=torch.int32, device="cuda")
    prefix_indices = torch.cat([s[:cached] for s in case["row_slots"]]).to(torch.int32).cuda()
    prefix_indptr = torch.arange(0, (rows + 1) * cached, cached, dtype=torch.int32, device="cuda")

    def per_row() -> torch.Tensor:
        return ta.extend_attention(q, k_new, v_new, pool[0], pool[1], qo, prefix_lens, prefix_indices,
                                   prefix_indptr, D**-0.5, max_new_len=new, max_prefix_len=cached)

    ref = per_row()
    ms_row = graph_ms(per_row)
    fn, info = shared_fn(case, q, np.full(rows, new), 1, 1)
    out = fn()
    ms = graph_ms(fn)
    flops = 4 * HQ * D * rows * (new * cached + new * (new + 1) / 2)
    res = {"page_size": page, "rows": rows, "groups": groups, "cached": cached, "shared": shared, "new": new,
           "per_row_ms": ms_row, "shared_ms": ms, "speedup": ms_row / ms, "tflops_shared": flops / ms / 1e9,
           "tflops_per_row": flops / ms_row / 1e9, "rel_err_vs_per_row": err(out, ref), **info}
    print(f"extend p{page} {groups}x{per_group}x{new} behind {cached}: per-row {ms_row * 1e3:7.1f} us, "
          f"shared {ms * 1e3:7.1f} us (x{res['speedup']:.2f}, {res['tflops_shared']:.0f} TFLOP/s), "
          f"cost rule: {'shared' if info['cost_rule_picks_shared'] else 'per-row'}, "
          f"err {res['rel_err_vs_per_row']:.1e}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/shared_prefix_bench.json)")
    ap.add_argument("--quick", action="store_true", help="default configs only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("shared_prefix_bench.py needs a CUDA device")
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "shared_prefix_bench.json")
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "peak_bw": PEAK_BW,
        "decode": [],
        "extend": [],
    }
    for page in (1, 16):
        results["decode"].append(bench_decode(page, args.quick))
        torch.cuda.empty_cache()
    for page in (1, 16):
        results["extend"].append(bench_extend(page))
        torch.cuda.empty_cache()
    print("\n=== summary (CUDA-graph replays, median) ===")
    for r in results["decode"]:
        best = min((v for v in r["variants"] if "ms" in v), key=lambda v: v["ms"])
        default = next(v for v in r["variants"] if v.get("default"))
        for label, v in (("default", default), ("best", best)):
            print(f"decode gsp-8x32 p{r['page_size']:<2} {label:<7}: {v['ms'] * 1e3:6.1f} us vs per-row "
                  f"{r['per_row_ms'] * 1e3:6.1f} us = x{v['speedup']:.2f}; needed bytes at "
                  f"{v['frac_peak']:.0%} of 4.3 TB/s (goal 70%)  [splits {v['prefix_splits']} {v['cfg']}]")
    for r in results["extend"]:
        print(f"extend 8x32x64+1500 p{r['page_size']:<2}: {r['shared_ms'] * 1e3:6.1f} us vs per-row "
              f"{r['per_row_ms'] * 1e3:6.1f} us = x{r['speedup']:.2f}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
