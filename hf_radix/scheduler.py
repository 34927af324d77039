"""Continuous batching over the radix engine: cache-aware prefill scheduling, chunked prefill, decode."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from .cuda_graph import DecodeGraphs, ExtendGraphs, shared_extend_graphs
from .engine import RadixEngine, get_engine
from .errors import check_error_mode, raise_or_return
from .forward_batch import build_forward_batch
from .logprobs import target_logprobs
from .radix_tree import RadixPrefixCache
from .request import Req, RequestOutput
from .sampling import Sampler, SamplingParams
from .schedule_policy import PrefixAwareQueue
from .stop_strings import StopStringDetector

logger = logging.get_logger(__name__)

POLICIES = ("lpm", "fcfs")
MIN_SHARED_TO_DEFER = 16  # a prompt waits for a batch-mate computing at least this much of its prefix


@dataclass
class RunnerStats:
    """Counters summed over every `run`/scoring call of one runner."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, copied back from the host tier
    generated_tokens: int = 0
    wall_time: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_cached_tokens(self) -> int:
        """Of cached_tokens, those found on the GPU (the rest came back from the host tier)."""
        return self.cached_tokens - self.host_cached_tokens

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_time if self.wall_time else 0.0

    def __repr__(self) -> str:
        return (
            f"RunnerStats(requests={self.requests}, prompt_tokens={self.prompt_tokens}, "
            f"cached_tokens={self.cached_tokens}, host_cached_tokens={self.host_cached_tokens}, "
            f"hit_rate={self.hit_rate:.3f}, "
            f"generated_tokens={self.generated_tokens}, wall_time={self.wall_time:.2f}s, "
            f"tokens_per_s={self.tokens_per_s:.1f})"
        )


class Scheduler:
    """Drives a list of requests to completion; every exit goes through `_release`."""

    def __init__(
        self,
        engine: RadixEngine,
        eos_token_ids: Sequence[int],
        tokenizer=None,
        max_running_requests: int = 256,
        chunked_prefill_size: int = 8192,
        schedule_policy: str = "lpm",
        cuda_graph: bool = True,
    ):
        if schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {schedule_policy!r}")
        if max_running_requests < 1 or chunked_prefill_size < 1:
            raise ValueError("max_running_requests and chunked_prefill_size must be >= 1")
        self.engine = engine
        self.manager = engine.manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.schedule_policy = schedule_policy
        self.sampler = Sampler(engine.device)
        self.stop_strings = StopStringDetector(tokenizer) if tokenizer is not None else None
        self.decode_graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None  # small prefill rounds of generation requests
        if cuda_graph and engine.captures_graphs:
            self.decode_graphs = DecodeGraphs(engine, max_running_requests)
            self.extend_graphs = shared_extend_graphs(engine)
        self.pending: deque[Req] | PrefixAwareQueue = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []

    # -- entry point ---------------------------------------------------------------------------------
    def run(self, reqs: list[Req], progress: bool) -> None:
        """Runs `reqs` to completion (or error); on any exception releases everything it holds."""
        ready = [r for r in reqs if self._admissible(r)]
        if self.schedule_policy == "lpm":
            manager = self.manager
            self.pending = PrefixAwareQueue(
                ready, manager.cached_len, lambda: manager.evicted_tokens
            )
        else:
            self.pending = deque(ready)
        bar = tqdm(total=len(reqs), disable=not progress, desc="hf_radix", unit="req")
        bar.update(len(reqs) - len(ready))
        self._bar = bar
        try:
            while self.pending or self.prefilling or self.running:
                items = self._schedule_prefill()
                if items:
                    self._forward_prefill(items)
                elif self.running:
                    self._forward_decode()
                else:
                    req = self.pending.popleft()
                    self._fail(req, "the request does not fit in the KV pool next to the cached prefixes")
                    bar.update(1)
        except BaseException:
            for req in [*self.prefilling, *self.running]:
                self._release(req, "abort", None)
            self.pending.clear()
            self.prefilling.clear()
            self.running.clear()
            raise
        finally:
            bar.close()
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            logger.warning("%d of %d requests failed; first: %s", len(failed), len(reqs), failed[0].error)

    # -- admission -----------------------------------------------------------------------------------
    def _admissible(self, req: Req) -> bool:
        """Rejects bad input up front, so it fails alone with a message."""
        ids = req.token_ids
        engine = self.engine
        if not ids:
            return self._fail(req, "empty prompt")
        if min(ids) < 0 or max(ids) >= engine.vocab_size:
            return self._fail(
                req, f"token ids must lie in [0, {engine.vocab_size}), got {min(ids)}..{max(ids)}"
            )
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
        return sum(self.manager.pages_for(len(self.manager.row_slots(r.row)), r.final_len) * ps for r in reqs)

    def _schedule_prefill(self) -> list[tuple[Req, int, int]]:
        """Picks prefill chunks under the token budget, keeping room for what running requests will decode."""
        if not self.pending and not self.prefilling:
            return []
        budget = self.chunked_prefill_size
        reserved = self._reserved_tokens([*self.running, *self.prefilling])
        items: list[tuple[Req, int, int]] = []
        in_batch = RadixPrefixCache(page_size=1)
        for req in self.prefilling:
            if budget <= 0:
                break
            end = min(req.prompt_len, req.num_computed + budget)
            items.append((req, req.num_computed, end))
            budget -= end - req.num_computed
            self._note_in_batch(in_batch, req, end)
        deferred: list[Req] = []
        ps = self.manager.page_size
        while self.pending and budget > 0 and self._active() + len(items) < self.max_running_requests:
            req = self.pending[0]
            handle = self.manager.match(req.match_ids)
            shared = in_batch.match_prefix(req.match_ids[:-1]).cached_len
            if shared - handle.cached_len >= max(MIN_SHARED_TO_DEFER, ps):
                deferred.append(
                    self.pending.popleft()
                )  # a batch-mate computes this prefix; reuse it next round
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
            items.append((req, req.num_computed, end))
            budget -= end - req.num_computed
            reserved += need
            self.prefilling.append(req)
            self._note_in_batch(in_batch, req, end)
        self.pending.extendleft(reversed(deferred))
        return items

    @staticmethod
    def _note_in_batch(tree: RadixPrefixCache, req: Req, end: int) -> None:
        start = tree.size_info.total_size
        tree.insert_prefix(req.token_ids[:end], np.arange(start, start + end, dtype=np.int64))

    def _active(self) -> int:
        return len(self.running) + len(self.prefilling)

    # -- forwards ------------------------------------------------------------------------------------
    def _forward(self, items: list[tuple[Req, int, int]]) -> torch.Tensor:
        """Computes `items` (request, start, end); returns the logits their `logits_offsets` ask for."""
        rows = [req.row for req, _, _ in items]
        self.manager.allocate(rows, [end for _, _, end in items])
        logits = self._graph_forward(items)
        if logits is not None:
            return logits
        batch = build_forward_batch(
            [self.manager.row_slots(r) for r in rows],
            [np.asarray(req.token_ids[start:end]) for req, start, end in items],
            [start for _, start, _ in items],
            [req.logits_offsets(start, end) for req, start, end in items],
            self.engine.device,
        )
        return self.engine.forward(batch)

    def _graph_forward(self, items: list[tuple[Req, int, int]]) -> torch.Tensor | None:
        """A small round of generation requests by extend-graph replay (None: it must run eagerly)."""
        graphs = self.extend_graphs
        new = [end - start for _, start, end in items]
        if (
            graphs is None
            or any(req.score_from is not None for req, _, _ in items)
            or min(new) == 0
            or not graphs.fits(len(items), sum(new), sum(start for _, start, _ in items))
        ):
            return None
        logits = graphs.run(
            [self.manager.row_slots(req.row) for req, _, _ in items],
            [np.asarray(req.token_ids[start:end]) for req, start, end in items],
            [start for _, start, _ in items],
        )
        self.engine.record_forward(sum(new))
        # a copy (the graph's buffer is overwritten by the next replay) of the rows that sample a token
        return logits[[i for i, (req, _, end) in enumerate(items) if end == len(req.token_ids)]]

    def _forward_prefill(self, items: list[tuple[Req, int, int]]) -> None:
        logits = self._forward(items)
        scored, sampled, offset = [], [], 0
        for req, start, end in items:
            offsets = req.logits_offsets(start, end)
            rows = slice(offset, offset + len(offsets))
            offset += len(offsets)
            req.num_computed = end
            if req.score_from is not None:
                scored.append((req, rows, np.asarray(req.token_ids[start + 1 : end + 1])[offsets]))
            elif req.prefilled:
                sampled.append((req, rows.start))
        self._accumulate_scores(logits, scored)
        with self.manager.lazy_free_region():
            for req, _, _ in items:
                if not req.prefilled:
                    self.manager.cache_req(req.row, req.token_ids, req.num_computed, finished=False)
                    continue
                self.prefilling.remove(req)
                if req.score_from is not None:
                    self._release(req, "length", None)
                else:
                    self.manager.cache_req(req.row, req.token_ids, req.num_computed, finished=False)
                    self.running.append(req)
            if sampled:
                self._append_tokens([r for r, _ in sampled], logits[[i for _, i in sampled]])

    def _forward_decode(self) -> None:
        reqs = list(self.running)
        graphs = self.decode_graphs
        if graphs is None or not graphs.fits(len(reqs), sum(r.num_computed + 1 for r in reqs)):
            logits = self._forward([(r, r.num_computed, r.num_computed + 1) for r in reqs])
        else:
            rows = [r.row for r in reqs]
            self.manager.allocate(rows, [r.num_computed + 1 for r in reqs])
            logits = self.decode_graphs.run(
                [self.manager.row_slots(row) for row in rows],
                [r.token_ids[r.num_computed] for r in reqs],
                [r.num_computed for r in reqs],
            )
            self.engine.record_forward(len(reqs))
        for req in reqs:
            req.num_computed += 1
        with self.manager.lazy_free_region():
            self._append_tokens(reqs, logits)

    def _accumulate_scores(self, logits: torch.Tensor, scored: list) -> None:
        if not scored:
            return
        index = torch.cat([torch.arange(s.start, s.stop) for _, s, _ in scored]).to(logits.device)
        targets = torch.from_numpy(np.concatenate([t for _, _, t in scored])).to(logits.device)
        logp, greedy = target_logprobs(logits, index, targets)
        logp_host, greedy_host = logp.double().cpu().numpy(), greedy.cpu().numpy()
        offset = 0
        for req, rows, _ in scored:
            n = rows.stop - rows.start
            req.logprob += float(logp_host[offset : offset + n].sum())
            req.greedy_match &= bool(greedy_host[offset : offset + n].all())
            offset += n

    def _append_tokens(self, reqs: list[Req], logits: torch.Tensor) -> None:
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.index for r in reqs])
        tokens = self.engine.sync_sampled(tokens).tolist()  # tensor parallel: the same on every rank
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self._release(req, reason, None)

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        detector = self.stop_strings
        if params.stop and detector is not None and detector.found(req.index, req.generated, params.stop):
            return "stop"
        if len(req.generated) >= params.max_new_tokens or len(req.token_ids) >= self.engine.max_context:
            return "length"
        return None

    # -- exits ---------------------------------------------------------------------------------------
    def _release(self, req: Req, reason: str, error: str | None) -> None:
        """The single exit of an admitted request: cache what is reusable, free the rest, unlock."""
        if req.row is not None:
            self.manager.release_row(req.row, req.token_ids, req.num_computed)
            req.row = None
        self.sampler.drop(req.index)
        if self.stop_strings is not None:
            self.stop_strings.drop(req.index)
        req.finish_reason, req.error = reason, error
        self._bar.update(1)

    @staticmethod
    def _fail(req: Req, message: str) -> bool:
        req.finish_reason, req.error = "error", message
        logger.debug("request %d failed: %s", req.index, message)
        return False


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class RadixBatchRunner:
    """Offline continuous-batching engine with radix prefix reuse across prompts and across calls.

    >>> runner = RadixBatchRunner(model, tokenizer)
    >>> outs = runner.run(prompts, SamplingParams(max_new_tokens=64))

    Pool options left at None keep the model's engine (shared with `generate`) as configured, or take the
    defaults page_size=1, mem_fraction=0.85, attn_backend="auto"; options that differ rebuild an idle engine.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        page_size: int | None = None,
        max_total_tokens: int | None = None,
        mem_fraction: float | None = None,
        max_running_requests: int = 256,
        chunked_prefill_size: int = 8192,
        schedule_policy: str = "lpm",
        attn_backend: str | None = None,
        cuda_graph: bool = True,
        host_cache_tokens: int | None = None,
        host_cache_gb: float | None = None,
    ):
        options = dict(
            page_size=page_size, max_total_tokens=max_total_tokens, mem_fraction=mem_fraction,
            attn_backend=attn_backend, host_cache_tokens=host_cache_tokens, host_cache_gb=host_cache_gb,
        )
        self.engine = get_engine(model, **{k: v for k, v in options.items() if v is not None})
        self.model = model
        self.tokenizer = tokenizer
        self.stats = RunnerStats()
        self._scheduler_args = (
            _eos_ids(model, tokenizer), tokenizer, max_running_requests, chunked_prefill_size,
            schedule_policy, cuda_graph,
        )
        self._scheduler = Scheduler(self.engine, *self._scheduler_args)

    # -- inputs --------------------------------------------------------------------------------------
    def _tokenize(self, prompts: Iterable) -> list[list[int]]:
        prompts = list(prompts)
        if not prompts:
            return []
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: RadixBatchRunner(model, tokenizer)")
            return [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]
        out = []
        for p in prompts:
            if isinstance(p, str):
                raise ValueError("mix of string and token-id prompts; pass one kind")
            out.append([int(t) for t in (p.tolist() if hasattr(p, "tolist") else p)])
        return out

    def _execute(self, reqs: list[Req], progress: bool | None) -> None:
        if self.engine.closed:  # another runner or configure() gave the model a new pool: use it
            self.engine = get_engine(self.model)
            self._scheduler = Scheduler(self.engine, *self._scheduler_args)
        with self.engine.lock:  # radix calls of other threads on this engine finish first
            self._execute_locked(reqs, progress)

    def _execute_locked(self, reqs: list[Req], progress: bool | None) -> None:
        show = len(reqs) >= 32 if progress is None else progress
        start = time.perf_counter()
        stats = self.engine.stats
        before = stats.prompt_tokens, stats.cached_tokens, stats.host_cached_tokens
        try:
            self._scheduler.run(reqs, show)
        finally:
            self.stats.wall_time += time.perf_counter() - start
            self.stats.requests += len(reqs)
            self.stats.prompt_tokens += self.engine.stats.prompt_tokens - before[0]
            self.stats.cached_tokens += self.engine.stats.cached_tokens - before[1]
            self.stats.host_cached_tokens += self.engine.stats.host_cached_tokens - before[2]
            generated = sum(len(r.generated) for r in reqs if r.score_from is None)
            self.stats.generated_tokens += generated
            self.engine.stats.generated_tokens += generated

    # -- public API ----------------------------------------------------------------------------------
    def run(
        self,
        prompts: Iterable,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
        errors: str = "return",
    ) -> list[RequestOutput]:
        """Generates for every prompt (strings need the tokenizer; or lists of token ids); input order.

        A bad request fails alone: its output has `finish_reason="error"` and the message in `error`;
        `errors="raise"` raises a `RequestError` (carrying every output) after the others completed.
        """
        check_error_mode(errors)
        token_lists = self._tokenize(prompts)
        params = sampling_params or SamplingParams.from_generation_config(self.model.generation_config)
        if isinstance(params, SamplingParams):
            params = [params] * len(token_lists)
        params = list(params)
        if len(params) != len(token_lists):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_lists)} prompts")
        reqs = [Req(i, list(ids), p) for i, (ids, p) in enumerate(zip(token_lists, params))]
        self._execute(reqs, progress)
        outputs = [self._output(r) for r in reqs]
        failures = {i: o.error for i, o in enumerate(outputs) if o.finish_reason == "error"}
        return raise_or_return(outputs, failures, errors, "requests")

    def _output(self, req: Req) -> RequestOutput:
        tokens = req.generated
        text = None
        if self.tokenizer is not None and req.finish_reason != "error":
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in req.params.stop:
                cut = text.find(stop)
                if cut >= 0:
                    text = text[:cut]
        return RequestOutput(
            prompt_token_ids=req.token_ids[: req.prompt_len],
            token_ids=list(tokens),
            text=text,
            cached_tokens=req.cached_tokens,
            host_cached_tokens=req.host_cached_tokens,
            finish_reason=req.finish_reason,
            error=req.error,
        )

    def loglikelihood(
        self, pairs: Iterable, progress: bool | None = None, errors: str = "raise"
    ) -> list[tuple[float, bool] | None]:
        """For each (context, continuation): (sum of continuation log-probs, is it the greedy output).

        Contexts shared between pairs are computed once; logits are computed only at continuation positions.
        A bad pair fails alone: `errors="raise"` raises a `RequestError` (a ValueError carrying every message
        and the other results) after the others completed; `errors="return"` returns None in its place.
        """
        check_error_mode(errors)
        pairs = list(pairs)
        contexts = self._tokenize([c for c, _ in pairs])
        continuations = self._tokenize_continuations(pairs)
        reqs = []
        score = SamplingParams(max_new_tokens=0)
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            req = Req(i, ctx + cont, score, score_from=len(ctx) - 1)
            if not ctx or not cont:
                Scheduler._fail(req, "context and continuation must both be non-empty")
            reqs.append(req)
        self._execute([r for r in reqs if r.finish_reason is None], progress)
        results = [None if r.finish_reason == "error" else (r.logprob, r.greedy_match) for r in reqs]
        failures = {r.index: r.error for r in reqs if r.finish_reason == "error"}
        return raise_or_return(results, failures, errors, "scoring requests")

    def loglikelihood_rolling(self, texts: Iterable, progress: bool | None = None) -> list[float]:
        """Total log-likelihood of each whole text (perplexity scoring), windowed to the model's context."""
        from .evaluation import loglikelihood_rolling

        return loglikelihood_rolling(self, texts, progress)

    def _tokenize_continuations(self, pairs: list) -> list[list[int]]:
        conts = [c for _, c in pairs]
        if conts and all(isinstance(c, str) for c in conts):
            if self.tokenizer is None:
                raise ValueError("string continuations need a tokenizer")
            return [list(ids) for ids in self.tokenizer(conts, add_special_tokens=False)["input_ids"]]
        return self._tokenize(conts)

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every page is free, in the tree, or held by a running request."""
        self.engine.check_integrity()

    def reset_cache(self) -> None:
        """Drops every cached prefix."""
        self.engine.reset_cache()

    def save_cache(self, path) -> dict:
        """Writes the prefix cache (tree + K/V of its pages) to a safetensors file; refused while running.

        Returns {"tokens", "bytes", "seconds", "gb_per_s"}.
        """
        from .cache_io import save_cache

        return save_cache(self.engine, path)

    def load_cache(self, path) -> dict:
        """Adds the prefixes of a file written by `save_cache` (same model, dtype and page size), most
        recently used first while free pages last; a mismatched or damaged file raises CacheFileError
        and changes nothing."""
        from .cache_io import load_cache

        return load_cache(self.engine, path)
