"""Errors hf_radix raises to its users, and the one policy for requests that fail.

Error policy, the same for every entry point:

* A call whose arguments are wrong as a whole (no tokenizer for strings, mismatched lengths, options
  the radix path cannot honour, one prompt or pair not wrapped in a list) raises ``ValueError`` (or
  ``TypeError``) before anything runs.
* A model hf_radix cannot run exactly raises :class:`UnsupportedModelError` when its engine is created,
  before any forward. A model in training mode with active dropout raises :class:`TrainingModeError`
  in the runner (radix ``generate`` runs plain ``generate`` then).
* One bad request (an empty prompt, ids that are not integers, out-of-vocabulary ids, too long for the
  model or the pool) fails alone: the other requests complete and the cache stays consistent.
  ``RadixBatchRunner.run`` reports it in its :class:`~hf_radix.RequestOutput` (``finish_reason="error"``,
  ``error=<message>``); ``loglikelihood`` raises :class:`RequestError` (carrying every message and the
  other results) or, with ``errors="return"``, returns ``None`` in the failed places;
  ``loglikelihood_rolling`` raises it by text. ``run(..., errors="raise")`` raises the same
  :class:`RequestError` (carrying the outputs).
* ``generate(..., cache_implementation="radix")`` is one batch: bad input raises ``ValueError`` before the
  first forward, and an exception mid-call (a stopping criterion, a logits processor) propagates after
  every lock and page of the call is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ERROR_MODES",
    "OWN_CACHE_MESSAGE",
    "RequestError",
    "TrainingModeError",
    "UnsupportedModelError",
    "check_error_mode",
    "raise_or_return",
]

#: Why a radix call takes no past_key_values, and what to do instead.
OWN_CACHE_MESSAGE = (
    "cache_implementation='radix' keeps its own cache: pass the whole conversation as input_ids (its "
    "cached prefix is reused automatically) and no past_key_values"
)

ERROR_MODES = ("raise", "return")


class UnsupportedModelError(ValueError):
    """The model cannot run exactly through hf_radix; the message names the model class and the reason."""

    def __init__(self, model_class: str, reason: str):
        super().__init__(f"hf_radix cannot run {model_class} exactly: {reason}")
        self.model_class = model_class
        self.reason = reason


class TrainingModeError(ValueError):
    """The model is in training mode with active dropout: K/V it computes is random, not reusable."""

    def __init__(self, module: str):
        super().__init__(
            f"hf_radix: the model is in training mode with active dropout ({module}), so the K/V it computes "
            "is random and no prefix can be reused; call model.eval() before radix calls "
            "(generate(cache_implementation='radix') runs plain generate in this case)"
        )
        self.module = module


class RequestError(ValueError):
    """Some requests of a call failed; the others completed.

    ``errors`` maps the index of each failed request to its message; ``results`` holds what the call
    would have returned, with ``None`` (scoring) or the failed ``RequestOutput`` (``run``) in those places.
    """

    def __init__(self, errors: dict[int, str], results: Sequence[Any], what: str = "requests"):
        first = next(iter(errors.items()))
        super().__init__(
            f"{len(errors)} of {len(results)} {what} failed; first (index {first[0]}): {first[1]}"
        )
        self.errors = errors
        self.results = list(results)


def check_error_mode(errors: str) -> None:
    if errors not in ERROR_MODES:
        raise ValueError(f"errors must be one of {ERROR_MODES}, got {errors!r}")


def raise_or_return(results: list[Any], failures: dict[int, str], errors: str, what: str) -> list[Any]:
    """Returns ``results``, or raises a RequestError carrying them when some failed and ``errors="raise"``."""
    if failures and errors == "raise":
        raise RequestError(failures, results, what)
    return results
