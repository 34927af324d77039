"""RadixBatchRunner: the public offline engine: prompts in, outputs in input order, scoring, statistics."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence

import numpy as np

from .engine import RadixEngine, get_engine
from .errors import check_error_mode, raise_or_return
from .integrations.evaluation import loglikelihood_rolling
from .memory.cache_io import load_cache, save_cache
from .options import EngineOptions
from .scheduler import Scheduler
from .scheduling.inputs import pair_items, params_per_prompt, prompt_items, token_arrays, token_id_list
from .scheduling.request import Req, RequestOutput, RequestStatus
from .scheduling.sampling import SamplingParams
from .stats import RadixStats


class RadixBatchRunner:
    """Offline continuous-batching engine with radix prefix reuse across prompts and across calls.

    >>> runner = RadixBatchRunner(model, tokenizer)
    >>> outs = runner.run(prompts, SamplingParams(max_new_tokens=64))

    `engine_options` are the model's engine options (`EngineOptions`, listed in docs/options.md): left out
    or None, they keep the engine (shared with `generate`) as configured, or take their defaults; options
    that differ rebuild an idle engine. `cuda_graph` and `warm_up` apply to this runner only: False runs its
    steps eagerly (on the engine's model-runner core, without its graphs), or captures its graphs and
    compiles its kernels on first use instead of here. The scheduler's own options:
    `max_running_requests`, `chunked_prefill_size`, `schedule_policy`; `overlap` schedules step n+1 while
    the GPU runs step n; `profile` records GPU time per decode step (`step_times`).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_running_requests: int = 256,
        chunked_prefill_size: int = 8192,
        schedule_policy: str = "lpm",
        overlap: bool = True,
        profile: bool = False,
        cuda_graph: bool = True,
        warm_up: bool = True,
        **engine_options,
    ):
        own = [name for name in inspect.signature(RadixBatchRunner).parameters][1:-1]  # but model, **options
        EngineOptions.check_names(engine_options, "RadixBatchRunner", own)  # unknown names: a TypeError
        self.model = model
        self.tokenizer = tokenizer
        self.stats = RadixStats()
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self._eos = token_id_list(eos)
        self._cuda_graph, self._warm_up = cuda_graph, warm_up
        self._scheduler_options = dict(
            max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
            schedule_policy=schedule_policy, overlap=overlap, profile=profile,
        )
        self._bind(get_engine(model, **{k: v for k, v in engine_options.items() if v is not None}))

    def _bind(self, engine: RadixEngine) -> None:
        """Uses `engine`: its model-runner core (graphs sized for this runner unless it runs without), a
        scheduler, the warm-up."""
        self.engine = engine
        engine.manager.reserve_rows(self._scheduler_options["max_running_requests"])  # not in a first run
        self.model_runner = engine.model_runner
        if self._cuda_graph:
            self.model_runner.ensure_graph_batch(self._scheduler_options["max_running_requests"])
        self.scheduler = Scheduler(
            engine, self.model_runner, self._eos, self.tokenizer, cuda_graph=self._cuda_graph,
            **self._scheduler_options,
        )
        warm = self._warm_up and self._cuda_graph and self.model_runner.has_graphs
        self.warm_up_times = self.model_runner.warm_up() if warm else {}

    @property
    def step_times(self):
        """Host (and, when profiled, GPU) seconds of each decode step so far."""
        return self.scheduler.step_times

    def _execute(self, reqs: list[Req], progress: bool | None) -> None:
        engine = get_engine(self.model)  # a new one after configure(), or for a new dtype, device or config
        with engine.lock:  # radix calls of other threads on this engine finish first
            engine.sync_model_state()  # K/V of other weights dropped; the adapter set's namespace
            rebuilt = engine.model_runner is not self.model_runner
            if engine is not self.engine or rebuilt:
                self._bind(engine)  # new pool, backends, or tensors: the engine rebuilt its runner core
            self._execute_locked(reqs, progress)

    def _execute_locked(self, reqs: list[Req], progress: bool | None) -> None:
        show = len(reqs) >= 32 if progress is None else progress
        start = time.perf_counter()
        engine_stats = self.engine.stats
        before = (engine_stats.prompt_tokens, engine_stats.cached_tokens, engine_stats.computed_tokens,
                  engine_stats.forward_calls, engine_stats.host_cached_tokens)
        try:
            self.scheduler.run(reqs, show)
        finally:
            elapsed = time.perf_counter() - start
            self.stats.wall_time += elapsed
            self.engine.stats.wall_time += elapsed
            self.stats.requests += len(reqs)
            self.stats.prompt_tokens += self.engine.stats.prompt_tokens - before[0]
            self.stats.cached_tokens += self.engine.stats.cached_tokens - before[1]
            generated = sum(r.num_generated for r in reqs if r.score_from is None)
            self.stats.generated_tokens += generated
            self.engine.stats.generated_tokens += generated
            self.stats.computed_tokens += self.engine.stats.computed_tokens - before[2]
            self.stats.forward_calls += self.engine.stats.forward_calls - before[3]
            self.stats.host_cached_tokens += self.engine.stats.host_cached_tokens - before[4]

    # -- public API ----------------------------------------------------------------------------------
    def run(
        self,
        prompts: Iterable,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
        errors: str = "return",
    ) -> list[RequestOutput]:
        """Generates for every prompt (strings need the tokenizer; or lists of token ids); input order.

        Without `sampling_params`, the settings of `model.generation_config` apply as `generate` applies
        them, its length included (`max_new_tokens`, else `max_length` minus the prompt, else 20 new
        tokens). A bad request fails alone: its output has `finish_reason="error"` and the message in
        `error`; `errors="raise"` raises a `RequestError` (carrying every output) after the others completed.
        """
        check_error_mode(errors)
        arrays, invalid = token_arrays(self.tokenizer, prompt_items(prompts, "run"))
        params = params_per_prompt(self.model, sampling_params, [len(ids) for ids in arrays], invalid)
        reqs = [Req(i, ids, p) for i, (ids, p) in enumerate(zip(arrays, params))]
        for i, message in invalid.items():
            reqs[i].fail(message)
        self._execute(reqs, progress)
        outputs = [self._output(r) for r in reqs]
        failures = {i: o.error for i, o in enumerate(outputs) if o.finish_reason == "error"}
        return raise_or_return(outputs, failures, errors, "requests")

    def _output(self, req: Req) -> RequestOutput:
        tokens = req.generated
        text = None
        if self.tokenizer is not None and req.status is not RequestStatus.FAILED:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            for stop in req.params.stop:
                cut = text.find(stop)
                if cut >= 0:
                    text = text[:cut]
        return RequestOutput(
            prompt_token_ids=req.ids[: req.prompt_len].tolist(),
            token_ids=tokens,
            text=text,
            cached_tokens=req.cached_len,
            host_cached_tokens=req.host_cached_len,
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
        pairs = pair_items(pairs)
        tokenizer = self.tokenizer
        contexts, bad_contexts = token_arrays(tokenizer, [c for c, _ in pairs], "contexts")
        continuations, bad_continuations = token_arrays(tokenizer, [x for _, x in pairs], "continuations")
        invalid = {i: f"continuation: {message}" for i, message in bad_continuations.items()}
        invalid.update((i, f"context: {message}") for i, message in bad_contexts.items())
        reqs = []
        score = SamplingParams(max_new_tokens=0)
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            req = Req(i, np.concatenate((ctx, cont)), score, score_from=len(ctx) - 1)
            if i in invalid:
                req.fail(invalid[i])
            elif not len(ctx) or not len(cont):
                req.fail("context and continuation must both be non-empty")
            reqs.append(req)
        self._execute(reqs, progress)
        failed = RequestStatus.FAILED
        results = [None if r.status is failed else (r.logprob, r.greedy_match) for r in reqs]
        failures = {r.index: r.error for r in reqs if r.status is failed}
        return raise_or_return(results, failures, errors, "scoring requests")

    def loglikelihood_rolling(self, texts: Iterable, progress: bool | None = None) -> list[float]:
        """Total log-likelihood of each whole text (perplexity scoring), windowed to the model's context."""
        return loglikelihood_rolling(self, texts, progress)

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every page is free, in the tree, or held by a running request, and
        every request of a run is in the scheduler's collection of its status, its lengths in order."""
        self.engine.check_integrity()
        self.scheduler.queues.check()

    def reset_cache(self) -> None:
        """Drops every cached prefix."""
        self.engine.reset_cache()

    def save_cache(self, path) -> dict:
        """Writes the prefix cache of the active adapter set (tree + K/V of its pages) to a safetensors
        file; refused while running.

        Returns {"tokens", "bytes", "seconds", "gb_per_s"}.
        """
        return save_cache(get_engine(self.model), path)

    def load_cache(self, path) -> dict:
        """Adds the prefixes of a file written by `save_cache` (same model, dtype and page size), most
        recently used first while free pages last; a mismatched or damaged file raises CacheFileError
        and changes nothing."""
        return load_cache(get_engine(self.model), path)
