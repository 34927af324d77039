"""Prompt conversion, requests built from token-id arrays, and a request's status and lengths."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hf_radix import IntegrityError
from hf_radix.scheduling.inputs import token_id_array
from hf_radix.scheduling.request import Req, RequestStatus
from hf_radix.scheduling.sampling import SamplingParams


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 0, 7],
        (5, 0, 7),
        [np.int64(3), np.int32(9)],
        [torch.tensor(4), np.uint64(3)],
        np.array([4, 2, 1], dtype=np.int32),
        np.array([250, 3], dtype=np.uint8),
        np.array([7, 1], dtype=np.uint64),
        torch.tensor([8, 1, 6]),
        [5, -1],  # converted; the scheduler fails it against the vocabulary
        [],
        torch.tensor([], dtype=torch.float32),
    ],
)
def test_token_id_array_equals_int_per_element(tokens):
    values = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    got = token_id_array(tokens)
    assert got.dtype == np.int64 and got.ndim == 1
    assert got.tolist() == [int(t) for t in values]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([5.7, 6.2], "be integers, got float 5.7 at position 0"),
        ([5, 6.0], "be integers, got float 6.0 at position 1"),  # an integral float is still a float
        (np.array([1.5, 2.5]), "be integers, got float 1.5 at position 0"),
        (torch.tensor([2.0, 3.0]), "be integers, got float 2.0 at position 0"),
        ([True, False], "be integers, got bool True at position 0"),
        (torch.tensor([True]), "be integers, got bool True at position 0"),
        ([torch.tensor(True)], "be integers, got Tensor tensor(True) at position 0"),
        ([1, [2, 3]], "be integers, got list [2, 3] at position 1"),
        ([[1, 2], [3, 4]], "be integers, got list [1, 2] at position 0"),
        (["a", 1], "be integers, got str 'a' at position 0"),
        (np.zeros((2, 2), dtype=np.int64), "form a 1-D sequence, got shape (2, 2)"),
        (7, "form a sequence of integers, got int 7"),
        ("abc", "form a sequence of integers, got str 'abc'"),
        ([2**70], "lie in the vocabulary, got 1180591620717411303424 at position 0"),
    ],
)
def test_token_id_array_refuses_what_is_not_integer_token_ids_naming_it(tokens, message):
    with pytest.raises((TypeError, ValueError), match=f"^token ids must {re.escape(message)}$"):
        token_id_array(tokens)


def test_requests_take_their_array_or_copy_it_when_they_grow():
    ids = np.array([3, 4, 5, 6], dtype=np.int64)
    scoring = Req(0, ids, SamplingParams(max_new_tokens=0), score_from=1)
    assert np.shares_memory(scoring.ids, ids)  # kept: a scoring request never grows
    assert scoring.match_ids.tolist() == [3, 4]
    generating = Req(1, ids, SamplingParams(max_new_tokens=2))
    assert not np.shares_memory(generating.ids, ids)
    generating.append(9)
    generating.extend(np.array([8, 7], dtype=np.int64))  # past its room: the array grows
    assert generating.ids.tolist() == generating.token_ids == [3, 4, 5, 6, 9, 8, 7]
    assert generating.generated == [9, 8, 7] and generating.num_generated == 3
    assert ids.tolist() == [3, 4, 5, 6]
    narrow = Req(2, np.array([1, 2], dtype=np.int32), SamplingParams(max_new_tokens=0))
    assert narrow.ids.dtype == np.int64 and narrow.ids.tolist() == [1, 2]
    assert Req(3, [1, 2], SamplingParams(max_new_tokens=1)).token_ids == [1, 2]


def test_the_lengths_follow_the_status_and_a_broken_invariant_raises():
    req = Req(0, list(range(10)), SamplingParams(max_new_tokens=3))
    assert req.status is RequestStatus.WAITING and req.extend_len == 10
    req.check()
    req.admit(row=4, cached_len=6, host_cached_len=2)
    assert req.status is RequestStatus.PREFILLING and req.computed_len == 6 and req.extend_len == 4
    req.check()
    req.computed_len, req.launched, req.launch_limit = 10, 1, 3  # the prompt computed, its first token out
    req.status = RequestStatus.DECODING
    req.check()
    req.computed_len = 12  # two decode steps, but only one more token launched
    with pytest.raises(IntegrityError, match="request 0 is DECODING"):
        req.check()
    req.launched = 3  # every token launched: not DECODING any more
    with pytest.raises(IntegrityError):
        req.check()
    req.status = RequestStatus.DRAINING
    req.check()
    req.cached_len = 13  # more cached than computed
    with pytest.raises(IntegrityError):
        req.check()
    failed = Req(1, [1, 2], SamplingParams())
    failed.fail("bad")
    assert (failed.status, failed.finish_reason, failed.error) == (RequestStatus.FAILED, "error", "bad")
    failed.check()
