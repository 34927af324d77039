"""Shared-prefix attention kernels vs the per-row kernels on one GPU (target: H200), Llama-3-8B heads, bf16.

(a) decode, gsp-8x32: 256 rows in 8 groups, each row a 2,048-token shared prefix + a 256-token suffix
    (its new token included), page sizes 1 and 16. Per-row: ``decode_attention`` over each row's whole
    context (the rows of a group point at the same prefix slots, as in the runner). Shared:
    ``shared_prefix_attention`` in each launch order (``mode``: fold / merge / overlap / fused), with a few
    prefix split counts, tile configs (suffix and prefix tiles apart) and tile sizes, also as the runner's
    captured graphs launch it (``captured``: MAX_PREFIX_SPLITS programs a prefix tile, the count on the
    device). Both are timed as CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), so host
    launch cost is not counted. Reported: time, speedup, the bytes actually needed (each group's prefix K/V
    once + every row's suffix K/V) over time as a fraction of 4.3 TB/s (goal >= 70%), the error against the
    per-row kernel and the difference from the fold path; and a breakdown: each launch timed alone.
(b) extend: 8 groups x 32 rows x 64 new tokens behind a 1,500-token cached prefix (page 16: 1,488 shared,
    page-aligned, + 12 cached tokens of each row's own), vs ``extend_attention``.

Usage: python bench/shared_prefix_bench.py [--json PATH] [--quick]
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import parser_for, timer, write_result  # noqa: E402

from hf_radix.engine import EngineOptions  # noqa: E402
from hf_radix.kernels import triton_attention as ta  # noqa: E402
from hf_radix.kernels import triton_attention_common as tac  # noqa: E402
from hf_radix.kernels import triton_shared_prefix as sp  # noqa: E402
from hf_radix.paged_attention.prefix_groups import (  # noqa: E402
    SharedPrefixBuffers,
    SharedPrefixCost,
    build_shared_prefix_plan,
)
from hf_radix.paged_attention.shared_decode import most_prefix_splits, prefix_splits  # noqa: E402

PEAK_BW = 4.3e12  # bytes/s, measured device-to-device copy rate on the H200 here
HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = 2 * HKV * D * 2  # K + V, one layer, bf16
DEVICE = "cuda"  # the decode part's (a CPU smoke test of this script runs it under the interpreter)
DEFAULT_MODE = EngineOptions.shared_prefix_mode  # the engine's launch order (a dataclass default)
OVERLAP_SPLITS = most_prefix_splits("overlap")  # the runner's split count beside the suffix launch
# the prefix launches' stream beside the suffix launch ("overlap"), of high priority as the engine's
SIDE_STREAM = torch.cuda.Stream(priority=-1) if torch.cuda.is_available() else None


def graph_ms(fn: Any) -> float:
    """Median milliseconds of one call, replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


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
    pool = torch.randn((2, num_pages * page, HKV, D), device=DEVICE, dtype=DTYPE)
    seq = np.full(rows, shared + own)
    return {
        "pool": pool, "row_slots": row_slots,
        "slots": torch.cat(row_slots).to(device=DEVICE, dtype=torch.int32),
        "seq": seq, "kv_indptr": np.concatenate([[0], np.cumsum(seq)]),
        "node_ids": np.repeat(np.arange(groups), rows_per_group), "shared": np.full(rows, shared),
    }


def plan_of(case: dict[str, Any], new_lens: np.ndarray, prefix_splits: int,
            tile_rows: int = 128) -> tuple[Any, Any]:
    """(plan with every group shared, the cost rule's own plan)."""
    def plan_with(cost: SharedPrefixCost) -> Any:
        return build_shared_prefix_plan(case["node_ids"], case["shared"], case["kv_indptr"][:-1], case["seq"],
                                        new_lens, cost=cost)

    cost = SharedPrefixCost(HQ, HKV, D, 2, prefix_parts=prefix_splits, tile_rows=tile_rows)
    return plan_with(dataclasses.replace(cost, keep_all=True)), plan_with(cost)


def shared_fn(case: dict[str, Any], q: torch.Tensor, new_lens: np.ndarray, prefix_splits: int,
              suffix_splits: int, mode: str = "fold", captured: bool = False,
              tile_rows: int = 128, configs: dict[int, dict[str, int]] | None = None,
              ) -> tuple[Any, dict[str, Any]]:
    """One shared-prefix attention call. ``captured``: as in the runner's decode graphs -- buffers sized for
    the batch, the tables' split count ``prefix_splits`` on the device, the launch's MAX_PREFIX_SPLITS (one
    beside the suffix launch, "overlap"). ``configs``: launch configs by BLOCK_M (default: the tuned ones)."""
    plan, ruled = plan_of(case, new_lens, prefix_splits, tile_rows)
    if captured:
        rows = len(new_lens)
        tiles = SharedPrefixBuffers(rows, rows, plan.prefix_tile_q, plan.suffix_tile_q, DEVICE)
        tiles.load(plan, prefix_splits=prefix_splits)
        launched = most_prefix_splits(mode)
    else:
        tiles, launched = SharedPrefixBuffers.from_plan(plan, DEVICE), prefix_splits
    pool, out = case["pool"], torch.empty_like(q)

    def fn() -> torch.Tensor:
        return sp.shared_prefix_attention(q, pool[0], pool[1], case["slots"], tiles, D**-0.5,
                                          num_prefix_splits=launched, num_suffix_splits=suffix_splits,
                                          out=out, mode=mode, side_stream=SIDE_STREAM, configs=configs)

    info = {"cost_rule_picks_shared": ruled.use_shared, "modelled_gain_us": plan.gain_s * 1e6,
            "prefix_tiles": len(plan.prefix_tiles), "suffix_tiles": len(plan.suffix_tiles)}
    return fn, info


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def breakdown(case: dict[str, Any], q: torch.Tensor, prefix_splits: int, needed: dict[str, int]) -> dict:
    """Each launch of the shared-prefix decode timed alone (CUDA-graph replays): the prefix launch, the
    suffix launch folding the prefix parts in (today's default) and writing its own part instead, the merge
    of all parts, and the fused prefix + suffix launch; with the bytes each reads and writes."""
    rows = q.shape[0]
    plan, _ = plan_of(case, np.ones(rows, dtype=np.int64), prefix_splits)
    tiles = SharedPrefixBuffers.from_plan(plan, DEVICE)
    pool = case["pool"]

    def launches(mode: str) -> Any:
        return sp._Launches(q, pool[0], pool[1], case["slots"], tiles, D**-0.5, prefix_splits, 1, None, None,
                            None, torch.empty_like(q), mode)

    fold, parts = launches("fold"), launches("merge")
    fold.prefix()  # the parts the fold reads
    parts.prefix()
    parts.suffix()  # the parts the merge reads
    part_bytes = HQ * (D + 1) * 4  # one query's partial result (all heads), fp32 values + log-sum-exp
    out_bytes = rows * HQ * D * 2
    shared_q = int(np.count_nonzero(plan.query_shared))
    pieces = {
        "prefix": (fold.prefix, needed["prefix"], shared_q * prefix_splits * part_bytes),
        "suffix_fold": (fold.suffix, needed["suffix"], shared_q * prefix_splits * part_bytes + out_bytes),
        "suffix_partial": (parts.suffix, needed["suffix"], rows * part_bytes),
        "merge": (parts.merge, 0, rows * (prefix_splits + 1) * part_bytes + out_bytes),
        "fused_prefix_suffix": (launches("fused").fused, needed["prefix"] + needed["suffix"],
                                (shared_q * prefix_splits + rows) * part_bytes),
    }
    res: dict[str, Any] = {"prefix_splits": prefix_splits}
    for name, (fn, kv, other) in pieces.items():
        ms = graph_ms(fn)
        res[name] = {"ms": ms, "kv_bytes": kv, "other_bytes": other, "frac_peak": kv / (ms * 1e-3) / PEAK_BW,
                     "frac_peak_all_bytes": (kv + other) / (ms * 1e-3) / PEAK_BW}
        print(f"  breakdown splits={prefix_splits} {name:<20}: {ms * 1e3:6.1f} us  K/V {kv / 1e6:6.1f} MB "
              f"at {res[name]['frac_peak']:.0%}, all bytes at {res[name]['frac_peak_all_bytes']:.0%} of "
              "4.3 TB/s", flush=True)
    return res


# Tile-kernel configs swept for the decode suffix tiles (BLOCK_M 16) and the prefix tiles (BLOCK_M 128)
def _cfg(block_n: int, warps: int, stages: int, maxnreg: int | None = None) -> dict[str, int]:
    cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    return {**cfg, "maxnreg": maxnreg} if maxnreg else cfg


# sm_90 compile stats (Triton 3.6, head_dim 128, bf16): registers a thread -> programs an SM (65,536 regs)
# suffix default (64, 4 warps): 122 -> 4; (16, 4): 96 -> 5; (32, 4): 110 -> 4; (64, 8): 92 -> 2 of 8 warps;
# maxnreg 96: 5 (32 bytes of spill). Prefix default (64, 8 warps): 231 -> 1, leaving no room for a suffix
# program beside it (overlap); maxnreg 160: no spill, one suffix program beside; 128: 88 bytes spill, two.
SUFFIX_CFGS = [_cfg(32, 4, 3), _cfg(64, 8, 3), _cfg(128, 8, 2), _cfg(64, 4, 4), _cfg(64, 4, 4, 96),
               _cfg(64, 4, 3, 96)]
PREFIX_CFGS = [_cfg(64, 8, 3), _cfg(64, 8, 3, 128), _cfg(64, 8, 3, 96), _cfg(32, 8, 3, 160),
               _cfg(64, 8, 4, 160), _cfg(64, 8, 2, 160), _cfg(64, 8, 3, 192),
               _cfg(128, 8, 2, 160), _cfg(128, 8, 2, 192)]


def decode_variants(runner_splits: int, quick: bool, full: bool) -> list[dict[str, Any]]:
    """(mode, prefix splits, suffix splits, cfg override, captured) of each timed variant; the first is the
    engine's default (`default_variant`)."""
    def v(mode: str, splits: int = runner_splits, suffix: int = 1, cfg: dict | None = None,
          captured: bool = False, tile_rows: int = 128) -> dict[str, Any]:
        return {"mode": mode, "prefix_splits": splits, "suffix_splits": suffix, "cfg": cfg or {},
                "captured": captured, "tile_rows": tile_rows}

    default = v(DEFAULT_MODE, OVERLAP_SPLITS if DEFAULT_MODE == "overlap" else runner_splits)
    out = [default, {**default, "captured": True}, v("fold")]
    if quick:
        return out
    out += [v(m, captured=True) for m in ("fold", "fused")]
    splits = sorted({1, 2, 4, runner_splits})
    out += [var for var in (v(m, s) for s in splits for m in sp.MODES) if var not in out]
    if not full:
        return out
    overlap = functools.partial(v, "overlap", OVERLAP_SPLITS)
    out += [v(m, suffix=2) for m in ("merge", "overlap", "fused")]
    out += [overlap(cfg={16: c}) for c in SUFFIX_CFGS]
    out += [overlap(cfg={128: c}) for c in PREFIX_CFGS]
    out += [overlap(cfg={128: p, 16: c}) for p in PREFIX_CFGS[1:4] for c in SUFFIX_CFGS[-2:]]
    out += [overlap(cfg={128: PREFIX_CFGS[1], 16: SUFFIX_CFGS[-1]}, captured=True)]
    # prefix tiles of 64 (query, head) rows: two a group of 32 rows (its prefix read twice, the second
    # time from L2), lighter programs
    out += [v(m, tile_rows=64, cfg={64: _cfg(32, 4, 3)}) for m in ("fold", "overlap")]
    out += [overlap(tile_rows=64, cfg={64: c}) for c in (_cfg(64, 4, 3), _cfg(64, 4, 3, 160), _cfg(64, 4, 2))]
    # two prefix programs an SM (registers capped): more prefix splits pay
    out += [v("fold", s, cfg={128: PREFIX_CFGS[1]}) for s in (2, 4)]
    return out


def default_variant(var: dict[str, Any], runner_splits: int) -> bool:
    """Whether `var` is the launch the engine makes by default (eagerly)."""
    splits = OVERLAP_SPLITS if DEFAULT_MODE == "overlap" else runner_splits
    return (var["mode"] == DEFAULT_MODE and var["prefix_splits"] == splits and var["suffix_splits"] == 1
            and not var["cfg"] and not var["captured"] and var["tile_rows"] == 128)


def bench_decode(page: int, quick: bool, full: bool, shape: tuple[int, ...] = (8, 32, 2048, 256)) -> dict:
    groups, per_group, prefix, suffix = shape
    case = build(groups, per_group, prefix, suffix, page, seed=page)
    rows = groups * per_group
    q = torch.randn((rows, HQ, D), device=DEVICE, dtype=DTYPE)
    indptr = torch.as_tensor(case["kv_indptr"], dtype=torch.int32, device=DEVICE)
    pool = case["pool"]
    sms = tac._sm_count(torch.device(DEVICE))
    splits_row = ta.pick_num_kv_splits(rows, HKV, prefix + suffix, sms)

    def per_row() -> torch.Tensor:
        return ta.decode_attention(q, pool[0], pool[1], case["slots"], indptr, D**-0.5,
                                   num_kv_splits=splits_row)

    ref = per_row()
    ms_row = graph_ms(per_row)
    parts = {"prefix": groups * prefix * KV_BYTES_PER_TOKEN, "suffix": rows * suffix * KV_BYTES_PER_TOKEN}
    needed = parts["prefix"] + parts["suffix"]
    runner_splits = prefix_splits(groups, HKV, prefix, sms)  # the runner's choice (shared_decode)
    res: dict[str, Any] = {
        "page_size": page, "rows": rows, "groups": groups, "prefix": prefix, "suffix": suffix,
        "per_row_ms": ms_row, "per_row_splits": splits_row, "bytes_needed": needed,
        "bytes_needed_prefix": parts["prefix"], "bytes_needed_suffix": parts["suffix"],
        "bytes_per_row_reads": rows * (prefix + suffix) * KV_BYTES_PER_TOKEN,
        "runner_prefix_splits": runner_splits,
        "max_bytes_ms_at_70pct": needed / (0.7 * PEAK_BW) * 1e3, "variants": [],
    }
    print(f"decode p{page}: per-row {ms_row * 1e3:7.1f} us (splits {splits_row}); 70% of peak needs <= "
          f"{res['max_bytes_ms_at_70pct'] * 1e3:.1f} us", flush=True)
    fold_out: dict[int, torch.Tensor] = {}
    for var in decode_variants(runner_splits, quick, full):
        entry = {**var, "cfg": {str(k): c for k, c in var["cfg"].items()}}
        try:
            fn, info = shared_fn(case, q, np.ones(rows, dtype=np.int64), var["prefix_splits"],
                                 var["suffix_splits"], var["mode"], var["captured"], var["tile_rows"],
                                 configs=var["cfg"])
            out = fn().clone()
            ms = graph_ms(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. a config that does not fit: report, go on
            res["variants"].append({**entry, "error": str(exc)[:200]})
            print(f"  {entry}: error {str(exc)[:200]}", flush=True)
            continue
        finally:
            tac._too_big.clear()  # a config that did not fit must not send later variants to the safe one
        if var["mode"] == "fold" and not var["cfg"] and not var["captured"] and var["tile_rows"] == 128:
            fold_out.setdefault(var["prefix_splits"], out)
        base = fold_out.get(var["prefix_splits"])
        entry.update(default=default_variant(var, runner_splits),
                     ms=ms, speedup=ms_row / ms, frac_peak=needed / (ms * 1e-3) / PEAK_BW,
                     rel_err_vs_per_row=err(out, ref),
                     rel_diff_vs_fold=None if base is None else err(out, base), **info)
        res["variants"].append(entry)
        print(f"  {var['mode']:<7} splits={var['prefix_splits']}/{var['suffix_splits']}"
              f"{' captured' if var['captured'] else ''} tile_rows={var['tile_rows']} "
              f"{var['cfg'] or 'default cfg'}: {ms * 1e3:7.1f} us  "
              f"x{entry['speedup']:.2f}  {entry['frac_peak']:.0%} of 4.3 TB/s (needed bytes)  "
              f"err {entry['rel_err_vs_per_row']:.1e}", flush=True)
    res["breakdown"] = [breakdown(case, q, s, parts)
                        for s in sorted({OVERLAP_SPLITS, runner_splits, 4 if full else 0} - {0})]
    wide = {f"128_{mode}": sp.tile_config(128, D, DTYPE, q.device, mode) for mode in ("overlap", "fused")}
    res["default_configs"] = {**{bm: sp.tile_config(bm, D, DTYPE, q.device) for bm in (16, 128)}, **wide}
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


def sweep(results: dict[str, Any], quick: bool) -> None:
    """Both parts at page sizes 1 and 16, into `results`, then the summary."""
    for page in (1, 16):  # the full sweep at page 1; page 16 the modes and split counts
        results["decode"].append(bench_decode(page, quick, full=page == 1 and not quick))
        torch.cuda.empty_cache()
    for page in (1, 16):
        results["extend"].append(bench_extend(page))
        torch.cuda.empty_cache()
    print("\n=== summary (CUDA-graph replays, median) ===")
    for r in results["decode"]:
        best = min((v for v in r["variants"] if "ms" in v), key=lambda v: v["ms"])
        default = next(v for v in r["variants"] if v.get("default"))
        timed = [v for v in r["variants"] if "ms" in v]
        by_mode = {m: min((v for v in timed if v["mode"] == m), key=lambda v: v["ms"], default=None)
                   for m in sp.MODES}
        rows = [("default", default), ("best", best), *((f"best {m}", v) for m, v in by_mode.items() if v)]
        for label, v in rows:
            print(f"decode gsp-8x32 p{r['page_size']:<2} {label:<12}: {v['ms'] * 1e3:6.1f} us vs per-row "
                  f"{r['per_row_ms'] * 1e3:6.1f} us = x{v['speedup']:.2f}; needed bytes at "
                  f"{v['frac_peak']:.0%} of 4.3 TB/s (goal 70%)  [{v['mode']} splits {v['prefix_splits']}/"
                  f"{v['suffix_splits']}{' captured' if v['captured'] else ''} {v['cfg']}]")
    for r in results["extend"]:
        print(f"extend 8x32x64+1500 p{r['page_size']:<2}: {r['shared_ms'] * 1e3:6.1f} us vs per-row "
              f"{r['per_row_ms'] * 1e3:6.1f} us = x{r['speedup']:.2f}")


def main() -> None:
    ap = parser_for(__doc__)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("shared_prefix_bench.py needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "peak_bw": PEAK_BW,
        "decode": [],
        "extend": [],
    }
    with timer(sync=False) as whole:
        sweep(results, args.quick)
    results["bench_s"] = whole.seconds
    print(f"bench took {results['bench_s']:.0f} s")
    write_result(results, args.json, echo=False)


if __name__ == "__main__":
    main()
