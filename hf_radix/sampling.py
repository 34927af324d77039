"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates; invalid values raise ValueError when built."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))

    @classmethod
    def from_generation_config(cls, config) -> SamplingParams:
        """The parameters `generate` would sample with under `config` (e.g. `model.generation_config`).

        Unset fields take transformers' generate defaults (greedy unless `do_sample`; top_k=50 when sampling).
        `max_length` counts the prompt and is not read: without `max_new_tokens` the default of 64 applies.
        Settings the runner cannot honour exactly (beam search, repetition penalties, min-p, ...) raise.
        """
        defaults = getattr(config, "_get_default_generation_params", dict)()

        def value(name: str, neutral=None):
            got = getattr(config, name, None)
            return defaults.get(name, neutral) if got is None else got

        do_sample = bool(value("do_sample", False))
        neutral = {
            "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "min_length": 0, "min_new_tokens": None, "bad_words_ids": None, "sequence_bias": None,
            "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
            "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "penalty_alpha": None,
            "dola_layers": None, "guidance_scale": None, "watermarking_config": None,
        }
        if do_sample:
            neutral.update(min_p=None, top_h=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        unsupported = {k: value(k, v) for k, v in neutral.items() if value(k, v) not in (v, None)}
        if unsupported:
            raise ValueError(
                f"the generation config sets {unsupported}, which RadixBatchRunner cannot honour; "
                "pass SamplingParams(...) explicitly to run without them"
            )
        top_k = value("top_k", 0) or -1
        return cls(
            max_new_tokens=value("max_new_tokens", cls.max_new_tokens),
            temperature=float(value("temperature", 1.0)) if do_sample else 0.0,
            top_p=float(value("top_p", 1.0)) if do_sample else 1.0,
            top_k=top_k if do_sample else -1,
            stop=value("stop_strings"),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SeededRows:
    """Per-request random generators, so a seeded request samples the same tokens in any batch."""

    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def get(self, uid: int, seed: int) -> torch.Generator:
        generator = self._generators.get(uid)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[uid] = generator
        return generator

    def drop(self, uid: int) -> None:
        self._generators.pop(uid, None)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks logits outside each row's top-k and nucleus (top-p); rows are independent."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of strictly better tokens
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uids: Sequence[int],
    seeded: SeededRows,
) -> torch.Tensor:
    """Next token for each row of `logits` `[B, vocab]`; greedy rows take the argmax."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    temps = torch.tensor([params[i].temperature for i in sampled], device=device, dtype=torch.float32)
    scaled = logits[rows].float() / temps[:, None]
    top_k = torch.tensor([params[i].top_k for i in sampled], device=device)
    top_p = torch.tensor([params[i].top_p for i in sampled], device=device, dtype=torch.float32)
    probs = _filter_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(sampled) if params[i].seed is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[-1]), device=device).exponential_()
    for j, i in enumerate(sampled):
        if params[i].seed is not None:
            noise[j].exponential_(generator=seeded.get(uids[i], params[i].seed))
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens
