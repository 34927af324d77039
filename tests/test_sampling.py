"""The batched sampler: counter-based seeded noise, reproducible per request, fixed ops per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fresh_model, random_ids
from torch.utils._python_dispatch import TorchDispatchMode

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.sampling import Sampler, mix32, seed_keys

VOCAB = 50


class _CountOps(TorchDispatchMode):
    """Counts the aten ops (kernel launches, on a GPU) run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func) + (" to device" if "device" in kwargs else ""))
        return func(*args, **kwargs)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


Batch = list[tuple[int, SamplingParams]]


def _run(sampler: Sampler, logits_of: dict[int, torch.Tensor], batches: list[Batch]) -> dict[int, list[int]]:
    """Samples each batch (uid, params) in turn; returns every uid's tokens in order."""
    tokens: dict[int, list[int]] = {}
    for step, batch in enumerate(batches):
        logits = torch.stack([logits_of[uid][step % len(logits_of[uid])] for uid, _ in batch])
        out = sampler.sample(logits, [p for _, p in batch], [uid for uid, _ in batch]).tolist()
        for (uid, _), token in zip(batch, out):
            tokens.setdefault(uid, []).append(token)
    return tokens


def test_mix32_is_a_32_bit_hash_equal_in_numpy_and_torch():
    values = np.array([0, 1, 2, 12345, 2**31, 2**32 - 1], dtype=np.int64)
    hashed = mix32(values)
    assert np.array_equal(hashed, mix32(torch.from_numpy(values)).numpy())
    assert hashed.min() >= 0 and hashed.max() < 2**32 and len(set(hashed.tolist())) == len(values)
    assert not np.array_equal(seed_keys([1]), seed_keys([2]))
    assert np.array_equal(seed_keys([-1]), seed_keys([2**64 - 1]))


def test_seeded_rows_are_reproducible_whatever_the_batch_and_order():
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    logits_of = {uid: _logits(6, seed=uid) for uid in range(5)}
    logits_of[9] = logits_of[0]  # the same request content under another uid
    alone = _run(Sampler("cpu"), logits_of, [[(0, params)]] * 6)[0]
    other = SamplingParams(temperature=1.3, seed=3)
    mates = [(1, other), (2, SamplingParams()), (3, SamplingParams(temperature=0.5))]
    # batch-mates join and leave, the row moves: the request's tokens stay the same
    batches = [
        [(9, params)],
        [*mates, (9, params)],
        [(9, params), *mates[:1]],
        [mates[2], (9, params), mates[0]],
        [(9, params)],
        [mates[1], mates[0], (9, params)],
    ]
    sampler = Sampler("cpu")
    got = _run(sampler, logits_of, batches)
    assert got[9] == alone
    different = _run(Sampler("cpu"), logits_of, [[(0, SamplingParams(temperature=0.8, seed=8))]] * 6)[0]
    assert different != alone


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = _logits(4)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(top_k=1, temperature=2.0),
        SamplingParams(temperature=1.0),
    ]
    tokens = Sampler("cpu").sample(logits, params, [0, 1, 2, 3])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_drop_forgets_a_request_so_its_uid_starts_over():
    params = SamplingParams(temperature=1.0, seed=5)
    logits = _logits(1) / 3
    sampler = Sampler("cpu")
    first = [sampler.sample(logits, [params], [0]).item() for _ in range(8)]
    sampler.drop(0)
    again = [sampler.sample(logits, [params], [0]).item() for _ in range(8)]
    assert first == again and len(set(first)) > 1  # a new stream per step, the same stream per request


def test_frequencies_follow_the_distribution_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = logits.softmax(-1)[0]
    sampler = Sampler("cpu")
    draws = 4000
    rows = logits.expand(draws, -1)
    counts = torch.zeros(6)
    for chunk in range(4):  # every row its own seed; several steps each
        uids = list(range(chunk * draws, (chunk + 1) * draws))
        params = [SamplingParams(temperature=1.0, seed=u) for u in uids]
        for _ in range(2):
            counts += torch.bincount(sampler.sample(rows, params, uids), minlength=6)
    freq = counts / counts.sum()
    assert torch.allclose(freq, probs, atol=0.01), (freq, probs)
    top_k = [SamplingParams(temperature=1.0, top_k=2, seed=u) for u in range(draws)]
    assert set(sampler.sample(rows, top_k, list(range(draws))).tolist()) == {0, 1}
    nucleus = probs[0] + probs[1]  # the first two tokens cover top_p; the third starts beyond it
    top_p = [SamplingParams(temperature=1.0, top_p=float(nucleus) - 1e-3, seed=u) for u in range(draws)]
    assert set(sampler.sample(rows, top_p, list(range(draws, 2 * draws))).tolist()) == {0, 1}


@pytest.mark.parametrize("kind", ["seeded", "unseeded", "mixed"])
def test_a_step_runs_the_same_ops_whatever_the_batch(kind: str, monkeypatch):
    def params(i: int) -> SamplingParams:
        seeded = kind == "seeded" or (kind == "mixed" and i % 2)
        greedy = kind == "mixed" and i % 3 == 0
        return SamplingParams(temperature=0.0 if greedy else 0.7, top_p=0.9, seed=i if seeded else None)

    staged = []
    original = Sampler._stage
    monkeypatch.setattr(Sampler, "_stage", lambda self, *a: staged.append(1) or original(self, *a))
    counts = set()
    for rows in (4, 9, 64):
        sampler = Sampler("cpu")
        batch = [params(i) for i in range(rows)]
        logits = _logits(rows)
        sampler.sample(logits, batch, list(range(rows)))  # stages the batch
        with _CountOps() as ops:
            sampler.sample(logits, batch, list(range(rows)))
        counts.add(len(ops.ops))
        assert not any("lift_fresh" in op or "to device" in op for op in ops.ops)  # nothing staged per step
    assert len(counts) == 1 and len(staged) == 3


def test_runner_seeded_completion_is_the_same_in_any_batch_and_order():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=2048)
    gen = torch.Generator().manual_seed(8)
    target = random_ids(gen, 10)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=42)
    alone = runner.run([target], params)[0].token_ids
    others = [random_ids(gen, n) for n in (3, 14, 6)]
    # batch-mates finishing at other steps
    mates = [SamplingParams(max_new_tokens=n, temperature=0.7, seed=n) for n in (2, 9, 5)]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        prompts = [(others + [target])[i] for i in order]
        batch_params = [(mates + [params])[i] for i in order]
        outs = runner.run(prompts, batch_params)
        assert outs[order.index(3)].token_ids == alone
    runner.check_integrity()
