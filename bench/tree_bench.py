"""CPU micro-benchmark of RadixPrefixCache.match_prefix / insert_prefix on shared-prefix prompts.

Builds `--groups` random shared prefixes, then for `--prompts` prompts (prefix + unique suffix) times one
match_prefix and one insert_prefix each. Not a test: run `python bench/tree_bench.py [--json PATH]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_machine, int_options, parser_for, timed, timer, write_result  # noqa: E402

from hf_radix.memory.radix_tree import RadixPrefixCache  # noqa: E402


def run(groups: int, prompts: int, prefix_len: int, suffix_len: int, page_size: int, vocab: int,
        seed: int) -> dict:
    """Runs the benchmark and returns per-call timings (µs) and tree sizes."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, prefix_len, dtype=np.int64) for _ in range(groups)]
    length = (prefix_len + suffix_len) // page_size * page_size
    tree = RadixPrefixCache(page_size=page_size)
    next_slot = 0
    match_us, insert_us, indices_us, cached = [], [], [], []
    for i in range(prompts):
        prompt = np.concatenate([prefixes[i % groups], rng.integers(0, vocab, suffix_len, dtype=np.int64)])
        prompt = prompt[:length]
        with timer(sync=False) as match:
            handle = tree.match_prefix(prompt)
        with timer(sync=False) as indices:
            matched = handle.matched_indices()
        new = np.arange(next_slot, next_slot + length - handle.cached_len, dtype=np.int64)
        next_slot += len(new)
        slots = np.concatenate([matched, new])
        with timer(sync=False) as insert:
            tree.insert_prefix(prompt, slots)
        match_us.append(match.us)
        indices_us.append(indices.us)
        insert_us.append(insert.us)
        cached.append(handle.cached_len)

    def stats(xs: list[float]) -> dict:
        a = np.asarray(xs)
        return {"median_us": float(np.median(a)), "mean_us": float(a.mean()),
                "p99_us": float(np.percentile(a, 99))}

    # The first `groups` prompts miss; report steady state over the rest too.
    warm = slice(groups, None)
    return {
        "config": {"groups": groups, "prompts": prompts, "prefix_len": prefix_len, "suffix_len": suffix_len,
                   "prompt_len": length, "page_size": page_size, "vocab": vocab, "seed": seed},
        "machine": cpu_machine(),
        "match_prefix": stats(match_us[warm]),
        "matched_indices": stats(indices_us[warm]),
        "insert_prefix": stats(insert_us[warm]),
        "mean_cached_len": float(np.mean(cached[warm])),
        "tree_tokens": tree.size_info.total_size,
    }


def main() -> None:
    ap = int_options(parser_for(__doc__), groups=8, prompts=10_000, prefix_len=2048, suffix_len=256,
                     page_size=1, vocab=32_000, seed=0)
    args = ap.parse_args()
    wall, res = timed(lambda: run(args.groups, args.prompts, args.prefix_len, args.suffix_len, args.page_size,
                                  args.vocab, args.seed), sync=False)
    res["wall_s"] = wall
    cfg = res["config"]
    print(f"radix tree bench: {cfg['prompts']} prompts x {cfg['prompt_len']} tokens, {cfg['groups']} groups, "
          f"shared prefix {cfg['prefix_len']}, page_size {cfg['page_size']}, "
          f"mean cached {res['mean_cached_len']:.0f}, tree {res['tree_tokens']} tokens")
    print(f"{'op':<16}{'median µs':>12}{'mean µs':>12}{'p99 µs':>12}")
    for op in ("match_prefix", "matched_indices", "insert_prefix"):
        s = res[op]
        print(f"{op:<16}{s['median_us']:>12.1f}{s['mean_us']:>12.1f}{s['p99_us']:>12.1f}")
    print(f"wall {res['wall_s']:.1f} s")
    write_result(res, args.json, echo=False)


if __name__ == "__main__":
    main()
