"""CPU benchmark of the cache-aware pending queue (schedule_policy.PrefixAwareQueue) and its cost in a run.

Default: builds `--prompts` requests over `--groups` shared few-shot prefixes (plus `--zero-reuse` unrelated
ones), then drains the queue as the scheduler would, inserting each served prompt into a radix tree (the
prefix its batch-mates then reuse). Reports the queue's own cost (build, and every head/popleft including
its tree matches) apart from the tree inserts, and the former static sort for comparison.

`--scheduled`: the real thing with the forward stubbed. `--prompts` few-shot scoring requests (questions
behind `--groups` distinct ~1-1.5K-token preambles, each scored against 4 choices) go through
`RadixBatchRunner.loglikelihood`: the real scheduler, queue, cache manager, tree (with eviction, the pool
being `--pool-tokens`) and metadata; `engine.run_model` returns canned logits. Reports the order's cost
(the queue's build, timed in the run; every head/popleft/extendleft the scheduler made, replayed in one
timed span on a queue built the same way, the tree's answers given back as recorded; the tree matches it
made, timed in the run) and the scheduler's whole `_schedule` (admission, which includes the queue), in
CPU seconds of the thread (the machine's load does not inflate them), against the run's own CPU time and
against an estimated H200 run: the tokens this run computes x the seconds per computed token of the H200
scoring benchmark (`bench/results/score_bench_h200.json`: hf_radix seconds / computed tokens,
Llama-3.1-8B shape). Goal: the order below 1% of the run.
Not a test: `python bench/schedule_bench.py --scheduled --prompts 50000 --groups 300 --json PATH`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_machine, int_options, parser_for, timed, timer, write_result  # noqa: E402

from hf_radix import scheduler as scheduler_module  # noqa: E402
from hf_radix.memory.radix_tree import RadixPrefixCache  # noqa: E402
from hf_radix.scheduling import schedule_policy  # noqa: E402
from hf_radix.scheduling.request import Req  # noqa: E402
from hf_radix.scheduling.sampling import SamplingParams  # noqa: E402
from hf_radix.scheduling.schedule_policy import PrefixAwareQueue  # noqa: E402


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

    static_sort_s, _ = timed(lambda: sorted(reqs, key=lambda r: r.token_ids), sync=False)

    tree = RadixPrefixCache(page_size=1)
    match_calls = [0]

    def cached_len(ids: np.ndarray) -> int:
        match_calls[0] += 1
        return tree.match_prefix(ids).cached_len

    build_s, queue = timed(lambda: PrefixAwareQueue(reqs, cached_len, lambda: 0), sync=False)
    pop_s = insert_s = 0.0
    next_slot = 0
    while queue:
        with timer(sync=False) as pop:
            queue[0]
            req = queue.popleft()
        with timer(sync=False) as insert:
            ids = req.match_ids
            tree.insert_prefix(ids, np.arange(next_slot, next_slot + len(ids)))
            next_slot += len(ids)
        insert_s += insert.seconds
        pop_s += pop.seconds
    return {
        "config": {"prompts": prompts, "groups": groups, "prefix_len": prefix_len, "suffix_len": suffix_len,
                   "zero_reuse": zero_reuse, "seed": seed},
        "machine": cpu_machine(),
        "static_sort_s": static_sort_s,
        "queue_build_s": build_s,
        "queue_pops_s": pop_s,
        "queue_total_s": build_s + pop_s,
        "queue_us_per_prompt": (build_s + pop_s) / prompts * 1e6,
        "tree_matches": match_calls[0],
        "tree_inserts_s": insert_s,
    }


SCORE_BENCH = Path(__file__).resolve().parent / "results" / "score_bench_h200.json"


def _few_shot_pairs(prompts: int, groups: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`prompts` (context, choice) pairs: 4 choices (2-10 tokens) per question (50-300 tokens) behind one
    of `groups` preambles (1,000-1,500 tokens); questions interleave the preambles in input order."""
    rng = np.random.default_rng(seed)
    preambles = [rng.integers(2, vocab, int(rng.integers(1000, 1501))).tolist() for _ in range(groups)]
    pairs = []
    for q in range(-(-prompts // 4)):
        context = preambles[q % groups] + rng.integers(2, vocab, int(rng.integers(50, 301))).tolist()
        pairs += [(context, rng.integers(2, vocab, int(rng.integers(2, 11))).tolist()) for _ in range(4)]
    return pairs[:prompts]


class _Recorder:
    """Records what the scheduler asks of its PrefixAwareQueue in a run: the requests it was built from,
    every call, every value its `evictions()` gave and every `cached_len` match (timed: CPU seconds of
    this thread, which the machine's load does not inflate)."""

    def __init__(self):
        self.reqs: list = []
        self.calls: list[tuple[str, list | None]] = []
        self.served: list = []  # what each head/popleft returned
        self.evictions: list[int] = []
        self.matches: list[int] = []
        self.match_s = 0.0
        self.build_s = 0.0

    @contextlib.contextmanager
    def recording(self):
        cls = schedule_policy.PrefixAwareQueue
        real = {name: getattr(cls, name) for name in ("__init__", "__getitem__", "popleft", "extendleft")}
        recorder = self

        def init(queue, reqs, cached_len, evictions):
            recorder.reqs = list(reqs)

            def timed_cached_len(ids):
                with timer(sync=False, clock=time.thread_time) as t:
                    length = cached_len(ids)
                recorder.match_s += t.seconds
                recorder.matches.append(length)
                return length

            def counted_evictions():
                recorder.evictions.append(evictions())
                return recorder.evictions[-1]

            with timer(sync=False, clock=time.thread_time) as t:
                real["__init__"](queue, recorder.reqs, timed_cached_len, counted_evictions)
            recorder.build_s = t.seconds

        def head(queue, index):
            recorder.calls.append(("__getitem__", None))
            recorder.served.append(real["__getitem__"](queue, index))
            return recorder.served[-1]

        def popleft(queue):
            recorder.calls.append(("popleft", None))
            recorder.served.append(real["popleft"](queue))
            return recorder.served[-1]

        def extendleft(queue, reqs):
            reqs = list(reqs)
            recorder.calls.append(("extendleft", reqs))
            return real["extendleft"](queue, reqs)

        for name, fn in (("__init__", init), ("__getitem__", head), ("popleft", popleft),
                         ("extendleft", extendleft)):
            setattr(cls, name, fn)
        try:
            yield self
        finally:
            for name, fn in real.items():
                setattr(cls, name, fn)

    def replay_s(self) -> float:
        """CPU seconds of every call again, in one timed span, on a queue built as in the run: the recorded
        matches and eviction counts given back as they came (their cost is `match_s`, the build's
        `build_s`, both timed in the run)."""
        matches, evictions = iter(self.matches), iter(self.evictions)
        served = []
        queue = schedule_policy.PrefixAwareQueue(
            self.reqs, lambda ids: next(matches), lambda: next(evictions)
        )
        with timer(sync=False, clock=time.thread_time) as t:
            for name, reqs in self.calls:
                if name == "__getitem__":
                    served.append(queue[0])
                elif name == "popleft":
                    served.append(queue.popleft())
                else:
                    queue.extendleft(reqs)
        seconds = t.seconds
        same = len(served) == len(self.served) and all(a is b for a, b in zip(served, self.served))
        if not same or next(evictions, None) is not None or next(matches, None) is not None:
            raise RuntimeError("the replay did not repeat the run")
        return seconds


def run_scheduled(prompts: int, groups: int, pool_tokens: int, seed: int) -> dict:
    """A whole scoring run through the real scheduler with the forward stubbed; see the module docstring."""
    from host_cost_bench import VOCAB, _fake_forward, _stub_slot_lists

    from hf_radix import RadixBatchRunner
    from hf_radix.tiny import tiny_model

    model = tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096, eos_token_id=None)
    runner = RadixBatchRunner(model, max_total_tokens=pool_tokens, attn_backend="torch", warm_up=False,
                              max_running_requests=256, chunked_prefill_size=8192)
    _fake_forward(runner.engine)
    pairs = _few_shot_pairs(prompts, groups, VOCAB, seed)
    runner.loglikelihood(pairs[:256], progress=False)  # first run: tables grow
    runner.reset_cache()

    schedule_s = [0.0, 0]
    real_schedule = scheduler_module.Scheduler._schedule

    def timed_schedule(scheduler):
        with timer(sync=False, clock=time.thread_time) as t:
            scheduled = real_schedule(scheduler)
        schedule_s[0] += t.seconds
        schedule_s[1] += 1
        return scheduled

    recorder = _Recorder()
    scheduler_module.Scheduler._schedule = timed_schedule
    before = runner.engine.stats_dict()
    try:
        with _stub_slot_lists(), recorder.recording():
            with timer(sync=False) as wall_t, timer(sync=False, clock=time.thread_time) as cpu_t:
                runner.loglikelihood(pairs, progress=False)
            wall, cpu = wall_t.seconds, cpu_t.seconds
    finally:
        scheduler_module.Scheduler._schedule = real_schedule
    runner.check_integrity()
    after = runner.engine.stats_dict()
    done = {k: after[k] - before[k] for k in ("computed_tokens", "prompt_tokens", "cached_tokens",
                                              "forward_calls", "evicted_tokens")}
    replay_s = recorder.replay_s()
    order_s = recorder.build_s + replay_s + recorder.match_s
    calls = {name: sum(1 for n, _ in recorder.calls if n == name)
             for name in ("__getitem__", "popleft", "extendleft")}
    h200 = json.loads(SCORE_BENCH.read_text())
    per_token = h200["hf_radix"]["seconds"] / h200["hf_radix"]["computed_tokens"]
    gpu_run = done["computed_tokens"] * per_token
    return {
        "config": {"prompts": len(pairs), "questions": len(pairs) // 4, "groups": groups,
                   "preamble_tokens": [1000, 1500], "question_tokens": [50, 300], "choice_tokens": [2, 10],
                   "pool_tokens": pool_tokens, "chunked_prefill_size": 8192, "max_running_requests": 256,
                   "vocab": VOCAB, "seed": seed},
        "machine": cpu_machine(),
        "run": done,
        "run_wall_s_cpu_stubbed": wall,
        "run_thread_cpu_s_stubbed": cpu,
        "order_cpu_s": order_s,
        "order_build_cpu_s": recorder.build_s,
        "order_calls_cpu_s": replay_s,
        "order_tree_match_cpu_s": recorder.match_s,
        "order_tree_matches": len(recorder.matches),
        "order_queue_calls": calls,
        "schedule_cpu_s": schedule_s[0],
        "schedule_calls": schedule_s[1],
        "gpu_estimate": {
            "basis": "computed tokens x H200 seconds per computed token of the 5-shot scoring benchmark "
                     f"({SCORE_BENCH.name}: {h200['hf_radix']['seconds']:.3f} s / "
                     f"{h200['hf_radix']['computed_tokens']} tokens, Llama-3.1-8B shape, bf16)",
            "seconds_per_token": per_token,
            "run_s": gpu_run,
        },
        "order_fraction_of_gpu_run": order_s / gpu_run,
        "schedule_fraction_of_gpu_run": schedule_s[0] / gpu_run,
        "order_fraction_of_run_cpu": order_s / cpu,
        "schedule_fraction_of_run_cpu": schedule_s[0] / cpu,
    }


def main() -> None:
    ap = int_options(parser_for(__doc__), prompts=50_000, groups=64, prefix_len=512, suffix_len=32)
    ap.add_argument("--zero-reuse", type=int, default=1000, help="prompts sharing nothing with the others")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduled", action="store_true",
                    help="a whole scoring run through the real scheduler, forward stubbed (see above)")
    ap.add_argument("--pool-tokens", type=int, default=200_000, help="KV pool of --scheduled")
    args = ap.parse_args()
    if args.scheduled:
        result = run_scheduled(args.prompts, args.groups, args.pool_tokens, args.seed)
    else:
        result = run(args.prompts, args.groups, args.prefix_len, args.suffix_len, args.zero_reuse, args.seed)
    write_result(result, args.json)


if __name__ == "__main__":
    main()
