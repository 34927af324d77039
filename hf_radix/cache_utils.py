"""RadixCache: the `transformers.Cache` that routes each layer's K/V into the paged pool."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import Cache

from .forward_batch import ForwardBatch, build_forward_batch

if TYPE_CHECKING:
    from .engine import RadixEngine


class RadixCache(Cache):
    """K/V router for one packed forward: `update` stores the new K/V at the batch's slots.

    It keeps no dense copy of K/V: the "radix" attention reads each request's pages from the
    engine's pool through the batch metadata (`self.batch`).
    """

    is_compileable = False

    def __init__(self, engine: RadixEngine, batch: ForwardBatch | None = None):
        super().__init__(layers=[])
        self.engine = engine
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores this layer's new K/V (`[1, kv_heads, T, head_dim]`) into the pool; returns them unchanged."""
        if self.batch is None:
            raise RuntimeError("RadixCache.update called outside an hf_radix forward")
        k = key_states[0].transpose(0, 1)
        v = value_states[0].transpose(0, 1)
        self.engine.pool.store_kv(k, v, self.batch.out_loc, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.batch is None else int(self.batch.max_kv_len - self.batch.max_new_len)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class RadixGenerateCache(RadixCache):
    """The cache `generate(..., cache_implementation="radix")` runs with: one per call.

    A forward pre-hook turns each padded `(B, S)` step of generate into a packed batch of only the
    tokens not yet in the pool (each row reuses its own cached prefix; padding never enters the pool);
    a forward hook turns the packed logits back into `(B, 1, vocab)`. Rows with identical prompts are
    computed once. `finish` inserts prompts and answers into the tree and releases every lock.
    """

    def __init__(self, engine: RadixEngine, eos_token_ids: Sequence[int] = ()):
        super().__init__(engine)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.rows: list[int] = []  # page-table row of each batch row
        self.tokens: list[list[int]] = []  # real (unpadded) tokens of each batch row
        self.computed: list[int] = []  # tokens of each row with K/V in the pool
        self.prompt_lens: list[int] = []
        self.seen = 0  # padded length generate has handed us so far
        self.steps = 0
        self._logits_rows: torch.Tensor | None = None
        self._pending_copies: list[tuple[int, int]] = []  # (follower row, leader row) of the first step

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    # -- hooks ---------------------------------------------------------------------------------------
    def pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args or kwargs.get("input_ids") is None:
            raise ValueError("generate with cache_implementation='radix' needs input_ids (inputs_embeds unsupported)")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ValueError("cache_implementation='radix' cannot return attentions or hidden states")
        input_ids: torch.Tensor = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        total = mask.shape[1] if mask is not None else self.seen + input_ids.shape[1]
        fresh = total - self.seen
        if fresh > input_ids.shape[1]:
            raise RuntimeError(f"generate skipped {fresh - input_ids.shape[1]} tokens the radix cache never saw")
        new_ids = input_ids[:, input_ids.shape[1] - fresh:].tolist()
        if not self.rows:
            self._open_rows(new_ids, None if mask is None else mask.tolist())
        else:
            for row, ids in enumerate(new_ids):
                self.tokens[row].extend(ids)
        self.seen = total
        self.batch = self._build_batch()
        kwargs = {
            **kwargs,
            "input_ids": self.batch.input_ids[None],
            "position_ids": self.batch.positions[None],
            "attention_mask": None,
            "logits_to_keep": self.batch.logits_indices,
            "radix_cache": self,
        }
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output):
        logits = output.logits[0][self._logits_rows][:, None, :]
        self.engine.stats.computed_tokens += self.batch.num_tokens
        self.engine.stats.forward_calls += 1
        for row in range(len(self.rows)):
            self.computed[row] = len(self.tokens[row])
        if self.steps == 0:
            self._share_duplicates()
        self.steps += 1
        self.batch = None
        output.logits = logits
        return output

    # -- per-call bookkeeping --------------------------------------------------------------------------
    def _open_rows(self, ids: list[list[int]], mask: list[list[int]] | None) -> None:
        manager = self.engine.manager
        leaders: dict[tuple[int, ...], int] = {}
        for b, row_ids in enumerate(ids):
            tokens = row_ids if mask is None else [t for t, m in zip(row_ids, mask[b]) if m]
            if mask is not None and 0 in mask[b][len(row_ids) - len(tokens):]:
                raise ValueError("cache_implementation='radix' needs left padding (padding_side='left')")
            if not tokens:
                raise ValueError(f"row {b} of the batch is empty (all padding)")
            self.tokens.append(list(tokens))
            self.prompt_lens.append(len(tokens))
            leader = leaders.setdefault(tuple(tokens), b)
            handle = manager.match(tokens)
            manager.lock(handle)
            self.rows.append(manager.open_row(handle))
            self.computed.append(handle.cached_len)
            self.engine.record_prompt(len(tokens), handle.cached_len)
            if leader != b:
                self._pending_copies.append((b, leader))

    def _build_batch(self) -> ForwardBatch:
        followers = {b for b, _ in self._pending_copies}
        compute = [b for b in range(len(self.rows)) if b not in followers]
        manager = self.engine.manager
        manager.allocate([self.rows[b] for b in compute], [len(self.tokens[b]) for b in compute])
        batch = build_forward_batch(
            [manager.row_slots(self.rows[b]) for b in compute],
            [np.asarray(self.tokens[b][self.computed[b]:]) for b in compute],
            [self.computed[b] for b in compute],
            None,
            self.engine.device,
        )
        position = {b: i for i, b in enumerate(compute)}
        leader_of = dict(self._pending_copies)
        gather = [position[leader_of.get(b, b)] for b in range(len(self.rows))]
        self._logits_rows = torch.tensor(gather, device=self.engine.device)
        return batch

    def _share_duplicates(self) -> None:
        """Inserts first-step prompts into the tree; duplicate rows then reuse the leader's K/V."""
        manager = self.engine.manager
        followers = {b for b, _ in self._pending_copies}
        for b, row in enumerate(self.rows):
            if b not in followers:
                manager.cache_req(row, self.tokens[b], self.computed[b], finished=False)
        for b, leader in self._pending_copies:
            # Re-open the follower on the prefix its leader just cached, then copy the unaligned tail.
            tokens = self.tokens[b]
            manager.release_row(self.rows[b], tokens, manager.row_cached_len(self.rows[b]))
            handle = manager.match(tokens + [0])
            manager.lock(handle)
            self.rows[b] = manager.open_row(handle)
            manager.allocate([self.rows[b]], [len(tokens)])
            src = manager.row_slots(self.rows[leader])[handle.cached_len:len(tokens)]
            dst = manager.row_slots(self.rows[b])[handle.cached_len:len(tokens)]
            self.engine.pool.copy_slots(src, dst)
            manager.cache_req(self.rows[b], tokens, len(tokens), finished=False)
        self._pending_copies.clear()

    def finish(self) -> None:
        """Caches every row's prompt and answer (up to its first EOS) and releases all locks."""
        manager = self.engine.manager
        with manager.lazy_free_region():
            for b, row in enumerate(self.rows):
                tokens = self.tokens[b]
                answer_eos = [i for i in range(self.prompt_lens[b], len(tokens)) if tokens[i] in self.eos_token_ids]
                keep = answer_eos[0] + 1 if answer_eos else len(tokens)
                manager.release_row(row, tokens[:keep], min(self.computed[b], keep))
                self.engine.stats.generated_tokens += len(tokens) - self.prompt_lens[b]
        self.rows.clear()


CACHE_IMPLEMENTATION = "radix"


def _requested_cache_implementation(model, kwargs: dict) -> str | None:
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"]
    config = kwargs.get("generation_config") or model.generation_config
    return getattr(config, "cache_implementation", None)


def _check_generate_mode(model, kwargs: dict) -> None:
    config = kwargs.get("generation_config") or model.generation_config
    num_beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if num_beams > 1:
        raise ValueError(
            "cache_implementation='radix' does not support beam search; use num_beams=1 (with "
            "num_return_sequences and sampling for several answers) or the default cache for beams"
        )
    if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            "cache_implementation='radix' does not support assisted decoding; drop assistant_model / "
            "prompt_lookup_num_tokens, or use the default cache"
        )
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("cache_implementation='radix' needs input_ids, not inputs_embeds")


def _radix_generate(original, model, args: tuple, kwargs: dict):
    from .engine import get_engine, radix_attention

    _check_generate_mode(model, kwargs)
    engine = get_engine(model)
    eos = kwargs.get("eos_token_id", getattr(model.generation_config, "eos_token_id", None))
    cache = RadixGenerateCache(engine, [] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    kwargs = {**kwargs, "cache_implementation": None, engine.cache_kwarg: cache}
    hooks = [
        model.register_forward_pre_hook(cache.pre_forward, with_kwargs=True),
        model.register_forward_hook(cache.post_forward, with_kwargs=True),
    ]
    try:
        with radix_attention(model):
            return original(model, *args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        cache.finish()


def register_generate_support() -> None:
    """Makes "radix" a valid `cache_implementation` and routes such `generate` calls here (idempotent)."""
    from transformers.generation import configuration_utils as gen_config
    from transformers.generation.utils import GenerationMixin

    if CACHE_IMPLEMENTATION not in gen_config.ALL_CACHE_IMPLEMENTATIONS:
        gen_config.ALL_CACHE_IMPLEMENTATIONS = (*gen_config.ALL_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION)
        gen_config.DYNAMIC_CACHE_IMPLEMENTATIONS = (*gen_config.DYNAMIC_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION)
    if getattr(GenerationMixin.generate, "_hf_radix", False):
        return
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if _requested_cache_implementation(self, kwargs) != CACHE_IMPLEMENTATION:
            return original(self, *args, **kwargs)
        return _radix_generate(original, self, args, kwargs)

    generate._hf_radix = True
    GenerationMixin.generate = generate
