"""User inputs as token ids: batches of prompts or (context, continuation) pairs, each item an int64 array.

Strings go through the tokenizer (each distinct string once); token-id sequences are checked and converted
(each distinct object once). An item that is not valid token ids fails alone: its message comes back by
index and its request fails without running.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from .sampling import SamplingParams, generate_new_tokens

_NO_TOKENS = np.empty(0, dtype=np.int64)  # the tokens of an item that failed conversion


def token_arrays(tokenizer, items: list, kind: str = "prompts") -> tuple[list[np.ndarray], dict[int, str]]:
    """Each item (all strings, or all token-id sequences) as an int64 array; an item that repeats (the
    same string, or the same object, such as a context scored against each of its choices) is
    tokenized or converted once and its array shared. Continuations get no special tokens.

    An item that is not a valid token-id sequence (floats, bools, a bare number) gets an empty array
    and its message in the returned {index: message}: its request fails alone.
    """
    if not items:
        return [], {}
    if all(isinstance(p, str) for p in items):
        if tokenizer is None:
            raise ValueError(f"string {kind} need a tokenizer: RadixBatchRunner(model, tokenizer)")
        unique = list(dict.fromkeys(items))
        options = {"add_special_tokens": False} if kind == "continuations" else {}
        ids = tokenizer(unique, **options)["input_ids"]
        arrays = {text: np.asarray(t, dtype=np.int64) for text, t in zip(unique, ids)}
        return [arrays[p] for p in items], {}
    converted: dict[int, np.ndarray | str] = {}  # by id(): `items` keeps every object alive meanwhile
    out, failures = [], {}
    for i, p in enumerate(items):
        if isinstance(p, str):
            raise ValueError(f"mix of string and token-id {kind}; pass one kind")
        array = converted.get(id(p))
        if array is None:
            try:
                array = token_id_array(p)
            except (TypeError, ValueError) as exc:
                array = str(exc)
            converted[id(p)] = array
        if isinstance(array, str):
            failures[i] = array
            array = _NO_TOKENS
        out.append(array)
    return out, failures


def tokenize(tokenizer, items: Iterable, kind: str = "prompts") -> list[list[int]]:
    """Every item's token ids; an item that is not valid token ids raises (ValueError, naming it)."""
    items = prompt_items(items, "run") if kind == "prompts" else list(items)
    arrays, failures = token_arrays(tokenizer, items, kind)
    if failures:
        index, message = next(iter(failures.items()))
        raise ValueError(f"{kind[:-1]} {index}: {message}")
    return [ids.tolist() for ids in arrays]


def prompt_items(prompts, call: str, noun: str = "prompts") -> list:
    """`prompts` as a list, refusing what reads as one prompt rather than a batch of them (TypeError): a
    string (it would run one prompt per character) or a flat sequence of numbers (one token-id prompt)."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"{call}() takes a list of {noun}, got a single string (read as one {noun[:-1]} per "
            f"character); wrap it in a list: {call}([{noun[:-1]}])"
        )
    items = list(prompts)
    if items and all(_is_scalar(p) for p in items):
        raise TypeError(
            f"{call}() takes a list of {noun}, got a flat sequence of numbers (one {noun[:-1]} of token "
            f"ids?); wrap it in a list: {call}([token_ids])"
        )
    return items


def pair_items(pairs, call: str = "loglikelihood") -> list:
    """`pairs` as a list of (context, continuation) pairs, refusing (TypeError) one pair not wrapped in a
    list: a pair of strings, or a pair of token-id lists (which would unpack into pairs of numbers)."""
    one_pair = f"to score one pair, wrap it in a list: {call}([(context, continuation)])"
    if isinstance(pairs, (str, bytes)):
        raise TypeError(f"{call}() takes a list of (context, continuation) pairs, got a string; {one_pair}")
    items = list(pairs)
    for i, pair in enumerate(items):
        sized = hasattr(pair, "__len__") and not isinstance(pair, (str, bytes)) and not _is_scalar(pair)
        if not sized or len(pair) != 2:
            raise TypeError(
                f"{call}() takes a list of (context, continuation) pairs; item {i} is {_describe(pair)}, "
                f"not a pair; {one_pair}"
            )
    if items and all(_is_scalar(c) and _is_scalar(x) for c, x in items):
        raise TypeError(
            f"{call}() takes a list of (context, continuation) pairs, got pairs of numbers (one pair of "
            f"token-id lists?); {one_pair}"
        )
    return items


def _is_scalar(value) -> bool:
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def token_id_array(tokens) -> np.ndarray:
    """One prompt's token ids (a list, an array or a tensor of integers) as a 1-D int64 array.

    Python ints and numpy / torch integer values are token ids; anything else raises a TypeError naming
    the first offender and its position: floats (even 5.0), bools, strings, nested sequences, a scalar or
    a 2-D array in place of the sequence. (A list mixing bools into ints converts as 0 / 1: telling them
    apart would cost a pass over every element.) The vocabulary range is the scheduler's check.
    """
    if isinstance(tokens, (str, bytes)) or getattr(tokens, "ndim", 1) == 0 or not hasattr(tokens, "__iter__"):
        raise TypeError(f"token ids must form a sequence of integers, got {_describe(tokens)}")
    if getattr(tokens, "ndim", 1) != 1:
        raise TypeError(f"token ids must form a 1-D sequence, got shape {tuple(tokens.shape)}")
    values = tokens.tolist() if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray) else tokens
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):  # ragged or otherwise not an array of numbers
        array = None
    if array is not None and array.ndim == 1:
        if array.dtype.kind in "iu" and array.dtype != np.uint64:
            return array.astype(np.int64, copy=False)
        if not array.size:
            return np.empty(0, dtype=np.int64)
    if isinstance(values, np.ndarray):
        values = values.tolist()  # Python scalars in the messages
    ids = np.empty(len(values), dtype=np.int64)
    for i, t in enumerate(values):
        value = None if isinstance(t, (bool, np.bool_)) else _index(t)
        if value is None:
            raise TypeError(f"token ids must be integers, got {_describe(t)} at position {i}")
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"token ids must lie in the vocabulary, got {value} at position {i}")
        ids[i] = value
    return ids


def _index(value) -> int | None:
    """`value` as an int when it is an integer (Python, numpy, a one-element integer tensor), else None."""
    if getattr(value, "dtype", None) is not None and "bool" in str(value.dtype):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def token_id_list(value) -> list[int]:
    """An EOS-style setting (None, an id, a list or a tensor of ids) as a list of ids."""
    if value is None:
        return []
    if hasattr(value, "reshape"):
        return [int(t) for t in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


def params_per_prompt(
    model,
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    prompt_lens: Sequence[int],
    failures: dict[int, str] | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per prompt: the given one repeated, the given list, or, without either,
    `model.generation_config`'s, each prompt's length as generate decides it from `prompt_lens`; a prompt
    it leaves no room for gets its message in `failures` (its request then fails alone)."""
    num_prompts = len(prompt_lens)
    if sampling_params:
        params = sampling_params
        params = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return params
    config = model.generation_config
    positions = getattr(model.config, "max_position_embeddings", None)
    # the sampling settings (raises for what the runner cannot honour); the length is each prompt's
    template = SamplingParams.from_generation_config(config, prompt_len=0)
    by_length: dict[int, SamplingParams | str] = {}
    params = []
    for i, length in enumerate(prompt_lens):
        if length not in by_length:
            try:
                new = generate_new_tokens(config, length, positions)
                by_length[length] = dataclasses.replace(template, max_new_tokens=new)
            except ValueError as exc:  # no room left after the prompt: generate would raise
                by_length[length] = str(exc)
        chosen = by_length[length]
        if isinstance(chosen, str):
            if failures is not None:
                failures.setdefault(i, chosen)
            chosen = dataclasses.replace(template, max_new_tokens=0)
        params.append(chosen)
    return params
