"""The forward layout hybrid models will run in: hf_radix packs a step's rows into one `(1, N)` sequence;
state layers need rows as the batch dimension. A forward pre-hook on each state mixer that reshapes its
input `[1, B*T, C]` to `[B, T, C]` (every row adding T tokens) and a forward hook that reshapes the output
back run the model's own modules unchanged, and equal plain transformers row by row (fp32) through a
packed prefill and packed decode steps. Attention layers see the packed sequence with a block-diagonal
mask, as the radix attention does with its per-row metadata.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_radix.hybrid_layers import state_mixers, tiny_hybrid_model

pytestmark = pytest.mark.slow  # run once, on the newest transformers

warnings.filterwarnings("ignore")
ROWS, PROMPT, STEPS = 3, 7, 3
# Bamba too: its model builds `position_ids = arange(T)` when none are given, ignoring the cache length, so
# the reference passes positions explicitly (as hf_radix always does; without them it was off by 5e-3).
EXACT = ["qwen3_5", "qwen3_next", "nemotron_h", "granitemoehybrid", "falcon_h1", "lfm2", "bamba"]


def _rows_alone(model, prompts, new):
    """Each row alone through transformers: its prompt, then one token per step; last logits of each."""
    logits = []
    for row in range(prompts.shape[0]):
        cache = DynamicCache(config=model.config)
        length = prompts.shape[1]
        steps = [model(prompts[row:row + 1], position_ids=torch.arange(length)[None], past_key_values=cache,
                       use_cache=True).logits[0, -1]]
        steps += [model(new[row:row + 1, s:s + 1], position_ids=torch.tensor([[length + s]]),
                        past_key_values=cache, use_cache=True).logits[0, -1] for s in range(new.shape[1])]
        logits.append(torch.stack(steps))
    return torch.stack(logits)


def _rows_as_batch(model, rows: int):
    """Hooks that give every state mixer the packed rows as a `[rows, T, C]` batch, and undo it."""

    def to_rows(module, args, kwargs):
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        kwargs = {**kwargs, "hidden_states": hidden.reshape(rows, hidden.shape[1] // rows, hidden.shape[2])}
        for name in ("attention_mask", "mask"):
            if name in kwargs:
                kwargs[name] = None  # rows carry no padding in this layout
        return args[1:] if args else (), kwargs

    def to_packed(module, args, kwargs, out):
        first = out[0] if isinstance(out, tuple) else out
        first = first.reshape(1, -1, first.shape[-1])
        return (first, *out[1:]) if isinstance(out, tuple) else first

    handles = []
    for mixer in state_mixers(model).values():
        handles.append(mixer.register_forward_pre_hook(to_rows, with_kwargs=True))
        handles.append(mixer.register_forward_hook(to_packed, with_kwargs=True))
    return handles


def _block_mask(q_row, q_pos, k_row, k_pos):
    visible = (q_row[:, None] == k_row[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    mask = torch.full(visible.shape, torch.finfo(torch.float32).min)
    mask[visible] = 0.0
    return mask[None, None]


def _packed(model, prompts, new):
    rows, length = prompts.shape
    cache = DynamicCache(config=model.config)
    q_row, q_pos = torch.arange(rows).repeat_interleave(length), torch.arange(length).repeat(rows)
    k_row, k_pos = q_row, q_pos
    out = model(prompts.reshape(1, -1), position_ids=q_pos[None], past_key_values=cache, use_cache=True,
                attention_mask=_block_mask(q_row, q_pos, k_row, k_pos)).logits[0]
    steps = [out.reshape(rows, length, -1)[:, -1]]
    for s in range(new.shape[1]):
        q_row, q_pos = torch.arange(rows), torch.full((rows,), length + s)
        k_row, k_pos = torch.cat([k_row, q_row]), torch.cat([k_pos, q_pos])
        steps.append(model(new[:, s][None], position_ids=q_pos[None], past_key_values=cache, use_cache=True,
                           attention_mask=_block_mask(q_row, q_pos, k_row, k_pos)).logits[0])
    return torch.stack(steps, 1)


@pytest.mark.parametrize("family", EXACT)
@torch.no_grad()
def test_packed_rows_through_reshaping_hooks_equal_each_row_alone(family: str) -> None:
    model = tiny_hybrid_model(family)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (ROWS, PROMPT), generator=generator)
    new = torch.randint(3, vocab, (ROWS, STEPS), generator=generator)
    expected = _rows_alone(model, prompts, new)
    unhooked = _packed(model, prompts, new)  # rows' states run together: wrong
    assert (unhooked - expected).abs().max() > 1e-3
    handles = _rows_as_batch(model, ROWS)
    try:
        got = _packed(model, prompts, new)
    finally:
        for handle in handles:
            handle.remove()
    assert expected.abs().max() > 0.1  # the logits are not trivially small
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
