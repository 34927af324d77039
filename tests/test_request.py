"""Prompt conversion and requests built from token-id arrays: the same tokens as the element-wise path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_radix.request import Req, token_id_array
from hf_radix.sampling import SamplingParams


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 0, 7],
        [np.int64(3), np.int32(9)],
        np.array([4, 2, 1], dtype=np.int32),
        np.array([250, 3], dtype=np.uint8),
        torch.tensor([8, 1, 6]),
        [2.0, 7.9],  # floats go through int(), as they always did
        [True, False],
        np.array([1.5, 2.5]),
        [],
    ],
)
def test_token_id_array_equals_int_per_element(tokens):
    values = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    got = token_id_array(tokens)
    assert got.dtype == np.int64 and got.ndim == 1
    assert got.tolist() == [int(t) for t in values]


@pytest.mark.parametrize(
    "tokens", [[1, [2, 3]], [[1, 2], [3, 4]], ["a", 1], np.zeros((2, 2), dtype=np.int64)]
)
def test_token_id_array_refuses_what_int_refuses(tokens):
    with pytest.raises((TypeError, ValueError)):
        token_id_array(tokens)


def test_requests_take_their_array_or_copy_it_when_they_grow():
    ids = np.array([3, 4, 5, 6], dtype=np.int64)
    scoring = Req(0, ids.tolist(), SamplingParams(max_new_tokens=0), score_from=1, ids_array=ids)
    assert np.shares_memory(scoring.ids, ids)  # kept: a scoring request never grows
    assert scoring.match_ids.tolist() == [3, 4]
    generating = Req(1, ids.tolist(), SamplingParams(max_new_tokens=2), ids_array=ids)
    assert not np.shares_memory(generating.ids, ids)
    generating.append(9)
    assert generating.ids.tolist() == generating.token_ids == [3, 4, 5, 6, 9]
    assert ids.tolist() == [3, 4, 5, 6]
    narrow = Req(2, [1, 2], SamplingParams(max_new_tokens=0), ids_array=np.array([1, 2], dtype=np.int32))
    assert narrow.ids.dtype == np.int64 and narrow.ids.tolist() == [1, 2]
    with pytest.raises(ValueError, match="ids_array"):
        Req(3, [1, 2, 3], SamplingParams(max_new_tokens=1), ids_array=ids)
