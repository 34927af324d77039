"""Kernel benchmarks for hf_radix.kernels on one GPU (target: H200).

(a) decode: batch 256 x 2,048-token contexts, Llama-3-8B heads (32 q / 8 kv, head_dim 128), bf16, slots
    shuffled per page (page_size 1 and 16); median time (triton.testing.do_bench) and achieved K+V read
    bandwidth as a fraction of 4.3 TB/s. A few split counts / BLOCK_N values are swept too.
(b) extend: the shapes of hf_radix's prefill calls (Llama-3.1-8B heads, bf16, page_size 1): gsp suffixes
    (256 rows x 256 new behind 2,048 cached, 8 shared prefixes), one gsp prefill forward with 160 decoding
    rows riding along, 5-shot scoring (650 rows x ~12 new behind 1,600; 80 x 100 behind 1,500) and one
    time-to-first-token row; also a sliding window behind a longer prefix (Llama heads; Gemma-2 heads with
    soft-capping) and head size 96 (Phi-3: not a power of two). An earlier kernel (git --old-ref, or
    --old-file) vs the committed configs vs a sweep of config lists, each timed --rounds times
    interleaved (median); ms, TFLOP/s, error vs a float64 reference; the best config list is printed, and
    for the earlier and the committed kernel the compiled variants (registers, spills, shared memory,
    global loads / async copies / MMAs in the PTX).
(c) store: first-build and cached-load time of the CUDA store kernel; time vs torch index_copy_ for
    8K tokens x 8 heads x 128 (bf16).

Usage: python bench/kernel_bench.py [--json PATH] [--quick] [--only decode|extend|store]
       [--old-ref REF | --old-file PATH] [--rounds N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from common import parser_for, timed, timer, write_result  # noqa: E402
from test_kernels import ref_attention_row  # noqa: E402 - the float64 attention reference of the tests

from hf_radix.kernels import store as store_mod  # noqa: E402
from hf_radix.kernels import triton_attention as ta  # noqa: E402
from hf_radix.kernels import triton_extend  # noqa: E402

PEAK_BW = 4.3e12  # bytes/s, measured device-to-device copy rate on the H200 here


def bench(fn: Any, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def shuffled_slots(num_rows: int, tokens: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """[num_rows, tokens] int32 slots: each row owns whole pages, pages shuffled over the pool."""
    pages_per_row = triton.cdiv(tokens, page_size)
    perm = torch.randperm(num_rows * pages_per_row, generator=gen)
    pages = perm.view(num_rows, pages_per_row)
    slots = pages[:, :, None] * page_size + torch.arange(page_size)[None, None, :]
    return slots.reshape(num_rows, -1)[:, :tokens].to(torch.int32)


# --------------------------------------------------------------------------------------------------------
# (a) decode
# --------------------------------------------------------------------------------------------------------


DECODE_SWEEP = (
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
)


def _decode_inputs(
    batch: int, ctx: int, hq: int, hkv: int, d: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random bf16 queries ``[batch, hq, d]`` and a pool of ``batch * ctx`` slots; also the K+V bytes read."""
    pool = torch.randn((2, batch * ctx, hkv, d), device=device, dtype=torch.bfloat16)
    q = torch.randn((batch, hq, d), device=device, dtype=torch.bfloat16)
    return q, pool, 2 * batch * ctx * hkv * d * pool.element_size()


def _decode_rows(
    batch: int, ctx: int, page_size: int, gen: torch.Generator, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR slot lists of ``batch`` rows of ``ctx`` tokens on shuffled pages: (kv_indices, kv_indptr)."""
    kv_indices = shuffled_slots(batch, ctx, page_size, gen).reshape(-1).to(device)
    kv_indptr = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device=device)
    return kv_indices, kv_indptr


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _decode_case(batch: int, ctx: int, hq: int, hkv: int, d: int, seed: int) -> tuple[tuple, int]:
    """Inputs of ``batch`` rows of ``ctx`` tokens on shuffled 16-token pages, as `_decode_point` takes them
    after its label (q, pool, kv_indices, kv_indptr, K+V bytes read), and the default split count."""
    gen = torch.Generator().manual_seed(seed)
    q, pool, kv_bytes = _decode_inputs(batch, ctx, hq, hkv, d)
    kv_indices, kv_indptr = _decode_rows(batch, ctx, 16, gen)
    return (q, pool, kv_indices, kv_indptr, kv_bytes), ta.pick_num_kv_splits(batch, hkv, ctx, _sms())


def _time_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    splits: int,
    cfg: dict[str, int] | None,
) -> float:
    d = q.shape[-1]

    def fn() -> torch.Tensor:
        return ta.decode_attention(
            q, pool[0], pool[1], kv_indices, kv_indptr, d**-0.5, num_kv_splits=splits, config=cfg
        )

    fn()
    return bench(fn)


def _decode_point(label: str, q: torch.Tensor, pool: torch.Tensor, kv_indices: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_bytes: int, splits: int,
                  cfg: dict[str, int] | None) -> dict[str, Any]:
    """Times one decode launch and prints it: ms, the K+V read bandwidth (GB/s) and its share of PEAK_BW."""
    ms = _time_decode(q, pool, kv_indices, kv_indptr, splits, cfg)
    bw = kv_bytes / (ms * 1e-3)
    print(f"{label}: {ms * 1e3:8.1f} us  {bw / 1e12:5.2f} TB/s ({bw / PEAK_BW:5.1%})", flush=True)
    return {"ms": ms, "GBps": bw / 1e9, "frac_peak": bw / PEAK_BW}


def bench_decode(quick: bool) -> list[dict[str, Any]]:
    batch, ctx, hq, hkv, d = 256, 2048, 32, 8, 128
    gen = torch.Generator().manual_seed(0)
    q, pool, kv_bytes = _decode_inputs(batch, ctx, hq, hkv, d)
    default_splits = ta.pick_num_kv_splits(batch, hkv, ctx, _sms())
    results = []
    for page_size in (1, 16):
        kv_indices, kv_indptr = _decode_rows(batch, ctx, page_size, gen)
        variants: list[tuple[dict[str, int] | None, int]] = [(None, default_splits)]
        if not quick:
            variants += [(cfg, default_splits) for cfg in DECODE_SWEEP] + [(None, 2), (None, 4)]
        for cfg, splits in variants:
            used = cfg or ta.decode_config(d, q.dtype, q.device)
            point = _decode_point(f"decode p{page_size:<2} splits={splits:<2} {used}", q, pool, kv_indices,
                                  kv_indptr, kv_bytes, splits, cfg)
            results.append({"page_size": page_size, "splits": splits, "cfg": used,
                            "default": cfg is None and splits == default_splits, **point})
    del pool
    torch.cuda.empty_cache()
    return results


def bench_decode_small() -> list[dict[str, Any]]:
    """Few long rows (8 x 8,192, page 16): where split-KV matters; auto split count vs fixed ones."""
    batch, ctx = 8, 8192
    case, auto = _decode_case(batch, ctx, hq=32, hkv=8, d=128, seed=2)
    results = []
    for rep, splits in [(r, sp) for r in range(2) for sp in sorted({1, 4, auto, 8, 16, 32})]:
        label = f"decode B8x8192 splits={splits:<2}{' (auto)' if splits == auto else '       '}"
        point = _decode_point(label, *case, splits, None)
        results.append({"batch": batch, "ctx": ctx, "splits": splits, "auto": splits == auto, "rep": rep,
                        **point})
    del case
    torch.cuda.empty_cache()
    return results


def bench_decode_d256() -> list[dict[str, Any]]:
    """Gemma-2-like heads (16 q / 8 kv, head_dim 256): batch 64 x 4,096, page 16; BLOCK_N / warps sweep."""
    case, splits = _decode_case(64, 4096, hq=16, hkv=8, d=256, seed=3)
    results = []
    for cfg in (None, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, {"BLOCK_N": 32, "num_warps": 4,
                "num_stages": 3}, {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
                {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}):
        used = cfg or ta.decode_config(256, case[0].dtype, case[0].device)
        try:
            point = _decode_point(f"decode d256 B64x4096 splits={splits} {used}", *case, splits, cfg)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
            print(f"decode d256 {cfg}: {str(exc)[:120]}", flush=True)
            continue
        results.append({"splits": splits, "cfg": used, "default": cfg is None, **point})
    del case
    torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------------------------------------
# (b) extend
# --------------------------------------------------------------------------------------------------------

# Launch-config lists tried per shape (see triton_extend._extend_configs: one config per row class, by
# increasing BLOCK_M; all but the last serve rows that fit one tile). None: the committed default.
def _cfg(bm: int, bn: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


EXTEND_SWEEP: list[list[dict[str, int]] | None] = [
    None,
    [_cfg(128, 128, 8, 3)],
    [_cfg(128, 64, 8, 3)],
    [_cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3)],
    [_cfg(16, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3)],
    [_cfg(16, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 128, 8, 2)],
    [_cfg(16, 64, 4, 3), _cfg(64, 128, 4, 2), _cfg(128, 128, 8, 3)],
    [_cfg(32, 64, 4, 3), _cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3)],
    [_cfg(16, 64, 4, 4), _cfg(64, 64, 4, 4), _cfg(128, 64, 4, 3)],
]


def _cfg_label(cfgs: list[dict[str, int]] | None) -> str:
    if cfgs is None:
        return "default"
    return "+".join(f"m{c['BLOCK_M']}n{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}" for c in cfgs)


def _load_old_extend(ref: str, file: str | None = None) -> Any:
    """An earlier triton_extend.py as a module of hf_radix.kernels: ``file``, else git ``ref``'s; None if
    neither can be read."""
    if file is not None:
        src = Path(file).read_text()
    else:
        try:
            src = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:hf_radix/kernels/triton_extend.py"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    import importlib.util

    spec = importlib.util.spec_from_loader("hf_radix.kernels._extend_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hf_radix.kernels"
    tag = Path(file).stem if file is not None else ref
    path = Path(tempfile.gettempdir()) / f"hf_radix_extend_{tag}.py"  # triton.jit needs the source in a file
    path.write_text(src)
    exec(compile(src, str(path), "exec"), mod.__dict__)  # noqa: S102 - our own file at a known commit
    return mod


def extend_shape(name: str, rows: list[tuple[int, int, int]], num_prefixes: int, page_size: int = 1,
                 hq: int = 32, hkv: int = 8, d: int = 128, seed: int = 0, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, sliding_window: int | None = None,
                 softcap: float | None = None) -> dict[str, Any]:
    """Inputs of one extend call: ``rows`` = (prefix group, cached, new) per row; rows of one group share
    their cached prefix's slots (as the radix tree makes them), on shuffled pages. Llama-3.1-8B heads,
    bf16 by default."""
    gen = torch.Generator().manual_seed(seed)
    dev = device
    prefix_len = [max(c for g_, c, _ in rows if g_ == g) for g in range(num_prefixes)]
    new_total = sum(n for _, _, n in rows)
    pages = shuffled_slots(1, sum(prefix_len) + new_total + page_size, page_size, gen)[0]
    starts = [sum(prefix_len[:g]) for g in range(num_prefixes)]
    prefix_slots = [pages[s:s + n] for s, n in zip(starts, prefix_len, strict=True)]
    new_slots = pages[sum(prefix_len):sum(prefix_len) + new_total]
    pool = torch.randn((2, len(pages) + page_size, hkv, d), generator=gen).to(device=dev, dtype=dtype)
    q = torch.randn((new_total, hq, d), generator=gen).to(device=dev, dtype=dtype)
    k_new = torch.randn((new_total, hkv, d), generator=gen).to(device=dev, dtype=dtype)
    v_new = torch.randn((new_total, hkv, d), generator=gen).to(device=dev, dtype=dtype)
    pool[0][new_slots.to(dev).long()] = k_new
    pool[1][new_slots.to(dev).long()] = v_new
    news = torch.tensor([n for _, _, n in rows])
    zero = torch.zeros(1, dtype=torch.long)
    cached = torch.tensor([c for _, c, _ in rows])
    kv_lists = [prefix_slots[g][:c] for g, c, _ in rows]
    return {
        "name": name, "rows": rows, "q": q, "k_new": k_new, "v_new": v_new, "k_cache": pool[0],
        "v_cache": pool[1],
        "qo_indptr": torch.cat([zero, news.cumsum(0)]).to(dev, torch.int32),
        "prefix_lens": cached.to(dev, torch.int32),
        "prefix_kv_indices": torch.cat(kv_lists).to(dev, torch.int32),
        "prefix_kv_indptr": torch.cat([zero, cached.cumsum(0)]).to(dev, torch.int32),
        "max_new_len": int(news.max()), "max_prefix_len": int((cached + news).max()),
        "kw": {"sliding_window": sliding_window, "softcap": softcap},
        "flops": 4 * hq * d * _visible_keys(cached, news, sliding_window),
    }


def _visible_keys(cached: torch.Tensor, news: torch.Tensor, window: int | None) -> float:
    """Keys summed over queries: query ``i`` of a row sees ``cached + i + 1`` keys, at most ``window``."""
    pos = torch.cat([c + torch.arange(n) for c, n in zip(cached.tolist(), news.tolist(), strict=True)]) + 1
    return float((pos if window is None else pos.clamp(max=window)).sum())


def extend_shapes(seed: int = 0) -> list[dict[str, Any]]:
    """The shapes of hf_radix's prefill calls measured on the H200 (bench/results/profile_h200.log)."""
    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(5, 20, (650,), generator=gen).tolist()  # ~12 new tokens a row
    return [
        # gsp prefill: 256 prompts' 256-token suffixes behind their group's cached 2,048 tokens (8 groups)
        extend_shape("gsp_suffix_256x(2048+256)", [(i // 32, 2048, 256) for i in range(256)], 8),
        # one gsp prefill forward as the runner makes it: 32 suffixes plus 160 decoding rows riding along
        extend_shape("gsp_mixed_32x(2048+256)+160x(2304+1)",
                     [(i // 4, 2048, 256) for i in range(32)] + [(i % 8, 2304, 1) for i in range(160)], 8),
        # 5-shot scoring: questions after a cached few-shot prefix
        extend_shape("score_650x(1600+~12)", [(0, 1600, n) for n in short], 1),
        extend_shape("score_80x(1500+100)", [(0, 1500, 100) for _ in range(80)], 1),
        # generate's time to first token: one question after a long cached prefix (split prefix)
        extend_shape("ttft_1x(4096+64)", [(0, 4096, 64)], 1),
        # sliding windows behind longer prefixes (the prefix loop starts at the window), with soft-capping
        extend_shape("window1024_32x(4096+256)", [(i // 4, 4096, 256) for i in range(32)], 8,
                     sliding_window=1024),
        extend_shape("gemma2_d256_w4096_cap50_16x(6144+512)", [(i, 6144, 512) for i in range(16)], 16, hq=16,
                     d=256, sliding_window=4096, softcap=50.0),
        # a head size that is not a power of two (Phi-3-mini: 32 heads of 96)
        extend_shape("phi3_d96_64x(1024+128)", [(i // 8, 1024, 128) for i in range(64)], 8, hkv=32, d=96),
    ]


def _extend_call(fn: Any, s: dict[str, Any], **kw: Any) -> torch.Tensor:
    return fn(s["q"], s["k_new"], s["v_new"], s["k_cache"], s["v_cache"], s["qo_indptr"], s["prefix_lens"],
              s["prefix_kv_indices"], s["prefix_kv_indptr"], s["q"].shape[-1] ** -0.5,
              max_new_len=s["max_new_len"], max_prefix_len=s["max_prefix_len"], **s["kw"], **kw)


def _extend_reference(s: dict[str, Any], row_ids: list[int]) -> dict[int, torch.Tensor]:
    """float64 outputs of a few rows, with the shape's window and soft-cap (the tests' reference)."""
    out = {}
    scaling = s["q"].shape[-1] ** -0.5
    for i in row_ids:
        a, b = int(s["qo_indptr"][i]), int(s["qo_indptr"][i + 1])
        p0, p1 = int(s["prefix_kv_indptr"][i]), int(s["prefix_kv_indptr"][i + 1])
        slots = s["prefix_kv_indices"][p0:p1].long()
        k = torch.cat([s["k_cache"][slots], s["k_new"][a:b]]).cpu()
        v = torch.cat([s["v_cache"][slots], s["v_new"][a:b]]).cpu()
        q_pos = torch.arange(p1 - p0, p1 - p0 + b - a)
        out[i] = ref_attention_row(s["q"][a:b].cpu(), k, v, q_pos, scaling, s["kw"]["sliding_window"],
                                   s["kw"]["softcap"])
    return out


def _rel_err(out: torch.Tensor, s: dict[str, Any], ref: dict[int, torch.Tensor]) -> float:
    num = den = 0.0
    for i, r in ref.items():
        a, b = int(s["qo_indptr"][i]), int(s["qo_indptr"][i + 1])
        num += float((out[a:b].cpu().double() - r).norm() ** 2)
        den += float(r.norm() ** 2)
    return (num / max(den, 1e-30)) ** 0.5


def _time_extend(s: dict[str, Any], fn: Any, cfgs: list[dict[str, int]] | None,
                 **kw: Any) -> tuple[float, torch.Tensor]:
    if cfgs is not None:
        kw["configs"] = cfgs
    out = _extend_call(fn, s, **kw)
    return bench(lambda: _extend_call(fn, s, **kw)), out


def bench_extend(quick: bool, old_ref: str, old_file: str | None = None, rounds: int = 1) -> dict[str, Any]:
    """Each shape: the earlier kernel (``old_file``, else git ``old_ref``'s), the committed default, and
    (unless quick) every config list of EXTEND_SWEEP and the unpacked layout, each timed ``rounds`` times
    in turn (median ms); ms, TFLOP/s, error vs the float64 reference; then both kernels' compiled variants."""
    old = _load_old_extend(old_ref, old_file)
    if old is None:
        print(f"extend: git cannot show {old_ref} (pass --old-file); timing the new kernel only", flush=True)
    elif old_file is not None:
        old_ref = old_file
    results: list[dict[str, Any]] = []
    for s in extend_shapes():
        n = len(s["rows"])
        ref = _extend_reference(s, sorted({0, n // 3, n - 1}))
        variants: list[tuple[str, Any, Any, dict[str, Any]]] = []
        if old is not None:
            variants.append((f"before ({old_ref})", old.extend_attention, None, {}))
        variants += [(_cfg_label(c), ta.extend_attention, c, {}) for c in (EXTEND_SWEEP[:1] if quick else
                                                                            EXTEND_SWEEP)]
        if not quick:
            variants.append(("default, unpacked heads", ta.extend_attention, None, {"pack_gqa": False}))
        times: dict[str, list[float]] = {label: [] for label, *_ in variants}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(rounds):
            for label, fn, cfgs, kw in variants:
                if label not in times:  # failed in an earlier round
                    continue
                try:
                    ms, outs[label] = _time_extend(s, fn, cfgs, **kw)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report and go on
                    print(f"extend {s['name']:<40} {label:<44} failed: {str(exc)[:160]}", flush=True)
                    results.append({"shape": s["name"], "variant": label, "error": str(exc)[:400]})
                    del times[label]
                    continue
                times[label].append(ms)
        for label, _, cfgs, _ in variants:
            if label not in times:
                continue
            ms = statistics.median(times[label])
            rec = {"shape": s["name"], "variant": label, "cfgs": cfgs, "ms": ms, "ms_rounds": times[label],
                   "tflops": s["flops"] / (ms * 1e-3) / 1e12, "rows": n, "tokens": int(s["q"].shape[0]),
                   "kw": s["kw"], "rel_err_vs_float64": _rel_err(outs[label], s, ref)}
            results.append(rec)
            spread = f" [{min(times[label]) * 1e3:.1f}, {max(times[label]) * 1e3:.1f}]" if rounds > 1 else ""
            print(f"extend {s['name']:<40} {label:<44} {ms * 1e3:9.1f} us{spread}  "
                  f"{rec['tflops']:6.1f} TFLOP/s  err {rec['rel_err_vs_float64']:.1e}", flush=True)
        del s, outs
        torch.cuda.empty_cache()
    compiled = {"committed": _compiled_variants(triton_extend._extend_kernel)}
    if old is not None:
        compiled["before"] = _compiled_variants(old._extend_kernel)
    return {"old_ref": old_ref, "default_cfgs": triton_extend._extend_configs(128, torch.bfloat16,
                                                                           torch.device("cuda")),
            "rounds": rounds, "cases": results, "best": _best_extend(results), "compiled": compiled}


_VARIANT_KEYS = ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "ROW_GRID", "PACK_GQA", "DIRECT", "USE_WINDOW", "SOFTCAP",
                 "HAS_SINKS")


def _compiled_variants(kernel: Any) -> list[dict[str, Any]]:
    """What each compiled variant of a Triton kernel is (its constexprs, warps, stages, the int arguments
    it specialized on) and holds: registers, spills, shared memory, and the PTX's global loads, async
    copies and MMA instructions."""
    found = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            try:
                names = kernel.arg_names
                consts = {names[k[0]]: v for k, v in compiled.src.constants.items()}
                ptx = compiled.asm["ptx"]
                found.append({
                    "variant": {k: consts[k] for k in _VARIANT_KEYS if k in consts}
                    | {"num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages},
                    "specialized": sorted(n for n in consts if n not in _VARIANT_KEYS and n.islower())
                    + sorted(f"{names[k[0]]}%16" for k in compiled.src.attrs if names[k[0]].islower()),
                    "n_regs": getattr(compiled, "n_regs", None),  # set once loaded on the device
                    "n_spills": getattr(compiled, "n_spills", None),
                    "shared": compiled.metadata.shared, "ld_global": ptx.count("ld.global"),
                    "cp_async": ptx.count("cp.async"), "mma": ptx.count("mma."),
                })
            except (AttributeError, KeyError, IndexError, TypeError) as exc:
                found.append({"error": repr(exc)[:200]})
    return found


def print_compiled_comparison(compiled: dict[str, list[dict[str, Any]]]) -> None:
    """Per compiled variant (constexprs, warps, stages): the committed kernel's code next to the earlier
    one's; the earlier one may hold several of a variant (it specialized on ints the committed one does
    not)."""
    stats = ("n_regs", "n_spills", "shared", "ld_global", "cp_async", "mma")
    by: dict[str, dict[str, set[tuple]]] = {}
    for which, variants in compiled.items():
        for v in variants:
            if "error" in v:
                print(f"extend compiled ({which}): {v['error']}")
                continue
            key = " ".join(f"{k}={x}" for k, x in v["variant"].items())
            by.setdefault(key, {}).setdefault(which, set()).add(tuple(v[k] for k in stats))
    print(f"extend compiled variants: committed {len(compiled.get('committed', []))}, "
          f"before {len(compiled.get('before', []))}; per variant ({', '.join(stats)}):")
    for key, sides in sorted(by.items()):
        new, old = sides.get("committed", set()), sides.get("before", set())
        verdict = "same" if new == old else "DIFFERENT" if new and old else "only one side"
        print(f"  {key}: committed {sorted(new)} before {sorted(old)} -> {verdict}")


def _best_extend(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fastest variant per shape, and the config list with the least total time over all shapes."""
    ok = [r for r in results if "ms" in r]
    per_shape = {}
    for r in ok:
        if r["shape"] not in per_shape or r["ms"] < per_shape[r["shape"]]["ms"]:
            per_shape[r["shape"]] = {"variant": r["variant"], "ms": r["ms"], "tflops": r["tflops"]}
    shapes = set(per_shape)
    totals: dict[str, float] = {}
    for label in {r["variant"] for r in ok}:
        mine = {r["shape"]: r["ms"] for r in ok if r["variant"] == label}
        if set(mine) == shapes:
            totals[label] = sum(mine.values())
    overall = min(totals, key=totals.get) if totals else None
    return {"per_shape": per_shape, "total_ms": totals, "overall": overall}


def print_extend_summary(ext: dict[str, Any]) -> None:
    by = {(r["shape"], r["variant"]): r for r in ext["cases"] if "ms" in r}
    before = next((v for _, v in by if v.startswith("before")), None)
    for shape, best in ext["best"]["per_shape"].items():
        new = by.get((shape, "default"))
        old = by.get((shape, before)) if before else None
        line = f"extend {shape:<40}"
        if new:
            line += f" default {new['ms'] * 1e3:8.1f} us {new['tflops']:5.0f} TFLOP/s"
        if old and new:
            line += f" | before {old['ms'] * 1e3:8.1f} us  x{old['ms'] / new['ms']:.2f}"
        print(line + f" | best {best['variant']} {best['ms'] * 1e3:.1f} us")
    if ext["best"]["total_ms"]:
        print("extend config lists by total time over the shapes:")
        for label, total in sorted(ext["best"]["total_ms"].items(), key=lambda kv: kv[1]):
            print(f"  {total * 1e3:9.1f} us  {label}")
        print(f"extend best overall: {ext['best']['overall']}")
    print_compiled_comparison(ext["compiled"])


# --------------------------------------------------------------------------------------------------------
# (c) store
# --------------------------------------------------------------------------------------------------------


# Run in a fresh process: its clock starts before anything is imported (torch included), so it cannot import
# common.timer, whose module imports torch and transformers first.
_LOAD_SNIPPET = """
import time, sys
t0 = time.perf_counter()
sys.path.insert(0, {repo!r})
from hf_radix.kernels import store
t1 = time.perf_counter()
secs = store.build_store_kernel()
print("LOAD", t1 - t0, secs, store.STORE_BUILD_INFO.get("cached"))
"""


def store_host_breakdown(pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, n: int = 3000) -> dict:
    """Host microseconds per call of the pieces of store_kv's CUDA path (launches are tiny)."""
    import ctypes

    dev = k.device.index or 0
    lib = store_mod._dev_libs[dev]
    segs = [store_mod._segments(t) for t in (k, k, pool[0], pool[1])]
    kc, vc = pool[0], pool[1]
    pieces = {
        "check": lambda: store_mod._check(kc, vc, loc, k, k),
        "segments_x4": lambda: [store_mod._segments(t) for t in (k, k, kc, vc)],
        "current_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "ctypes_array": lambda: (ctypes.c_int64 * 8)(1, 2, 3, 4, 5, 6, 7, 8),
        "data_ptr_x5": lambda: (k.data_ptr(), k.data_ptr(), kc.data_ptr(), vc.data_ptr(), loc.data_ptr()),
        "store_cuda": lambda: store_mod._store_cuda(lib, dev, kc, vc, loc, k, k, segs),
        "store_kv": lambda: store_mod.store_kv(kc, vc, loc, k, k, backend="cuda"),
        "store_kv_torch": lambda: store_mod.store_kv(kc, vc, loc, k, k, backend="torch"),
    }
    out = {}
    for name, fn in pieces.items():
        fn()
        torch.cuda.synchronize()
        with timer(sync=False) as t:
            for _ in range(n):
                fn()
        out[name] = t.us / n
        torch.cuda.synchronize()
    parts = ", ".join(f"{k_}={v:.1f}" for k_, v in out.items())
    print(f"store host breakdown (us/call): {parts}", flush=True)
    return out


def bench_store() -> dict[str, Any]:
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_RADIX_CACHE_DIR"] = tmp
        res["first_build_s"], _ = timed(store_mod.build_store_kernel, sync=False)
        res["first_build_info"] = dict(store_mod.STORE_BUILD_INFO)
        # cached load in a fresh process (import of the module + ctypes load, no nvcc compile)
        out = subprocess.run(
            [sys.executable, "-c", _LOAD_SNIPPET.format(repo=str(REPO))],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=300,
        )
        for line in out.stdout.splitlines():
            if line.startswith("LOAD"):
                _, imp, secs, cached = line.split()
                res["cached_load_s"] = float(secs)
                res["cached_load_was_cached"] = cached == "True"
                res["module_import_s"] = float(imp)
        if "cached_load_s" not in res:
            res["cached_load_error"] = out.stderr[-2000:]

    t, hkv, d, dev, dtype = 8192, 8, 128, "cuda", torch.bfloat16
    slots = 4 * t
    pool = torch.zeros((2, slots, hkv, d), device=dev, dtype=dtype)
    k = torch.randn((t, hkv, d), device=dev, dtype=dtype)
    v = torch.randn((t, hkv, d), device=dev, dtype=dtype)
    k_t = torch.randn((hkv, t, d), device=dev, dtype=dtype).transpose(0, 1)  # HF layout view
    v_t = torch.randn((hkv, t, d), device=dev, dtype=dtype).transpose(0, 1)
    loc = torch.randperm(slots, device=dev)[:t]
    nbytes = 2 * 2 * t * hkv * d * k.element_size()  # read + write, K and V
    for name, (kk, vv) in {"contiguous": (k, v), "transposed": (k_t, v_t)}.items():
        ms_cuda = bench(
            lambda kk=kk, vv=vv: store_mod.store_kv(pool[0], pool[1], loc, kk, vv, backend="cuda")
        )
        ms_torch = bench(
            lambda kk=kk, vv=vv: store_mod.store_kv(pool[0], pool[1], loc, kk, vv, backend="torch")
        )
        res[name] = {
            "ms_cuda": ms_cuda,
            "ms_torch_index_copy": ms_torch,
            "cuda_TBps": nbytes / (ms_cuda * 1e-3) / 1e12,
            "torch_TBps": nbytes / (ms_torch * 1e-3) / 1e12,
        }
        print(
            f"store {name:<10}: cuda {ms_cuda * 1e3:6.1f} us ({res[name]['cuda_TBps']:.2f} TB/s)  "
            f"torch index_copy_ {ms_torch * 1e3:6.1f} us",
            flush=True,
        )
    # host-side launch overhead (small batch)
    small_k, small_loc = k[:8], loc[:8]
    torch.cuda.synchronize()
    n = 2000
    for backend in ("cuda", "torch"):
        with timer(sync=False) as t:
            for _ in range(n):
                store_mod.store_kv(pool[0], pool[1], small_loc, small_k, small_k, backend=backend)
        host = t.seconds / n
        torch.cuda.synchronize()
        res[f"host_us_per_call_{backend}"] = host * 1e6
    cached_s = res.get("cached_load_s", float("nan"))
    res["host_breakdown_us"] = store_host_breakdown(pool, small_loc, small_k)
    print(
        f"store first build {res['first_build_s']:.2f} s, cached load {cached_s:.3f}"
        f" s; host us/call cuda {res['host_us_per_call_cuda']:.1f} torch {res['host_us_per_call_torch']:.1f}"
    )
    return res


def main() -> None:
    ap = parser_for(__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--only", choices=["decode", "extend", "store"], default=None)
    ap.add_argument("--old-ref", default="710e311",
                    help="git commit whose extend kernel is timed as 'before' (default: before the rework)")
    ap.add_argument("--old-file", default=None,
                    help="an earlier triton_extend.py to time as 'before' (where the checkout has no .git)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="extend: time every variant this many times, in turn, and keep the median")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if args.only in (None, "store"):
        results["store"] = bench_store()
    if args.only in (None, "decode"):
        results["decode"] = bench_decode(args.quick)
        results["decode_small"] = bench_decode_small()
        if not args.quick:
            results["decode_d256"] = bench_decode_d256()
    if args.only in (None, "extend"):
        results["extend"] = bench_extend(args.quick, args.old_ref, args.old_file, args.rounds)

    print("\n=== summary ===")
    print(f"{'benchmark':<44} {'time (us)':>10}  note")
    for r in results.get("decode", []):
        if r["default"]:
            print(
                f"{'decode B256x2048 p' + str(r['page_size']) + ' splits=' + str(r['splits']):<44} "
                f"{r['ms'] * 1e3:>10.1f}  {r['GBps'] / 1e3:.2f} TB/s = {r['frac_peak']:.0%} of 4.3 TB/s"
            )
    for r in results.get("decode", []):
        best = min((x for x in results["decode"] if x["page_size"] == r["page_size"]), key=lambda x: x["ms"])
        if r is best:
            print(
                f"{'  best variant p' + str(r['page_size']):<44} {r['ms'] * 1e3:>10.1f}  "
                f"splits={r['splits']} {r['cfg']} {r['frac_peak']:.0%}"
            )
    for r in results.get("decode_small", []):
        if r["auto"]:
            print(f"{'decode B8x8192 p16 auto splits=' + str(r['splits']):<44} {r['ms'] * 1e3:>10.1f}  "
                  f"{r['frac_peak']:.0%} of 4.3 TB/s")
    for r in results.get("decode_d256", []):
        if r["default"]:
            print(f"{'decode d256 B64x4096 p16 splits=' + str(r['splits']):<44} {r['ms'] * 1e3:>10.1f}  "
                  f"{r['frac_peak']:.0%} of 4.3 TB/s")
    if "extend" in results:
        print_extend_summary(results["extend"])
    s = results.get("store")
    if s:
        print(f"{'store first build (nvcc)':<44} {s['first_build_s'] * 1e6:>10.0f}")
        print(f"{'store cached load (new process)':<44} {s.get('cached_load_s', float('nan')) * 1e6:>10.0f}")
        for name in ("contiguous", "transposed"):
            print(
                f"{'store 8192x8x128 ' + name + ' cuda':<44} {s[name]['ms_cuda'] * 1e3:>10.1f}  "
                f"torch index_copy_ {s[name]['ms_torch_index_copy'] * 1e3:.1f} us"
            )
    write_result(results, args.json, echo=False)


if __name__ == "__main__":
    main()
