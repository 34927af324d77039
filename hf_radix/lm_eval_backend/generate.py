"""generate_until requests as `hf` runs them: on the runner when it applies everything, else through HF.

The runner samples with temperature, top-k and top-p only. A request whose generation kwargs (or whose
model's generation_config) ask for anything else — repetition_penalty, min_p, no_repeat_ngram_size, beams —
goes through transformers' own `generate`, which applies every logits processor: with
`cache_implementation="radix"` (prefix reuse kept) in padded batches, one batch per group of identical
kwargs as large as the KV pool allows, or plain `generate` for beam search, which the radix cache lacks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers.utils import logging

from ..scheduling.sampling import SamplingParams

logger = logging.get_logger(__name__)

RUNNER_KWARGS = frozenset({"do_sample", "temperature", "top_p", "top_k", "seed", "until", "max_gen_toks"})

# generation_config fields and the value at which transformers adds no logits processor for them
NEUTRAL = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "num_beams": 1,
    "penalty_alpha": None,
}
SAMPLING_DEFAULTS = {
    "top_k": 50,
    "top_p": 1.0,
}  # transformers' when neither the kwargs nor the model set them


@dataclass
class Plan:
    """How one request's generation kwargs run: `params` on the runner, else `hf_kwargs` through generate."""

    params: SamplingParams | None
    hf_kwargs: dict
    needs_hf: tuple[str, ...] = ()


def _non_neutral(config) -> dict:
    return {
        key: value
        for key, neutral in NEUTRAL.items()
        if (value := getattr(config, key, None)) is not None and value != neutral and value != []
    }


def plan(model, kwargs: dict, until: list[str]) -> Plan:
    """The runner's SamplingParams when they reproduce HF's `generate` for these kwargs, else HF's kwargs.

    `kwargs` are lm-eval's normalized generation kwargs (`do_sample`, `max_gen_toks`, ...; `until` apart).
    """
    hf_kwargs = {key: value for key, value in kwargs.items() if key not in ("until", "max_gen_toks")}
    hf_kwargs["temperature"] = temperature = float(hf_kwargs.get("temperature", 0.0))  # as hf sets it
    if not hf_kwargs.get("do_sample") and temperature == 0.0:
        del hf_kwargs["temperature"]  # greedy: HF needs no temperature (and would warn about one)
    config = model.generation_config
    explicit_neutral = {key for key in kwargs if key in NEUTRAL and kwargs[key] == NEUTRAL[key]}
    needs = [key for key in sorted(set(kwargs) - RUNNER_KWARGS) if key not in explicit_neutral]
    needs += [
        f"{key} (the model's generation_config)" for key in sorted(_non_neutral(config)) if key not in kwargs
    ]
    if needs:
        return Plan(None, hf_kwargs, tuple(needs))
    stop = [s for s in until if s]
    max_new = int(kwargs["max_gen_toks"])
    if not kwargs.get("do_sample"):
        return Plan(SamplingParams(max_new_tokens=max_new, stop=stop), hf_kwargs)
    top_k, top_p = (kwargs.get(key, getattr(config, key, None)) for key in ("top_k", "top_p"))
    params = SamplingParams(
        max_new_tokens=max_new,
        stop=stop,
        temperature=temperature,
        seed=kwargs.get("seed"),
        top_k=int(SAMPLING_DEFAULTS["top_k"] if top_k is None else top_k) or -1,  # 0 disables top-k in HF
        top_p=float(SAMPLING_DEFAULTS["top_p"] if top_p is None else top_p),
    )
    return Plan(params, hf_kwargs)


def warn_hf_path(needs: tuple[str, ...]) -> None:
    """One warning per distinct set of generation options that sends requests through HF's generate."""
    logger.warning_once(
        f"hf-radix: generation options {list(needs)} are applied by transformers' generate("
        "cache_implementation='radix') (every HF logits processor; prefix reuse kept, no continuous batching)"
    )


def group_key(kwargs: dict) -> str:
    return json.dumps(kwargs, sort_keys=True, default=repr)


def hf_generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    kwargs: dict,
    until: list[str],
    max_new_tokens: int,
    pool_tokens: int,
    page_size: int,
    max_rows: int,
    on_batch: Callable[[int], None],
) -> list[list[int]]:
    """New tokens of each prompt by HF `generate`, in left-padded batches that fit the KV pool.

    Batches run longest prompts first (hf's order); each holds at most `max_rows` rows and needs at most
    `pool_tokens` slots (every row's prompt + max_new_tokens, whole pages).
    """
    beams = int(kwargs.get("num_beams") or 1) > 1 or kwargs.get("penalty_alpha") is not None
    if beams:
        logger.warning_once(
            "hf-radix: beam search and contrastive search run on transformers' default cache "
            "(no prefix reuse): the radix cache does greedy decoding and sampling only"
        )
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    start = 0
    while start < len(order):
        end, need = start, 0
        while end < len(order) and end - start < max_rows:
            row = -(-(len(prompts[order[end]]) + max_new_tokens) // page_size) * page_size
            if end > start and need + row > pool_tokens:
                break
            need, end = need + row, end + 1
        rows = order[start:end]
        for i, tokens in zip(
            rows,
            _generate_batch(
                model, tokenizer, [prompts[i] for i in rows], kwargs, until, max_new_tokens, beams
            ),
        ):
            out[i] = tokens
        on_batch(len(rows))
        start = end
    return out


def _generate_batch(model, tokenizer, prompts, kwargs, until, max_new_tokens, beams) -> list[list[int]]:
    width = max(map(len, prompts))
    candidates = (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id)  # hf's choice
    pad = next((t for t in candidates if t is not None), 0)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    call = dict(kwargs)
    if "max_length" in call:
        logger.warning_once("`max_length` in generation kwargs. Please use `max_gen_toks` instead.")
    else:
        call["max_new_tokens"] = max_new_tokens
    if not beams:
        call["cache_implementation"] = "radix"
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            stopping_criteria=stop_sequences_criteria(tokenizer, until, width, len(prompts)),
            pad_token_id=pad,
            use_cache=True,
            **call,
        )
    return [row[width:] for row in sequences.tolist()]
