"""Deterministic mode's linear layers: the fixed-tile Triton product against cuBLAS, on Llama-3.1-8B's shapes.

For each weight shape and row count: cuBLAS `F.linear` (the default mode), 256-row cuBLAS products (the
mode's earlier scheme, for reference), `invariant_matmul` as the mode runs it (`policy`: `linear_config`'s
pick by the call's shape) and under each candidate launch config; GPU time per
call (replayed from a CUDA graph, median of repeats) and whether a row's bits are the same alone and at
several places of a large call (`identical_rows`) and the same as under the mode's own pick
(`identical_to_policy`).

    python bench/linear_bench.py [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import parser_for, say, write_result  # noqa: E402

from hf_radix.kernels.triton_invariant_matmul import invariant_matmul, linear_config  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
ROWS = (1, 8, 16, 64, 256, 2048, 8192)
_SMS = 132
CONFIGS = {
    "128x128x64_w8_s3": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "64x128x64_w4_s4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "tma_128x256x64_w8_s3": dict(TMA=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                 num_stages=3),
    "tma_128x128x64_w8_s4": dict(TMA=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                 num_stages=4),
    "tma_64x128x64_w4_s4": dict(TMA=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4,
                                num_stages=4),
    "tmap_128x256x64_w8_s3": dict(TMA=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                  num_stages=3, NUM_PROGRAMS=_SMS),
    "tmap_128x128x64_w8_s4": dict(TMA=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                  num_stages=4, NUM_PROGRAMS=_SMS),
    "tmaws_128x256x64_w8_s3": dict(TMA=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                   num_stages=3, NUM_PROGRAMS=_SMS, WARP_SPECIALIZE=True),
    # decode-sized candidates: narrower tiles (more programs), deeper pipelines, a longer K block, 32 rows
    "64x64x64_w4_s4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "64x64x64_w4_s6": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=6),
    "64x128x128_w4_s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    "64x32x64_w4_s6": dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=6),
    "32x64x64_w4_s5": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
    "tma_64x32x64_w4_s6": dict(TMA=True, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, num_warps=4,
                               num_stages=6),
}


def chunked_256(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The earlier scheme: cuBLAS products of exactly 256 rows each, the last zero-padded."""
    n = x.shape[0]
    padded = max(-(-n // 256) * 256, 256)
    rows = torch.cat([x, x.new_zeros(padded - n, x.shape[1])]) if padded != n else x
    out = rows.new_empty(padded, w.shape[0])
    for i in range(0, padded, 256):
        torch.mm(rows[i : i + 256], w.t(), out=out[i : i + 256])
    return out[:n]


def ms(fn, calls: int = 10, repeats: int = 10) -> float:
    """GPU milliseconds a call of `fn` takes, replayed from a CUDA graph of `calls` calls (no launch cost:
    decode steps run from graphs; a prefill's launches hide behind its kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, n: int, k: int) -> dict:
    """One weight shape: bit checks per config, then times per row count."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x_all = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
    device = torch.device("cuda")
    shape: dict = {"n": n, "k": k, "ms": {}, "identical_rows": {},
                   "policy": {m: linear_config(m, n, torch.bfloat16, device) for m in ROWS}}
    probe = x_all[5:6]
    reference = {}
    for c, cfg in list(CONFIGS.items()):
        try:
            reference[c] = invariant_matmul(probe, w, config=cfg)[0]
        except Exception as error:  # a config this GPU or Triton cannot compile: reported, left out
            shape.setdefault("errors", {})[c] = repr(error)[:300]
    configs = {c: CONFIGS[c] for c in reference}
    policy = invariant_matmul(probe, w)[0]
    shape["identical_to_policy"] = {c: torch.equal(r, policy) for c, r in reference.items()}
    for c, cfg in configs.items():
        same = torch.equal(invariant_matmul(x_all, w, config=cfg)[5], reference[c])
        for m in (16, 300, 4097):
            start = 5 - m % 5
            part = invariant_matmul(x_all[start : start + m], w, config=cfg)
            same &= torch.equal(part[5 - start], reference[c])
        shape["identical_rows"][c] = bool(same)
    for m in ROWS:
        x = x_all[:m]
        calls = 10 if m * n <= 2**26 else 2  # a graph keeps every call's output
        row = {"cublas": ms(lambda x=x: F.linear(x, w), calls),
               "chunked_256": ms(lambda x=x: chunked_256(x, w), calls)}
        for c, cfg in configs.items():
            row[c] = ms(lambda x=x, cfg=cfg: invariant_matmul(x, w, config=cfg), calls)
        row["policy"] = ms(lambda x=x: invariant_matmul(x, w), calls)
        shape["ms"][m] = row
        best = min((v, c) for c, v in row.items() if c not in ("cublas", "chunked_256", "policy"))
        say(f"{name:8s} M={m:5d} cublas {row['cublas']:.3f} ms, 256-chunks {row['chunked_256']:.3f}, "
            f"policy {row['policy']:.3f} ({row['policy'] / row['cublas']:.2f}x), "
            f"best triton {best[1]} {best[0]:.3f} ({best[0] / row['cublas']:.2f}x)")
    return shape


def main() -> None:
    args = parser_for(__doc__).parse_args()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(),
               "shapes": {name: bench_shape(name, n, k) for name, (n, k) in SHAPES.items()}}
    write_result(results, args.json)


if __name__ == "__main__":
    main()
