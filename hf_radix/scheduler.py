"""Continuous batching over the radix engine: cache-aware admission, chunked prefill, mixed rounds, overlap.

Every step is one forward holding every running request's decode token plus prefill chunks under the
token budget (mixed rounds: a request finishing never stalls the others). With overlap on, the host
schedules and launches step n+1 before it reads step n's sampled tokens: finish checks run one step late,
and a request that stopped is computed once more and its extra token dropped. Outputs are the same with
overlap on and off (greedy and seeded sampling). Requests live in `RequestQueues` by status; admission
and prefill planning are `scheduling.admission`'s, reading results and releasing `StepCompleter`'s.

Hybrid models (state layers) need every row of a forward to add the same number of tokens
(docs/hybrid.md): their steps are either prefill chunks of one length or every running request's
decode token, never mixed; a prefill chunk that ends at a snapshot point saves the row's state on the tree.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from .engine import RadixEngine
from .forward.model_runner import ModelRunner
from .paged_attention.forward_batch import StepRows
from .scheduling.admission import PrefillPlanner, screen, snapshot_points
from .scheduling.request import Req, RequestStatus
from .scheduling.request_queues import RequestQueues
from .scheduling.running_rows import Item, RunningRows, StepItems
from .scheduling.sampling import Sampler
from .scheduling.schedule_policy import PrefixAwareQueue
from .scheduling.step_completion import LaunchedStep, StepCompleter, snapshot_at
from .scheduling.stop_strings import StopStringDetector

logger = logging.get_logger(__name__)

POLICIES = ("lpm", "fcfs")
DECODING, DRAINING = RequestStatus.DECODING, RequestStatus.DRAINING


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
        tokenizer,
        *,
        max_running_requests: int,
        chunked_prefill_size: int,
        schedule_policy: str,
        overlap: bool,
        profile: bool,
        cuda_graph: bool,
    ):
        """The options are `RadixBatchRunner`'s (their defaults and meaning are documented there)."""
        if schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {schedule_policy!r}")
        if max_running_requests < 1 or chunked_prefill_size < 1:
            raise ValueError("max_running_requests and chunked_prefill_size must be >= 1")
        self.engine = engine
        self.manager = engine.manager
        self.model_runner = model_runner
        self.tokenizer = tokenizer
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
        self.queues = RequestQueues()
        self.planner = PrefillPlanner(engine, self.queues, chunked_prefill_size, max_running_requests)
        self.hybrid = engine.hybrid  # prefill and decode steps apart
        self._step_running: RunningRows | None = None  # the decode rows of the step being scheduled
        self.step_times = StepTimes()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._waited = 0.0  # seconds of this loop iteration spent waiting for the GPU
        self._in_flight: LaunchedStep | None = None  # launched, not yet completed (overlap)

    # -- the loop: schedule -> run -> complete -------------------------------------------------------
    def run(self, reqs: list[Req], progress: bool) -> None:
        """Runs `reqs` to completion (or error); on any exception releases everything it holds."""
        ready = [r for r in reqs if screen(r, self.engine)]
        manager = self.manager
        queue = deque(ready) if self.schedule_policy == "fcfs" else PrefixAwareQueue(
            ready, manager.gpu_cached_len, lambda: manager.evicted_tokens
        )
        self.queues.waiting = queue
        if self.hybrid:
            self.planner.snapshot_points = snapshot_points(
                ready, manager.page_size, self.engine.options.state_snapshot_interval
            )
        bar = tqdm(total=len(reqs), disable=not progress, desc="hf_radix", unit="req")
        bar.update(len(reqs) - len(ready))
        self.completer.start(ready, bar)
        try:
            while self.queues:
                self._step()
        except BaseException:
            self._in_flight = None
            for req in self.queues.clear():
                self.completer.release(req, "abort")
            raise
        finally:
            bar.close()
            self._collect_gpu_times()
            self.completer.end()
        failed = [r for r in reqs if r.status is RequestStatus.FAILED]
        if failed:
            logger.warning("%d of %d requests failed; first: %s", len(failed), len(reqs), failed[0].error)

    def _step(self) -> None:
        """One iteration: schedule and launch a step, then complete the step before it (overlap) or it."""
        started, self._waited = time.perf_counter(), 0.0
        items = self._schedule()
        launched = self._launch(items) if items else None
        launch_s = time.perf_counter() - started
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._complete(previous)
        if launched is not None and self.overlap:
            self._in_flight = launched
        elif launched is not None:
            self._complete(launched)
        elif previous is None:  # nothing runs, nothing will free pages: the head cannot fit
            message = "the request does not fit in the KV pool next to the cached prefixes"
            self.completer.refuse(self.queues.waiting.popleft(), message)
        if launched is not None and launched.decode:
            self.step_times.launch_s.append(launch_s)
            self.step_times.host_s.append(time.perf_counter() - started - self._waited)

    def _schedule(self) -> StepItems:
        """One step: every running request's next token, then prefill chunks under the token budget."""
        running = self._running()
        if self.hybrid:  # a step of prefill chunks of one length, else a decode step
            prefill = RunningRows([])
            items = prefill.items()
            self.planner.plan(items, uniform=True)
            if items.prefill or not running.reqs:
                self._step_running = prefill
                return items
            self._step_running = running
            return running.items()
        items = running.items()
        self.planner.plan(items)
        self._step_running = running
        return items

    def _running(self) -> RunningRows:
        """The running requests as arrays (see `RequestQueues.running_rows`)."""
        return self.queues.running_rows()

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
        running = self._step_running  # the first items (see `_schedule`)
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
        if self.hybrid and decoding and self.manager.page_size > 1:
            self._hold_page_ends(running)
        last: list[int] = []
        if decoding and running.steps_left <= 0:  # some request launched its last token
            self.queues.settle()
            last = [i for i, r in enumerate(running.reqs) if r.launched >= r.launch_limit]
        done = [running.reqs[i] for i in last]
        if items.prefill:
            with self.manager.lazy_free_region():
                last += self._advance_prefill(items.prefill, decoding)
        for req in done:
            self.queues.move(req, DRAINING)
        return last

    def _advance_prefill(self, prefill: list[Item], joined: int) -> list[int]:
        """Host state after launching prefill chunks; `joined`: the step's sampled running requests. Returns
        the positions among the step's sampled requests of those whose prefill ends with their last token."""
        last: list[int] = []
        for req, _, end in prefill:
            req.computed_len = end
            self.manager.cache_req(req.row, req.ids, end, finished=False)
            if end in self.planner.snapshot_points.get(req.index, ()):
                snapshot_at(self.manager, req.row, end)
            if req.extend_len:
                continue
            if req.score_from is not None:  # cached now for later steps; released with its scores
                self.queues.move(req, DRAINING)
                continue
            req.launch_limit = min(req.params.max_new_tokens, self.engine.max_context - req.prompt_len)
            req.launched += 1
            if req.launched < req.launch_limit:
                self.queues.move(req, DECODING)
            else:
                self.queues.move(req, DRAINING)
                last.append(joined)
            joined += 1
        return last

    def _hold_page_ends(self, running: RunningRows) -> None:
        """A hybrid model's decode step that brought rows to a page multiple: each such row keeps a copy of
        its state there (one held slot per row, overwritten at the next boundary), which its release
        attaches as the snapshot at the end of its answer (`CacheManager.hold_snapshot`)."""
        manager = self.manager
        ends = running.starts  # positions computed once this step runs
        for i in np.flatnonzero(ends % manager.page_size == 0).tolist():
            if not manager.state_slots.available:
                return
            manager.hold_snapshot(running.reqs[i].row, int(ends[i]))

    def _scores(self, logits: torch.Tensor, rows: list[np.ndarray], targets: list[np.ndarray]):
        return self.model_runner.score(logits, np.concatenate(rows), np.concatenate(targets))

    # -- completing a step ---------------------------------------------------------------------------
    def _complete(self, launched: LaunchedStep) -> None:
        """Reads a step's results (waiting only for that step) and finishes the requests that are done."""
        self._waited += self.completer.wait(launched)
        if launched.scores is not None:
            with self.manager.lazy_free_region():
                for req in self.completer.read_scores(launched):
                    self.queues.leave(req)
                    self.completer.release(req, "length")
        finished = [] if launched.tokens is None else self.completer.read_tokens(launched)
        if finished:
            with self.manager.lazy_free_region():
                for req, reason in finished:
                    self.queues.leave(req)
                    self.completer.release(req, reason)

    def _collect_gpu_times(self) -> None:
        if self._timed:
            self._timed[-1][1].synchronize()
            self.step_times.gpu_s.extend(a.elapsed_time(b) / 1e3 for a, b in self._timed)
            self._timed.clear()
