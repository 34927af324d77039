"""Hybrid models' snapshot points: every branch length of a call's prompts (against a brute force over all
pairs), every `interval` tokens, and the last page boundary, as page multiples."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix import SamplingParams
from hf_radix.scheduling.admission import match_end, snapshot_points
from hf_radix.scheduling.request import Req


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _brute_force(reqs: list[Req], page_size: int, interval: int) -> dict[int, tuple[int, ...]]:
    points = {}
    for r in reqs:
        key = r.match_ids[: match_end(r)]
        end = match_end(r) // page_size * page_size
        depths = {_common(key, o.match_ids[: match_end(o)]) for o in reqs if o is not r}
        periodic = set(range(interval, end, interval)) if interval else set()
        lengths = {min(d, end) // page_size * page_size for d in depths | periodic} | {end}
        points[r.index] = tuple(sorted(p for p in lengths if p > 0))
    return points


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=12),
    page_size=st.sampled_from([1, 2, 4]),
    interval=st.sampled_from([0, 3, 4]),
    scoring=st.booleans(),
)
def test_snapshot_points_match_brute_force(prompts, page_size, interval, scoring):
    params = SamplingParams(max_new_tokens=2)
    reqs = [
        Req(i, p, params, score_from=max(len(p) - 2, 0) if scoring and len(p) > 1 else None)
        for i, p in enumerate(prompts)
    ]
    assert snapshot_points(reqs, page_size, interval) == _brute_force(reqs, page_size, interval)


def test_few_shot_prefix_and_each_context_are_branch_points():
    """Scoring: 3 questions x 2 choices behind one 8-token prefix: each request snapshots at the prefix
    (shared by all) and at its context but its last token (shared with its sibling choice, and what a
    match may cover: the context's last position gives the first choice token's logits)."""
    params = SamplingParams(max_new_tokens=1)
    prefix = list(range(100, 108))
    reqs, i = [], 0
    for q in range(3):
        context = prefix + [10 + q] * 4
        for choice in ([1, 2], [3, 4, 5]):
            reqs.append(Req(i, context + choice, params, score_from=len(context) - 1))
            i += 1
    points = snapshot_points(reqs, page_size=1)
    assert all(points[r.index] == (8, 11) for r in reqs)
