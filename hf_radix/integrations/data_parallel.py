"""Data parallel with cache-aware routing: one `RadixBatchRunner` replica per torch.distributed process.

Launch one process per GPU (`torchrun --nproc-per-node N script.py`), load the model on each process's own
device, and call the same `run` / `loglikelihood` with the same inputs on every rank:

>>> dist.init_process_group("nccl")  # "gloo" on CPU
>>> runner = DataParallelRunner(model, tokenizer)
>>> outs = runner.run(prompts, SamplingParams(max_new_tokens=64))  # every rank gets all outputs

Every rank computes the same routing (`CacheAwareRouter`) from the same prompts, runs its share on its own
replica, and the outputs are all-gathered, in input order, on every rank. Results travel as JSON bytes in
tensor collectives (no pickling). A request that fails, fails alone, as on one replica; an exception on
one replica (out of memory, say) is raised on every rank after the gather, so no rank is left waiting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers.utils import logging

from ..engine import get_engine
from ..errors import RequestError, check_error_mode, raise_or_return
from ..runner import RadixBatchRunner
from ..scheduling.inputs import pair_items, params_per_prompt, tokenize
from ..scheduling.request import RequestOutput
from ..scheduling.sampling import SamplingParams
from ..stats import RadixStats
from .distributed import all_gather_json
from .routing import CacheAwareRouter

logger = logging.get_logger(__name__)

_COUNTERS = (
    "requests", "prompt_tokens", "cached_tokens", "host_cached_tokens", "computed_tokens", "generated_tokens",
    "forward_calls",
)


def _fingerprint(token_lists: Sequence[Sequence[int]], extra: Sequence[int]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for ids in token_lists:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    digest.update(np.asarray(extra, dtype=np.int64).tobytes())
    return digest.hexdigest()


class DataParallelRunner:
    """`RadixBatchRunner` over the replicas of a torch.distributed group, with cache-aware routing.

    `model` is this rank's replica (on this rank's device); `runner_options` go to its RadixBatchRunner.
    The routing thresholds are those of `CacheAwareRouter`. `stats` sums the replicas' counters;
    `replica_stats` holds each replica's runner and engine statistics (refreshed by every call).
    Collective: construct it, and call `run` / `loglikelihood` with the same arguments, on every rank.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        group=None,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 2048,
        balance_rel_threshold: float = 1.1,
        **runner_options,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallelRunner needs torch.distributed initialized (e.g. under torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.dp_size = dist.get_world_size(group)
        self.local = RadixBatchRunner(model, tokenizer, **runner_options)
        device = self.local.engine.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            raise RuntimeError(
                f"this rank's model is on {device} but the current CUDA device is "
                f"{torch.cuda.current_device()}: call torch.cuda.set_device(local_rank) first"
            )
        self.model = model
        self.tokenizer = tokenizer
        manager = self.local.engine.manager
        capacities = all_gather_json(manager.num_pages * manager.page_size, group, device)
        self.router = CacheAwareRouter(
            self.dp_size, capacities, cache_threshold, balance_abs_threshold, balance_rel_threshold
        )
        self.stats = RadixStats()
        self.replica_stats: list[dict] = []
        self.last_routes: list[int] = []  # the replica of each input of the last call
        self._model_state: tuple = ()  # this replica's (invalidations, adapter set) at the last routing

    @property
    def engine(self):
        """This rank's engine (its pool, tree and options)."""
        return self.local.engine

    # -- public API ----------------------------------------------------------------------------------
    def run(
        self,
        prompts: Iterable,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
        errors: str = "return",
    ) -> list[RequestOutput]:
        """`RadixBatchRunner.run` over the replicas: every rank returns all outputs, in input order.

        The error policy is `RadixBatchRunner.run`'s: a bad request fails alone in its output, and
        `errors="raise"` raises a `RequestError` carrying every output (on every rank).
        """
        check_error_mode(errors)
        token_lists = tokenize(self.local.tokenizer, prompts)
        no_room: dict[int, str] = {}
        params = params_per_prompt(
            self.local.model, sampling_params, [len(t) for t in token_lists], no_room
        )
        if no_room:  # every rank decides the same: the call is refused as a whole
            raise ValueError(f"DataParallelRunner: {len(no_room)} prompts leave no room to generate; first: "
                             f"{next(iter(no_room.values()))}")
        if not token_lists:
            return []
        mine = self._route(token_lists, [p.max_new_tokens for p in params])

        def work() -> list:
            chosen = [token_lists[i] for i in mine]
            outs = self.local.run(chosen, [params[i] for i in mine], self._bar(progress))
            # every rank has the prompts: only what the replica made travels
            return [{k: v for k, v in dataclasses.asdict(o).items() if k != "prompt_token_ids"} for o in outs]

        results = self._gather(mine, work)
        outputs = [RequestOutput(prompt_token_ids=ids, **r) for ids, r in zip(token_lists, results)]
        failures = {i: o.error for i, o in enumerate(outputs) if o.finish_reason == "error"}
        return raise_or_return(outputs, failures, errors, "requests")

    def loglikelihood(
        self, pairs: Iterable, progress: bool | None = None, errors: str = "raise"
    ) -> list[tuple[float, bool] | None]:
        """`RadixBatchRunner.loglikelihood` over the replicas; pairs sharing a context go to one replica.

        The error policy is `RadixBatchRunner.loglikelihood`'s, over all pairs of every replica: a bad pair
        fails alone; `errors="raise"` raises one `RequestError` (every rank), `"return"` gives None there.
        """
        check_error_mode(errors)
        pairs = pair_items(pairs)
        contexts = tokenize(self.local.tokenizer, [c for c, _ in pairs], "contexts")
        continuations = tokenize(self.local.tokenizer, [x for _, x in pairs], "continuations")
        if not pairs:
            return []
        mine = self._route([c + x for c, x in zip(contexts, continuations)], [0] * len(pairs))

        def work() -> list:
            try:
                scores = self.local.loglikelihood(
                    [(contexts[i], continuations[i]) for i in mine], self._bar(progress)
                )
                failed = {}
            except RequestError as exc:  # the others completed: gathered with the failures' messages
                scores, failed = exc.results, exc.errors
            return [[None, failed[j]] if s is None else [list(s), None] for j, s in enumerate(scores)]

        gathered = self._gather(mine, work)
        results = [None if score is None else (float(score[0]), bool(score[1])) for score, _ in gathered]
        failures = {i: message for i, (_, message) in enumerate(gathered) if message is not None}
        return raise_or_return(results, failures, errors, "scoring requests")

    def loglikelihood_rolling(self, texts: Iterable, progress: bool | None = None) -> list[float]:
        """Total log-likelihood of each whole text (perplexity scoring), windows spread over the replicas."""
        from .evaluation import loglikelihood_rolling

        return loglikelihood_rolling(self, texts, progress)

    def check_integrity(self) -> None:
        """This rank's replica: raises IntegrityError unless its pages are all accounted for."""
        self.local.check_integrity()

    def reset_cache(self) -> None:
        """Drops every cached prefix of this rank's replica and the router's record of them (collective)."""
        self.local.reset_cache()
        self.router.reset()

    def _bar(self, progress: bool | None) -> bool | None:
        """Progress shows on rank 0 only."""
        return progress if self.rank == 0 else False

    # -- routing and gathering -----------------------------------------------------------------------
    def _route(self, token_lists: list[list[int]], new_tokens: list[int]) -> list[int]:
        """Indices of the prompts this rank runs; checks first that every rank was given the same inputs."""
        engine = get_engine(self.local.model)
        with engine.lock:  # the router's record follows the replicas' caches: dropped or switched together
            engine.sync_model_state()
        state = (engine.stats.invalidations, engine.state.namespace_label())
        gathered = all_gather_json([_fingerprint(token_lists, new_tokens), state != self._model_state],
                                   self.group, engine.device)
        self._model_state = state
        if any(changed for _, changed in gathered):
            self.router.reset()
        if len({print_ for print_, _ in gathered}) != 1:
            raise ValueError(
                "DataParallelRunner: the ranks were given different inputs; call it with the same prompts "
                "and parameters on every rank"
            )
        replicas = self.router.route(token_lists, new_tokens)
        self.last_routes = replicas
        logger.info("routed %d prompts: %s per replica", len(replicas),
                    [replicas.count(r) for r in range(self.dp_size)])
        return [i for i, r in enumerate(replicas) if r == self.rank]

    def _gather(self, mine: list[int], work) -> list:
        """Runs `work` (this rank's results for `mine`), gathers every rank's, returns them in input order."""
        start = time.perf_counter()
        payload: dict = {"indices": mine, "results": [], "error": None}
        try:
            payload["results"] = work()
        except Exception as exc:  # re-raised on every rank below, so no rank waits on a collective forever
            payload["error"] = [type(exc).__name__, str(exc)]
        payload["stats"] = self._local_stats()
        gathered = all_gather_json(payload, self.group, self.engine.device)
        self.replica_stats = [p["stats"] for p in gathered]
        self._sum_stats(time.perf_counter() - start)
        failed = [(rank, p["error"]) for rank, p in enumerate(gathered) if p["error"]]
        if failed:
            rank, (kind, message) = failed[0]
            error = ValueError if kind == "ValueError" else RuntimeError
            raise error(f"replica {rank} ({kind}): {message}")
        total = sum(len(p["indices"]) for p in gathered)
        ordered: list = [None] * total
        for p in gathered:
            for index, result in zip(p["indices"], p["results"]):
                ordered[index] = result
        return ordered

    def _local_stats(self) -> dict:
        stats = self.local.stats
        counters = {name: getattr(stats, name) for name in _COUNTERS}
        return {
            "rank": self.rank,
            **counters,
            "hit_rate": stats.hit_rate,
            "wall_time": stats.wall_time,
            "engine": self.local.engine.stats_dict(),
        }

    def _sum_stats(self, wall_time: float) -> None:
        for name in _COUNTERS:
            setattr(self.stats, name, sum(s[name] for s in self.replica_stats))
        self.stats.wall_time += wall_time
