"""Deterministic mode's extend attention kernel under candidate launch configs, on gsp-8x32's shapes.

For each candidate (query tile, key block, warps, stages): GPU time of a prefill chunk like gsp's (rows of
256 new tokens behind a shared 2,048-token cached prefix) and of system-prompt prefills (2,048 new tokens,
nothing cached); and whether its results are usable by the mode: each row's last token bit-identical to
the split decode kernel run with the same key block (`matches_decode`), a token's result the same when it
is alone in its call (`position_invariant`), and the same bits as the mode's current config where the key
block is the same (`identical_to_current`).

    python bench/invariant_attention_bench.py [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import parser_for, say, write_result  # noqa: E402

from hf_radix.kernels.triton_invariant_attention import invariant_attention, invariant_config  # noqa: E402
from hf_radix.kernels.triton_split_decode import split_decode_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128
CANDIDATES = [(bm, bn, w, s) for bm, bn, w in ((64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4),
                                              (128, 128, 8), (128, 128, 4))
              for s in (2, 3)]


def _i32(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=torch.int32, device="cuda")


def _case(rows: int, new: int, prefix: int, seed: int) -> dict:
    """`rows` rows of `new` new tokens each behind one shared cached `prefix`, slots scattered."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots = prefix + rows * new
    kc = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(slots, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(slots, device="cuda", generator=gen)
    own = perm[prefix:].view(rows, new)
    contexts = [torch.cat([perm[:prefix], own[i]]) for i in range(rows)]
    q = torch.randn(rows * new, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return {"q": q, "kc": kc, "vc": vc, "qo": _i32(np.arange(rows + 1) * new), "kv": torch.cat(contexts),
            "kv_indptr": _i32(np.arange(rows + 1) * (prefix + new)), "contexts": contexts, "new": new,
            "rows": rows, "label": f"{rows}x{new} new behind {prefix}"}


def _extend(c: dict, cfg: dict[str, int]) -> torch.Tensor:
    return invariant_attention(c["q"], c["kc"], c["vc"], c["qo"], c["kv"], c["kv_indptr"], 0.088, config=cfg)


def _checks(c: dict, cfg: dict[str, int], out: torch.Tensor, current_cfg: dict[str, int],
            current: torch.Tensor) -> dict[str, bool]:
    last = c["qo"][1:].long() - 1
    decode_cfg = dict(current_cfg, BLOCK_N=cfg["BLOCK_N"])
    decode = split_decode_attention(c["q"][last], c["kc"], c["vc"], c["kv"], c["kv_indptr"], 0.088,
                                    config=decode_cfg)
    alone = []
    for r in (0, c["rows"] // 2, c["rows"] - 1):
        for t in (0, 1, c["new"] // 2, c["new"] - 1):
            tok = r * c["new"] + t
            ctx = c["contexts"][r][: len(c["contexts"][r]) - c["new"] + t + 1]
            one = invariant_attention(c["q"][tok : tok + 1], c["kc"], c["vc"], _i32([0, 1]), ctx,
                                      _i32([0, len(ctx)]), 0.088, config=cfg)
            alone.append(torch.equal(one[0], out[tok]))
    same_block = cfg["BLOCK_N"] == current_cfg["BLOCK_N"]
    return {"matches_decode": torch.equal(decode, out[last]), "position_invariant": all(alone),
            "identical_to_current": torch.equal(out, current) if same_block else None}


def main() -> None:
    args = parser_for(__doc__).parse_args()
    cases = [_case(32, 256, 2048, 0), _case(4, 2048, 0, 1)]
    current_cfg = invariant_config(D, torch.device("cuda"))
    current = [_extend(c, current_cfg) for c in cases]
    points = []
    for bm, bn, warps, stages in CANDIDATES:
        cfg = dict(current_cfg, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        point: dict = {"config": cfg}
        try:
            for c, cur in zip(cases, current):
                out = _extend(c, cfg)
                ms = triton.testing.do_bench(lambda c=c, cfg=cfg: _extend(c, cfg), warmup=10, rep=50)
                point[c["label"]] = {"ms": ms, **_checks(c, cfg, out, current_cfg, cur)}
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            point["error"] = f"{type(exc).__name__}: {exc}"[:300]
        say(str(point))
        points.append(point)
    write_result({"device": torch.cuda.get_device_name(), "heads": [HQ, HKV, D], "current": current_cfg,
                  "points": points}, args.json)


if __name__ == "__main__":
    main()
