"""Incremental stop-string detection equals searching the whole decoded output at every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_radix.scheduling.stop_strings import StopStringDetector
from hf_radix.tiny import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
VOCAB = len(TOKENIZER)


def _first_stop_by_whole_decode(generated: list[int], stops: list[str]) -> int | None:
    """The reference: the first step whose whole decoded output contains a stop string."""
    for step in range(1, len(generated) + 1):
        text = TOKENIZER.decode(generated[:step], skip_special_tokens=False)
        if any(stop in text for stop in stops):
            return step
    return None


def _first_stop_incremental(detector: StopStringDetector, uid: int, generated: list[int], stops: list[str]):
    for step in range(1, len(generated) + 1):
        if detector.found(uid, generated[:step], stops):
            return step
    return None


@st.composite
def _case(draw):
    # byte tokens (ids of single bytes, some of them parts of multi-byte characters) and merged tokens
    generated = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    text = TOKENIZER.decode(generated, skip_special_tokens=False)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):  # a piece of the output: a hit somewhere
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 8))])
        else:
            stops.append(draw(st.text(alphabet="ab e.\n\ufffd\u00e9", min_size=1, max_size=4)))
    return generated, stops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_incremental_equals_whole_decode(case):
    generated, stops = case
    detector = StopStringDetector(TOKENIZER)
    expected = _first_stop_by_whole_decode(generated, stops)
    assert _first_stop_incremental(detector, 0, generated, stops) == expected


def test_multibyte_character_split_across_tokens():
    ids = TOKENIZER("café au lait é", add_special_tokens=False)["input_ids"]
    byte_ids = [TOKENIZER.convert_tokens_to_ids(t) for t in TOKENIZER.convert_ids_to_tokens(ids)]
    for stop in (["é"], ["fé a"], ["lait é"], ["\ufffd"], ["zz"]):
        detector = StopStringDetector(TOKENIZER)
        expected = _first_stop_by_whole_decode(byte_ids, stop)
        assert _first_stop_incremental(detector, 1, byte_ids, stop) == expected


def test_requests_are_independent_and_drop_forgets():
    detector = StopStringDetector(TOKENIZER)
    a = TOKENIZER("the quick brown fox", add_special_tokens=False)["input_ids"]
    b = TOKENIZER("lazy dog jumps", add_special_tokens=False)["input_ids"]
    steps = {}
    for step in range(1, max(len(a), len(b)) + 1):
        for uid, ids, stops in ((0, a, ["fox"]), (1, b, ["dog"])):
            if uid not in steps and step <= len(ids) and detector.found(uid, ids[:step], stops):
                steps[uid] = step
    assert steps == {0: _first_stop_by_whole_decode(a, ["fox"]), 1: _first_stop_by_whole_decode(b, ["dog"])}
    detector.drop(0)
    assert _first_stop_incremental(detector, 0, b, ["dog"]) == steps[1]


@pytest.mark.parametrize("stops", [["Paris"], [" eight", "Answer"]])
def test_text_is_decoded_only_past_the_settled_point(stops, monkeypatch):
    ids = TOKENIZER("Question: what is the capital of France? Answer: Paris. Question: eight",
                    add_special_tokens=False)["input_ids"]
    decoded_lengths = []
    decode = TOKENIZER.decode
    monkeypatch.setattr(
        TOKENIZER, "decode", lambda tokens, **kw: decoded_lengths.append(len(tokens)) or decode(tokens, **kw)
    )
    detector = StopStringDetector(TOKENIZER)
    found = _first_stop_incremental(detector, 0, ids, stops)
    monkeypatch.undo()
    assert found == _first_stop_by_whole_decode(ids, stops)
    assert max(decoded_lengths) <= 3  # a new token and its context chunk, never the whole output
