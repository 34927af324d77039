"""Dataset-wide scoring loops on a RadixBatchRunner: rolling log-likelihood (perplexity) and multiple choice.

Every loop reduces to `runner.loglikelihood` on token ids, so contexts shared between requests (few-shot
prefixes, a question scored against each of its choices) are computed once and reused from the radix tree.
Inputs may be any iterable: lists, generators, a `datasets.Dataset` column.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from ..errors import RequestError
from ..forward.engine_view import ForwardEngine
from ..scheduling.request import prompt_items, token_id_array


class ScoringRunner(Protocol):
    """What the loops use of a `RadixBatchRunner`."""

    model: torch.nn.Module
    tokenizer: Any
    engine: ForwardEngine

    def loglikelihood(
        self, pairs: Iterable, progress: bool | None = None, errors: str = "raise"
    ) -> list[tuple[float, bool] | None]: ...

Window = tuple[list[int], list[int]]


def rolling_windows(tokens: Sequence[int], prefix_token_id: int, max_length: int) -> list[Window]:
    """Disjoint (context, continuation) windows that score every token of `tokens` exactly once.

    The first window predicts up to `max_length` tokens after `prefix_token_id`; each later window predicts
    the next `max_length` tokens (fewer at the end) given as many preceding tokens as fit, so the model
    never sees more than `max_length` input tokens (context + continuation, less the last token).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix_token_id], tokens[:first])]
    start = first
    while start < len(tokens):
        end = min(start + max_length, len(tokens))
        windows.append((tokens[end - max_length - 1:start], tokens[start:end]))
        start = end
    return windows


def default_prefix_token_id(runner: ScoringRunner) -> int:
    """BOS of the tokenizer (or model), else its EOS: what the first token of a text is conditioned on."""
    tok = runner.tokenizer
    candidates = [getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)]
    for config in (runner.model.generation_config, runner.model.config):
        candidates += [getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None)]
    for token in candidates:
        if isinstance(token, (list, tuple)):
            token = token[0] if token else None
        if token is not None:
            return int(token)
    raise ValueError("the tokenizer and the model config have no BOS or EOS token; pass prefix_token_id")


def _token_lists(runner: ScoringRunner, texts: Iterable) -> tuple[list[list[int]], dict[int, str]]:
    """Strings are tokenized without special tokens (the prefix token plays BOS); token ids pass through.
    A text that is not valid token ids gets no tokens and its message in the returned {index: message}."""
    texts = prompt_items(texts, "loglikelihood_rolling", "texts")
    if texts and all(isinstance(t, str) for t in texts):
        if runner.tokenizer is None:
            raise ValueError("string texts need a tokenizer: RadixBatchRunner(model, tokenizer)")
        return [list(ids) for ids in runner.tokenizer(texts, add_special_tokens=False)["input_ids"]], {}
    if any(isinstance(t, str) for t in texts):
        raise ValueError("mix of string and token-id texts; pass one kind")
    token_lists, failures = [], {}
    for i, text in enumerate(texts):
        try:
            token_lists.append(token_id_array(text).tolist())
        except (TypeError, ValueError) as exc:
            token_lists.append([])
            failures[i] = str(exc)
    return token_lists, failures


ROLLING_GROUP_TOKENS = 1 << 16  # with a progress bar, texts are scored in runner calls of about this size


def loglikelihood_rolling(
    runner: ScoringRunner,
    texts: Iterable,
    progress: bool | None = None,
    *,
    prefix_token_id: int | None = None,
    max_length: int | None = None,
) -> list[float]:
    """Total log-likelihood of each text (strings or token-id lists), the first token given BOS/EOS.

    Texts longer than `max_length` (default: the model's context) are scored in disjoint rolling windows
    (`rolling_windows`); an empty text scores 0.0. The progress bar (default: shown for 32 texts or more)
    counts texts, which are scored in runner calls of about `ROLLING_GROUP_TOKENS` tokens for it.
    A bad text (not token ids, ids outside the vocabulary) fails alone: once the others are scored, a
    `RequestError` carries the messages by text index and the other totals (None in the failed places).
    """
    token_lists, failures = _token_lists(runner, texts)
    prefix = default_prefix_token_id(runner) if prefix_token_id is None else prefix_token_id
    length = runner.engine.max_context if max_length is None else max_length
    windows = [rolling_windows(tokens, prefix, length) for tokens in token_lists]
    show = len(token_lists) >= 32 if progress is None else progress
    budget = ROLLING_GROUP_TOKENS if show else float("inf")
    totals = [0.0] * len(token_lists)
    with tqdm(total=len(token_lists), disable=not show, desc="rolling log-likelihood", unit="text") as bar:
        start = 0
        while start < len(windows):
            end, size = start, 0
            while end < len(windows) and (end == start or size < budget):
                size += sum(len(a) + len(b) for a, b in windows[end])
                end += 1
            owners = [i for i in range(start, end) for _ in windows[i]]
            pairs = [pair for i in range(start, end) for pair in windows[i]]
            try:
                scores = runner.loglikelihood(pairs, progress=False)
            except RequestError as exc:  # the other windows were scored
                scores = exc.results
                for j, message in exc.errors.items():
                    failures.setdefault(owners[j], message)
            for owner, score in zip(owners, scores):
                if score is not None:
                    totals[owner] += score[0]
            bar.update(end - start)
            start = end
    if failures:
        results = [None if i in failures else total for i, total in enumerate(totals)]
        raise RequestError(dict(sorted(failures.items())), results, "texts")
    return totals


def score_choices(
    runner: ScoringRunner,
    contexts: Iterable,
    choices: Iterable[Sequence],
    progress: bool | None = None,
) -> list[list[float]]:
    """Log-likelihood of every choice of every question: `[[logprob of choice j of question i]]`.

    One scoring request per (context, choice); each context is computed once and shared by its choices
    (and by any other context with the same prefix, such as a few-shot preamble).
    """
    contexts, choices = list(contexts), [list(c) for c in choices]
    if len(contexts) != len(choices):
        raise ValueError(f"got {len(contexts)} contexts and {len(choices)} choice lists")
    if any(not c for c in choices):
        raise ValueError("every question needs at least one choice")
    pairs = [(ctx, choice) for ctx, options in zip(contexts, choices) for choice in options]
    scores = iter(logprob for logprob, _ in runner.loglikelihood(pairs, progress))
    return [[next(scores) for _ in options] for options in choices]
