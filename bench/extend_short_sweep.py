"""The short extend of generate's time to first token (one row, 64 new tokens after a cached 4,096-token
prefix, Llama-3.1-8B heads, bf16, page size 1), timed inside CUDA graphs as the model runner replays it.

Eager timings of this shape are host-bound (one launch takes longer than the kernel), so each variant is
captured ten times in one graph and the graph replayed; per-call microseconds are the median of replays.
Variants: today's launch (three row classes, splits picked from the graph's prefix bound), and one launch
of a single tile class over each config and split count. Every variant's output is compared with the
default's (relative error).

    python bench/extend_short_sweep.py --json bench/results/extend_short_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import extend_shape  # noqa: E402

from hf_radix.kernels import triton_attention_common, triton_extend  # noqa: E402

CALLS = 10  # calls captured in one graph


def graph_us(fn) -> float:
    """Median microseconds of one call of `fn`, replayed from a graph of `CALLS` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefix-bound", type=int, default=8192, help="the graph's max_prefix_len")
    args = parser.parse_args()
    s = extend_shape("ttft_1x(4096+64)", [(0, 4096, 64)], 1)
    out = torch.empty_like(s["q"])

    def call(cfgs=None, **kw):
        return triton_extend.extend_attention(
            s["q"], s["k_new"], s["v_new"], s["k_cache"], s["v_cache"], s["qo_indptr"], s["prefix_lens"],
            s["prefix_kv_indices"], s["prefix_kv_indptr"], s["q"].shape[-1] ** -0.5, max_new_len=64,
            max_prefix_len=args.prefix_bound, out=out, configs=cfgs, **kw)

    reference = call().clone()
    rows = [{"variant": "default", "us": graph_us(call), "rel_err": 0.0}]
    print(f"default: {rows[0]['us']:.1f} us", flush=True)
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        for splits in (4, 8, 16, 32):
            triton_attention_common._too_big.clear()
            try:
                result = call([cfg], num_splits=splits)
                if triton_attention_common._too_big:
                    raise RuntimeError("does not fit: fell back to the safe config")
                err = float((result.float() - reference.float()).norm() / reference.float().norm())
                us = graph_us(lambda cfg=cfg, splits=splits: call([cfg], num_splits=splits))
            except Exception as error:  # a config that does not fit: recorded, not fatal
                rows.append({"variant": {**cfg, "splits": splits}, "error": str(error)[:200]})
                continue
            rows.append({"variant": {**cfg, "splits": splits}, "us": us, "rel_err": err})
            print(f"{cfg} splits={splits}: {us:.1f} us (err {err:.1e})", flush=True)
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print("\n===== fastest =====")
    for r in timed[:12]:
        print(f"{r['us']:7.1f} us  {r['variant']}  err {r['rel_err']:.1e}")
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "calls_per_graph": CALLS,
              "prefix_bound": args.prefix_bound, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
