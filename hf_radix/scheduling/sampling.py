"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, per-request seeds).

The sampler's random numbers are counter-based: the noise of vocabulary entry `j` at a request's `n`-th
sampled token is a hash of (the request's seed, `n`, `j`). So a seeded request samples the same tokens
whatever its batch-mates and their order. A step is a few Triton launches on a GPU
(`hf_radix.kernels.triton_sampling`, no sort of the vocabulary; their number depends on which searches,
top-k and top-p, the batch's rows use, never on its size) or a fixed handful of torch ops elsewhere
(`sample_rows_torch`, the same rule and the same noise). Each row's parameters are
staged into device buffers once per change of the batch's requests, never per step.

The rule, per sampled row, on `x = logits.float() * (1 / temperature)`: top-k keeps the tokens whose `x`
is at least the k-th largest (ties at it all kept, as HF's `TopKLogitsWarper`); top-p then keeps, of
those, the tokens whose `x` is at least `v`, the largest value whose tokens at or above it hold at least
`top_p` of the kept mass: HF's smallest set of most likely tokens reaching `top_p`, except that tokens
tied with the last one are all kept (HF keeps an arbitrary part of them). The token is the argmax of
`x + g` over the kept tokens, `g` the counter-based Gumbel noise (lowest index on ties): a sample of the
softmax of `x` over them (noise from 24-bit uniforms: tokens ~20 nats below the best are never drawn).
Temperature 0 (or top_k 1) is greedy: the argmax of the logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import triton_runs_on
from ..memory.page_table import to_device


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
    def from_generation_config(
        cls, config, prompt_len: int | None = None, max_positions: int | None = None
    ) -> SamplingParams:
        """The parameters `generate` would sample with under `config` (e.g. `model.generation_config`).

        Unset fields take transformers' generate defaults (greedy unless `do_sample`; top_k=50 when sampling).
        The length is generate's (`generate_new_tokens`): `max_new_tokens`, else `max_length` minus the
        prompt's `prompt_len` tokens, else 20 new tokens. Settings the runner cannot honour exactly (beam
        search, repetition penalties, min-p, ...) raise.
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
            max_new_tokens=generate_new_tokens(config, prompt_len, max_positions),
            temperature=float(value("temperature", 1.0)) if do_sample else 0.0,
            top_p=float(value("top_p", 1.0)) if do_sample else 1.0,
            top_k=top_k if do_sample else -1,
            stop=value("stop_strings"),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


GENERATE_DEFAULT_NEW_TOKENS = 20  # transformers' default max_length, counted from the prompt when unset


def generate_new_tokens(config, prompt_len: int | None = None, max_positions: int | None = None) -> int:
    """How many tokens `generate` may add to a prompt of `prompt_len` tokens under `config` (a call that sets
    no length itself), as transformers 5.x decides it:

    - `config.max_new_tokens`, when set;
    - else `config.max_length - prompt_len` when `max_length` is set (it counts the prompt, so `prompt_len`
      is needed; a checkpoint's `generation_config.json` often sets it);
    - else 20 new tokens, transformers' default, though no further than `max_positions` (the model's
      `max_position_embeddings`) when both it and `prompt_len` are given.

    A prompt that leaves no room raises ValueError, as generate does.
    """
    if getattr(config, "max_new_tokens", None) is not None:
        return config.max_new_tokens
    max_length = getattr(config, "max_length", None)
    if max_length is None:
        if prompt_len is None or max_positions is None:
            return GENERATE_DEFAULT_NEW_TOKENS
        limit = min(prompt_len + GENERATE_DEFAULT_NEW_TOKENS, max_positions)
    elif prompt_len is None:
        raise ValueError(
            f"the generation config sets max_length={max_length}, which counts the prompt, and no "
            "max_new_tokens: give the prompt's length, or pass SamplingParams(max_new_tokens=...)"
        )
    else:
        limit = max_length
    if prompt_len >= limit:
        raise ValueError(
            f"the prompt has {prompt_len} tokens but generate's max_length is {limit} (it counts the "
            "prompt); set max_new_tokens in the generation config or pass SamplingParams(max_new_tokens=...)"
        )
    return limit - prompt_len


_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31: a 32-bit value times one fits int64 exactly, on every device.
_MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_COLUMN_SALT = 0x27D4EB2F
_TOP_K_OFF = np.iinfo(np.int64).max


def mix32(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2**32); exact anywhere."""
    x = x ^ (x >> 16)
    x = (x * _MIX_MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 15)


@functools.lru_cache(maxsize=4)
def column_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """`[vocab]` int64: each vocabulary entry's 32-bit key (made once per vocabulary size and device)."""
    with torch.inference_mode(False):
        return mix32(mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ _COLUMN_SALT))


def gumbel_noise(row_keys: torch.Tensor, column_keys: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise `[rows, vocab]` fp32 from per-row and per-column 32-bit keys (counter-based)."""
    bits = mix32(row_keys[:, None] ^ column_keys[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0**-24  # in (0, 1), exact in fp32
    return uniform.log_().neg_().log_().neg_()


def row_keys(seed_keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's key at its current step, from the two halves of its seed `[2, rows]` (mixed at staging)."""
    return mix32(mix32(seed_keys[0] ^ steps) ^ seed_keys[1])


def seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """`[2, rows]` int64: each 64-bit seed's halves, hashed (distinct seeds give unrelated streams)."""
    values = np.array([s & ((1 << 64) - 1) for s in seeds], dtype=np.uint64)
    low = (values & np.uint64(_MASK32)).astype(np.int64)
    high = (values >> np.uint64(32)).astype(np.int64)
    return np.stack([mix32(low ^ 0x5BD1E995), mix32(high ^ 0x1B873593)])


def kept_threshold(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[rows, 1]`: each row keeps the tokens with `x >=` it (the module's top-k then top-p rule)."""
    ordered = x.sort(dim=-1, descending=True).values
    vocab = x.shape[-1]
    kth = ordered.gather(1, (top_k.clamp(max=vocab) - 1)[:, None])
    mass = (ordered - ordered[:, :1]).exp_().masked_fill_(ordered < kth, 0.0).cumsum_(-1)
    last = (mass < top_p[:, None] * mass[:, -1:]).sum(-1, keepdim=True).clamp_(max=vocab - 1)
    nucleus = ordered.gather(1, last)
    return torch.where(top_p[:, None] < 1.0, torch.maximum(kth, nucleus), kth)


def sample_rows_torch(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed_keys: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """`triton_sampling.sample_rows` in torch ops (with a sort); does not advance `steps`."""
    greedy = inv_temperature == 0.0
    x = logits.float() * inv_temperature.masked_fill(greedy, 1.0)[:, None]
    scores = x + gumbel_noise(row_keys(seed_keys, steps), column_keys(x.shape[-1], x.device))
    sampled = scores.masked_fill_(x < kept_threshold(x, top_k, top_p), float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


@dataclass
class _StagedBatch:
    """Device copies of the parameters of one batch's rows (greedy rows: inverse temperature 0)."""

    uids: tuple[int, ...]
    sampled_uids: tuple[int, ...] = ()  # none: an all-greedy batch (the tensors below are then None)
    inv_temperature: torch.Tensor | None = None  # [B] fp32
    top_p: torch.Tensor | None = None  # [B] fp32
    top_k: torch.Tensor | None = None  # [B] int64; int64 max where disabled
    seed_keys: torch.Tensor | None = None  # [2, B] int64
    steps: torch.Tensor | None = None  # [B] tokens each row has sampled so far; advanced on the device
    top_k_rows: bool = False  # a sampled row uses top-k
    top_p_rows: bool = False  # a sampled row uses top-p
    calls: int = 0  # sample calls since staging


class Sampler:
    """Next tokens of a batch: greedy rows take the argmax, the others sample with counter-based noise.

    Fixed launches per step on a GPU (the Triton kernels; an all-greedy batch: one argmax). `sample` restages
    per-row parameters only when the batch's requests change (`uids`); `drop(uid)` must be called when a
    request ends (its uid may then be reused). A request without a seed draws one from torch's global
    generator when it first samples.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._seeds: dict[int, int] = {}  # uid -> seed
        self._sampled: dict[int, int] = {}  # uid -> tokens sampled before the staged batch's calls
        self._staged: _StagedBatch | None = None

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], uids: Sequence[int]
    ) -> torch.Tensor:
        """Next token `[B]` for each row of `logits` `[B, vocab]`; row `i` belongs to request `uids[i]`."""
        if len(params) != logits.shape[0] or len(uids) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} params and {len(uids)} uids")
        staged = self._staged
        uids = uids if isinstance(uids, tuple) else tuple(uids)
        if staged is None or (staged.uids is not uids and staged.uids != uids):
            staged = self._stage(params, uids)
        if not staged.sampled_uids:
            return logits.argmax(dim=-1)
        args = (staged.inv_temperature, staged.top_k, staged.top_p, staged.seed_keys, staged.steps)
        if triton_runs_on(logits):
            from ..kernels.triton_sampling import sample_rows

            # advances staged.steps
            tokens = sample_rows(logits, *args, top_k_rows=staged.top_k_rows, top_p_rows=staged.top_p_rows)
        else:
            tokens = sample_rows_torch(logits, *args)
            staged.steps = staged.steps + 1
        staged.calls += 1
        return tokens

    def drop(self, uid: int) -> None:
        """Forgets request `uid` (it has finished)."""
        self._unstage()
        self._seeds.pop(uid, None)
        self._sampled.pop(uid, None)

    def _unstage(self) -> None:
        """Folds the staged batch's calls into each of its requests' counts of sampled tokens."""
        staged, self._staged = self._staged, None
        if staged is not None:
            for uid in staged.sampled_uids:
                self._sampled[uid] = self._sampled.get(uid, 0) + staged.calls

    def _stage(self, params: Sequence[SamplingParams], uids: tuple[int, ...]) -> _StagedBatch:
        self._unstage()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            self._staged = _StagedBatch(uids)
            return self._staged
        sampled_uids = tuple(uids[i] for i in sampled)
        for i in sampled:
            if uids[i] not in self._seeds:
                seed = params[i].seed
                self._seeds[uids[i]] = int(torch.randint(1 << 62, ()).item()) if seed is None else seed
        ints = np.zeros((4, len(uids)), dtype=np.int64)  # top_k, seed keys (2), steps
        floats = np.zeros((2, len(uids)), dtype=np.float32)  # inverse temperature, top_p
        ints[0] = [p.top_k if p.top_k > 0 else _TOP_K_OFF for p in params]
        ints[1:3, sampled] = seed_keys([self._seeds[u] for u in sampled_uids])
        ints[3, sampled] = [self._sampled.get(u, 0) for u in sampled_uids]
        floats[0, sampled] = [1.0 / params[i].temperature for i in sampled]
        floats[1] = [p.top_p for p in params]
        with torch.inference_mode(False):  # the kernel advances `steps` in place, in any grad mode
            ints_dev = to_device(ints, self.device)
            floats_dev = to_device(floats, self.device, torch.float32)
        self._staged = _StagedBatch(
            uids, sampled_uids, inv_temperature=floats_dev[0], top_p=floats_dev[1], top_k=ints_dev[0],
            seed_keys=ints_dev[1:3], steps=ints_dev[3], top_k_rows=any(params[i].top_k > 0 for i in sampled),
            top_p_rows=any(params[i].top_p < 1.0 for i in sampled),
        )
        return self._staged


def warm_up_sampling(logits: torch.Tensor) -> None:
    """Compiles what sampling rows of `logits`' dtype and device runs (a seeded top-k + top-p row, a greedy
    one), so that a first seeded step compiles nothing; the rows' own draws are thrown away."""
    rows = logits[-1:].expand(2, -1).contiguous()
    params = [SamplingParams(max_new_tokens=1, temperature=0.7, top_p=0.9, top_k=5, seed=0),
              SamplingParams(max_new_tokens=1)]
    Sampler(logits.device).sample(rows, params, [0, 1])
