"""Continuous batching over the radix engine: cache-aware admission, chunked prefill, mixed rounds, overlap.

Every step is one forward holding every running request's decode token plus prefill chunks under the
token budget (mixed rounds: a request finishing never stalls the others). With overlap on, the host
schedules and launches step n+1 before it reads step n's sampled tokens: finish checks run one step late,
and a request that stopped is computed once more and its extra token dropped. Outputs are the same with
overlap on and off (greedy and seeded sampling).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from .engine import RadixEngine
from .forward.model_runner import ModelRunner
from .memory.radix_tree import RadixPrefixCache
from .paged_attention.forward_batch import StepRows
from .scheduling.request import Req
from .scheduling.running_rows import Item, RunningRows, StepItems
from .scheduling.sampling import Sampler
from .scheduling.schedule_policy import PrefixAwareQueue
from .scheduling.step_completion import LaunchedStep, StepCompleter
from .scheduling.stop_strings import StopStringDetector

logger = logging.get_logger(__name__)

POLICIES = ("lpm", "fcfs")
MIN_SHARED_TO_DEFER = 16  # a prompt waits for a batch-mate computing at least this much of its prefix


@dataclass
class StepTimes:
    """Per decode step: the host's seconds in its loop iteration (scheduling and launching the step, and
    completing the step before it), waits for the GPU excluded; of those, scheduling and launching
    alone; and (when profiled) the step's GPU seconds."""

    host_s: list[float] = field(default_factory=list)
    launch_s: list[float] = field(default_factory=list)
    gpu_s: list[float] = field(default_factory=list)


class Scheduler:
    """Drives a list of requests to completion; every exit goes through `StepCompleter.release`."""

    def __init__(
        self,
        engine: RadixEngine,
        model_runner: ModelRunner,
        eos_token_ids: Sequence[int],
        tokenizer=None,
        max_running_requests: int = 256,
        chunked_prefill_size: int = 8192,
        schedule_policy: str = "lpm",
        overlap: bool = True,
        profile: bool = False,
        cuda_graph: bool = True,
    ):
        if schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {schedule_policy!r}")
        if max_running_requests < 1 or chunked_prefill_size < 1:
            raise ValueError("max_running_requests and chunked_prefill_size must be >= 1")
        self.engine = engine
        self.manager = engine.manager
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.schedule_policy = schedule_policy
        self.overlap = overlap
        self.cuda_graph = cuda_graph  # steps may replay the model runner's captured graphs
        self._on_cuda = engine.device.type == "cuda"
        self.profile = profile and self._on_cuda
        self.sampler = Sampler(engine.device)
        stop_strings = StopStringDetector(tokenizer) if tokenizer is not None else None
        self.completer = StepCompleter(
            self.manager, self.sampler, frozenset(eos_token_ids), stop_strings, engine.max_context
        )
        self.pending: deque[Req] | PrefixAwareQueue = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.draining: list[Req] = []  # every token launched; waiting for the last results
        self._running_rows: RunningRows | None = None  # `running` as arrays (see `_settle`)
        self.step_times = StepTimes()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._waited = 0.0  # seconds of this loop iteration spent waiting for the GPU

    # -- entry point ---------------------------------------------------------------------------------
    def run(self, reqs: list[Req], progress: bool) -> None:
        """Runs `reqs` to completion (or error); on any exception releases everything it holds."""
        ready = [r for r in reqs if self._admissible(r)]
        if self.schedule_policy == "lpm":
            manager = self.manager
            self.pending = PrefixAwareQueue(
                ready, manager.gpu_cached_len, lambda: manager.evicted_tokens
            )
        else:
            self.pending = deque(ready)
        bar = tqdm(total=len(reqs), disable=not progress, desc="hf_radix", unit="req")
        bar.update(len(reqs) - len(ready))
        self.completer.start(ready, bar)
        in_flight: LaunchedStep | None = None
        try:
            while self.pending or self.prefilling or self.running or self.draining:
                started, self._waited = time.perf_counter(), 0.0
                items = self._schedule()
                launched = self._launch(items) if items else None
                launch_s = time.perf_counter() - started
                previous, in_flight = in_flight, None
                if previous is not None:
                    self._complete(previous)
                if launched is not None and self.overlap:
                    in_flight = launched
                elif launched is not None:
                    self._complete(launched)
                elif previous is None:  # nothing runs, nothing will free pages: the head cannot fit
                    req = self.pending.popleft()
                    self._fail(req, "the request does not fit in the KV pool next to the cached prefixes")
                    bar.update(1)
                if launched is not None and launched.decode:
                    self.step_times.launch_s.append(launch_s)
                    self.step_times.host_s.append(time.perf_counter() - started - self._waited)
        except BaseException:
            self._settle()
            for req in [*self.prefilling, *self.running, *self.draining]:
                self.completer.release(req, "abort", None)
            self.pending.clear()
            self.prefilling.clear()
            self.running.clear()
            self.draining.clear()
            raise
        finally:
            bar.close()
            self._collect_gpu_times()
            self.completer.end()
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            logger.warning("%d of %d requests failed; first: %s", len(failed), len(reqs), failed[0].error)

    # -- admission -----------------------------------------------------------------------------------
    def _admissible(self, req: Req) -> bool:
        """Rejects bad input up front, so it fails alone with a message."""
        if req.finish_reason is not None:  # failed before (the runner could not convert its tokens)
            return False
        ids = req.ids
        engine = self.engine
        if not len(ids):
            return self._fail(req, "empty prompt")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= engine.vocab_size:
            return self._fail(req, f"token ids must lie in [0, {engine.vocab_size}), got {low}..{high}")
        if req.final_len > engine.max_context:
            return self._fail(
                req,
                f"prompt ({req.prompt_len}) + max_new_tokens ({req.params.max_new_tokens}) exceeds the "
                f"model's context of {engine.max_context} tokens",
            )
        if self.manager.pages_for(0, req.final_len) > self.manager.num_pages:
            return self._fail(
                req,
                f"prompt + max_new_tokens needs {req.final_len} tokens; the KV pool holds "
                f"{engine.pool_tokens}",
            )
        if req.score_from is None and req.params.max_new_tokens == 0:
            req.finish_reason = "length"
            return False
        return True

    def _reserved_tokens(self, reqs: Iterable[Req]) -> int:
        """Tokens that admitted requests may still allocate until they finish."""
        ps = self.manager.page_size
        return sum(self.manager.pages_for(self.manager.row_len(r.row), r.final_len) * ps for r in reqs)

    def _schedule(self) -> StepItems:
        """One step: every running request's next token, then prefill chunks under the token budget
        (which counts both), keeping room for what admitted requests will still decode."""
        items = self._running().items()
        budget = self.chunked_prefill_size - len(items)
        if not self.pending and not self.prefilling or budget <= 0:
            return items
        reserved = self._reserved_tokens([*self.running, *self.prefilling])
        in_batch = RadixPrefixCache(page_size=1)
        for req in self.prefilling:
            if budget <= 0:
                break
            end = min(req.prompt_len, req.num_computed + budget)
            items.prefill.append((req, req.num_computed, end))
            budget -= end - req.num_computed
            self._note_in_batch(in_batch, req, end)
        deferred: list[Req] = []
        ps = self.manager.page_size
        while self.pending and budget > 0 and self._active() < self.max_running_requests:
            req = self.pending[0]
            handle = self.manager.match(req.match_ids)
            shared = in_batch.match_prefix(req.match_ids[:-1]).cached_len
            if shared - handle.cached_len >= max(MIN_SHARED_TO_DEFER, ps):
                deferred.append(self.pending.popleft())  # a batch-mate computes this prefix this step
                continue
            need = self.manager.pages_for(handle.cached_len, req.final_len) * ps
            if need + reserved > self.manager.available_size:
                break
            self.manager.lock(handle)
            if need + reserved > self.manager.available_size:  # locking made the matched prefix unevictable
                self.manager.unlock(handle)
                break
            self.pending.popleft()
            req.row = self.manager.open_row(handle)
            req.num_computed = req.cached_tokens = handle.cached_len
            req.host_cached_tokens = handle.restored_len
            self.engine.record_prompt(req.prompt_len, handle.cached_len, handle.restored_len)
            end = min(req.prompt_len, req.num_computed + budget)
            items.prefill.append((req, req.num_computed, end))
            budget -= end - req.num_computed
            reserved += need
            self.prefilling.append(req)
            self._note_in_batch(in_batch, req, end)
        self.pending.extendleft(reversed(deferred))
        return items

    @staticmethod
    def _note_in_batch(tree: RadixPrefixCache, req: Req, end: int) -> None:
        start = tree.size_info.total_size
        tree.insert_prefix(req.ids[:end], np.arange(start, start + end, dtype=np.int64))

    def _active(self) -> int:
        return len(self.running) + len(self.prefilling)

    def _running(self) -> RunningRows:
        """`running` as arrays, built when the list changed."""
        if self._running_rows is None:
            self._running_rows = RunningRows(list(self.running))
        return self._running_rows

    def _settle(self) -> None:
        """Writes the running requests' pending decode steps into their counters and drops the arrays;
        called before `running` changes or a running request's counters are read."""
        cached, self._running_rows = self._running_rows, None
        if cached is not None:
            cached.settle()

    # -- launching a step ----------------------------------------------------------------------------
    def _step_rows(self, items: StepItems, running: RunningRows) -> StepRows:
        """The step in page-table terms; decode tokens are read on the device (the last step sampled them).

        The first items are `running`'s decode tokens (one each), the rest prefill chunks.
        """
        decode = running.step()
        prefill = items.prefill
        if not prefill:
            return decode
        table = np.array([(req.row, s, e) for req, s, e in prefill], dtype=np.int64).reshape(-1, 3)
        starts, ends = table[:, 1], table[:, 2]
        input_ids = np.concatenate([decode.input_ids, *(r.ids[s:e] for r, s, e in prefill)])
        offsets = None
        if any(req.score_from is not None or e < req.prompt_len for req, _, e in prefill):
            offsets = [req.logits_offsets(s, e) for req, s, e in items]
        return StepRows(
            rows=np.concatenate([decode.rows, table[:, 0]]),
            prefix_lens=np.concatenate([decode.prefix_lens, starts]),
            new_lens=np.concatenate([decode.new_lens, ends - starts]),
            input_ids=input_ids,
            logits_offsets=offsets,
            from_table=decode.from_table,
        )

    def _launch(self, items: StepItems) -> LaunchedStep:
        """Allocates, runs the forward and samples on the device; host state moves on without waiting."""
        running = self._running()  # the first items (see `_schedule`)
        decoding = len(running.reqs)
        step = self._step_rows(items, running)
        self.manager.allocate(step.rows, step.prefix_lens + step.new_lens)
        decode = decoding == len(items)
        timer = None
        if self.profile and decode:
            timer = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timer[0].record()
        logits = self.model_runner.forward(step, graphs=self.cuda_graph)
        # decode items: one sampled token each, at logits rows 0..decoding-1
        scored: list[tuple[Req, np.ndarray, bool]] = []
        score_rows: list[np.ndarray] = []
        joining: list[Req] = []  # requests whose prefill ends this step: their first token
        join_rows: list[int] = []  # their logits rows
        offset = decoding
        for req, start, end in items.prefill:
            wanted = req.logits_offsets(start, end) if step.logits_offsets is not None else None
            count = 1 if wanted is None else len(wanted)
            if req.score_from is not None:
                scored.append((req, req.ids[start + 1 : end + 1][wanted], end == req.prompt_len))
                score_rows.append(np.arange(offset, offset + count))
            elif count:
                joining.append(req)
                join_rows.append(offset)
            offset += count
        sampled: list[Req] = running.reqs
        tokens_host = None
        if sampled or joining:
            params, uids = running.params, running.uids
            subset = decoding + len(joining) != logits.shape[0]
            picks = None
            if joining or subset:
                sampled = [*sampled, *joining]
                params = [*params, *(r.params for r in joining)]
                uids = (*uids, *(r.index for r in joining))
                rows = np.concatenate([running.rows, np.fromiter((r.row for r in joining), np.int64)])
                if subset:
                    picks = np.concatenate([running.order, join_rows]).astype(np.int64)
            else:  # a decode step: the same rows as long as `running` is unchanged
                if running.rows_device is None:
                    running.rows_device = self.model_runner.upload(running.rows)
                rows = running.rows_device
            tokens_host = self.model_runner.sample(self.sampler, logits, rows, params, uids, picks)
        scores = self._scores(logits, score_rows, [t for _, t, _ in scored]) if scored else None
        done = None
        if self._on_cuda:
            done = torch.cuda.Event()
            done.record()
        if timer is not None:
            timer[1].record()
            self._timed.append(timer)
        last = self._advance(items, running)
        scored_counts = [(r, len(t), end) for r, t, end in scored]
        return LaunchedStep(sampled, tokens_host, last, scored_counts, scores, done, decode)

    def _advance(self, items: StepItems, running: RunningRows) -> list[int]:
        """Host state after launching a step: what is computed, which requests prefill, decode or drain.

        Returns the positions among the step's sampled requests (running ones, then those whose prefill
        ends) of the requests that launched their last token.
        """
        decoding = len(running.reqs)
        running.advance()
        done: list[Req] = []
        last: list[int] = []
        if decoding and running.steps_left <= 0:  # some request launched its last token
            self._settle()
            last = [i for i, r in enumerate(running.reqs) if r.launched >= r.launch_limit]
            done = [running.reqs[i] for i in last]
        if items.prefill:
            with self.manager.lazy_free_region():
                last += self._advance_prefill(items.prefill, decoding)
        for req in done:
            self.running.remove(req)
            self.draining.append(req)
        return last

    def _advance_prefill(self, prefill: list[Item], joined: int) -> list[int]:
        """Host state after launching prefill chunks; `joined`: the step's sampled running requests. Returns
        the positions among the step's sampled requests of those whose prefill ends with their last token."""
        last: list[int] = []
        for req, _, end in prefill:
            req.num_computed = end
            if not req.prefilled:
                self.manager.cache_req(req.row, req.ids, end, finished=False)
                continue
            self.prefilling.remove(req)
            self.manager.cache_req(req.row, req.ids, end, finished=False)
            if req.score_from is not None:  # cached now for later steps; released with its scores
                self.draining.append(req)
                continue
            req.launch_limit = min(req.params.max_new_tokens, self.engine.max_context - req.prompt_len)
            req.launched += 1
            if req.launched < req.launch_limit:
                self._settle()
                self.running.append(req)
            else:
                self.draining.append(req)
                last.append(joined)
            joined += 1
        return last

    def _scores(self, logits: torch.Tensor, rows: list[np.ndarray], targets: list[np.ndarray]):
        return self.model_runner.score(logits, np.concatenate(rows), np.concatenate(targets))

    # -- completing a step ---------------------------------------------------------------------------
    def _complete(self, launched: LaunchedStep) -> None:
        """Reads a step's results (waiting only for that step) and finishes the requests that are done."""
        self._waited += self.completer.wait(launched)
        if launched.scores is not None:
            with self.manager.lazy_free_region():
                for req in self.completer.read_scores(launched):
                    self.draining.remove(req)
                    self.completer.release(req, "length", None)
        finished = [] if launched.tokens is None else self.completer.read_tokens(launched)
        if finished:
            self._settle()
            with self.manager.lazy_free_region():
                for req, reason in finished:
                    (self.running if req in self.running else self.draining).remove(req)
                    self.completer.release(req, reason, None)

    def _collect_gpu_times(self) -> None:
        if self._timed:
            self._timed[-1][1].synchronize()
            self.step_times.gpu_s.extend(a.elapsed_time(b) / 1e3 for a, b in self._timed)
            self._timed.clear()

    # -- refusing a request --------------------------------------------------------------------------
    @staticmethod
    def _fail(req: Req, message: str) -> bool:
        req.finish_reason, req.error = "error", message
        logger.debug("request %d failed: %s", req.index, message)
        return False

