"""CPU micro-benchmark of the cache-aware pending queue (schedule_policy.PrefixAwareQueue).

Builds `--prompts` requests over `--groups` shared few-shot prefixes (plus `--zero-reuse` unrelated ones),
then drains the queue as the scheduler would, inserting each served prompt into a radix tree (the prefix
its batch-mates then reuse). Reports the queue's own cost (build, and every head/popleft including its
tree matches) apart from the tree inserts, and the former static sort for comparison. Not a test: run
`python bench/schedule_bench.py [--json PATH]`; compare `queue_total_s` with the run time of a real run
of that many prompts (the goal: below 1% of it).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_result  # noqa: E402

from hf_radix.radix_tree import RadixPrefixCache  # noqa: E402
from hf_radix.request import Req  # noqa: E402
from hf_radix.sampling import SamplingParams  # noqa: E402
from hf_radix.schedule_policy import PrefixAwareQueue  # noqa: E402


def run(prompts: int, groups: int, prefix_len: int, suffix_len: int, zero_reuse: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32_000, prefix_len).tolist() for _ in range(groups)]
    params = SamplingParams(max_new_tokens=1)
    reqs = []
    for i in range(prompts):
        if i < zero_reuse:
            ids = rng.integers(0, 32_000, prefix_len + suffix_len).tolist()
        else:
            ids = prefixes[i % groups] + rng.integers(0, 32_000, suffix_len).tolist()
        reqs.append(Req(i, ids, params))

    t0 = time.perf_counter()
    sorted(reqs, key=lambda r: r.token_ids)
    static_sort_s = time.perf_counter() - t0

    tree = RadixPrefixCache(page_size=1)
    match_calls = [0]

    def cached_len(ids: np.ndarray) -> int:
        match_calls[0] += 1
        return tree.match_prefix(ids).cached_len

    t0 = time.perf_counter()
    queue = PrefixAwareQueue(reqs, cached_len, lambda: 0)
    build_s = time.perf_counter() - t0
    pop_s = insert_s = 0.0
    next_slot = 0
    while queue:
        t0 = time.perf_counter()
        queue[0]
        req = queue.popleft()
        t1 = time.perf_counter()
        ids = req.match_ids
        tree.insert_prefix(ids, np.arange(next_slot, next_slot + len(ids)))
        next_slot += len(ids)
        insert_s += time.perf_counter() - t1
        pop_s += t1 - t0
    return {
        "config": {"prompts": prompts, "groups": groups, "prefix_len": prefix_len, "suffix_len": suffix_len,
                   "zero_reuse": zero_reuse, "seed": seed},
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "cpu": platform.processor() or platform.machine()},
        "static_sort_s": static_sort_s,
        "queue_build_s": build_s,
        "queue_pops_s": pop_s,
        "queue_total_s": build_s + pop_s,
        "queue_us_per_prompt": (build_s + pop_s) / prompts * 1e6,
        "tree_matches": match_calls[0],
        "tree_inserts_s": insert_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=50_000)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--zero-reuse", type=int, default=1000, help="prompts sharing nothing with the others")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    result = run(args.prompts, args.groups, args.prefix_len, args.suffix_len, args.zero_reuse, args.seed)
    write_result(result, args.json)


if __name__ == "__main__":
    main()
