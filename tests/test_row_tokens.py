"""RowTokens (a generate call's rows' token ids) against lists, and the host copy of a step's inputs."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.scheduling.row_tokens import RowTokens, host_inputs

_rows = st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=40), min_size=1, max_size=5)


@settings(max_examples=80, deadline=None)
@given(prompts=_rows, steps=st.lists(st.integers(1, 3), max_size=12), room=st.integers(1, 8), data=st.data())
def test_rows_follow_lists_through_appends_and_growth(prompts, steps, room, data) -> None:
    tokens = RowTokens([np.asarray(p, dtype=np.int64) for p in prompts], room=room)
    model = [list(p) for p in prompts]
    earlier = [(tokens.row(b), list(model[b])) for b in range(len(model))]
    for k in steps:
        new = np.asarray(data.draw(st.lists(st.lists(st.integers(0, 2**40), min_size=k, max_size=k),
                                            min_size=len(model), max_size=len(model))), dtype=np.int64)
        tokens.append(new)
        for b, ids in enumerate(new.tolist()):
            model[b].extend(ids)
        for b, row in enumerate(model):
            assert tokens.length(b) == len(row)
            assert tokens.row(b).dtype == np.int64 and tokens.row(b).tolist() == row
    for view, before in earlier:  # views taken before the appends (and any growth) are unchanged
        assert view.tolist() == before


def test_host_inputs_give_int64_ids_and_a_bool_mask() -> None:
    """Generate's new positions (`fresh` of them) and the attention mask's last `fresh` columns."""
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]], dtype=torch.int32)
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    host_ids, host_mask = host_inputs(ids, mask, 3)
    assert host_ids.dtype == np.int64 and host_ids.tolist() == [[5, 6, 7], [0, 8, 9]]
    assert host_mask.dtype == bool and host_mask.tolist() == [[True, True, True], [False, True, True]]
    host_ids, host_mask = host_inputs(ids[:, 1:], mask, 2)
    assert host_ids.tolist() == [[6, 7], [8, 9]] and host_mask.tolist() == [[True, True], [True, True]]
    assert host_inputs(ids, None, 3)[1] is None
    assert host_inputs(None, mask, 3)[0] is None
