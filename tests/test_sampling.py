"""The batched sampler: the top-k / top-p rule, counter-based seeded noise, reproducible per request,
fixed ops per step; the Triton kernel (under the interpreter, in one subprocess) against the torch path.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest
import torch
from conftest import fresh_model, random_ids
from interpreter import assert_check_passed, interpreter_report, report_checks
from torch.utils._python_dispatch import TorchDispatchMode

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.scheduling.sampling import Sampler, kept_threshold, mix32, sample_rows_torch, seed_keys

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


# -- the kept set: the rule straight from its definition (float64), the torch path, the kernel -------------

TOP_K_OFF = np.iinfo(np.int64).max


def reference_kept(x: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, bool]:
    """The kept tokens of one row `x` by the module's rule, from its definition in float64, and whether
    fp32 sums could decide otherwise (some value's share of mass at or above it within 1e-5 of top_p)."""
    xs = x.double()
    kth = xs.sort(descending=True).values[min(top_k, len(xs)) - 1]
    in_top_k = xs >= kth
    if top_p >= 1.0:
        return in_top_k, False
    weight = (xs - xs.max()).exp() * in_top_k
    values = xs[in_top_k].unique()
    share = (weight[None, :] * (xs[None, :] >= values[:, None])).sum(1) / weight.sum()
    threshold = values[share >= top_p].max()  # the largest value whose tokens at or above reach top_p
    return in_top_k & (xs >= threshold), bool(((share - top_p).abs() < 1e-5).any())


def rule_case(rows: int, vocab: int, seed: int, greedy_every: int = 0) -> dict[str, torch.Tensor]:
    """Random rows with ties (every third row on a 0.5 grid), masked (-inf) entries, all kinds of top-k
    and top-p (near 0 and 1 included); with `greedy_every`, every such row is greedy (temperature 0)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::3] = (logits[::3] * 2).round() / 2
    logits[1::5, : vocab // 4] = float("-inf")

    def pick(options: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(options, dtype=dtype)[torch.randint(len(options), (rows,), generator=gen)]

    inv_temperature = 1.0 / pick([0.3, 0.7, 1.0, 1.8], torch.float32)
    if greedy_every:
        inv_temperature[::greedy_every] = 0.0
    top_k = pick([1, 2, 5, 17, vocab - 1, vocab, vocab + 7, TOP_K_OFF, TOP_K_OFF], torch.int64)
    top_p = pick([1e-6, 0.05, 0.3, 0.5, 0.9, 0.97, 0.999, 0.999999, 1.0, 1.0], torch.float32)
    keys = torch.from_numpy(seed_keys(torch.randint(1 << 62, (rows,), generator=gen).tolist()))
    steps = torch.randint(1000, (rows,), generator=gen)
    return dict(logits=logits, inv_temperature=inv_temperature, top_k=top_k, top_p=top_p, seed_keys=keys,
                steps=steps)


def kept_mismatches(x: torch.Tensor, kept: torch.Tensor, case: dict[str, torch.Tensor]) -> tuple[list, int]:
    """Rows whose kept set `kept` differs from the reference's (ambiguous rows skipped); rows checked."""
    wrong, checked = [], 0
    for row in range(x.shape[0]):
        want, ambiguous = reference_kept(x[row], int(case["top_k"][row]), float(case["top_p"][row]))
        if not ambiguous:
            checked += 1
            if not torch.equal(kept[row], want):
                wrong.append(row)
    return wrong, checked


def test_torch_kept_set_is_the_rule_for_random_rows_ties_and_extreme_top_p():
    case = rule_case(rows=300, vocab=97, seed=0)
    x = case["logits"] * case["inv_temperature"][:, None]
    kept = x >= kept_threshold(x, case["top_k"], case["top_p"])
    wrong, checked = kept_mismatches(x, kept, case)
    assert not wrong and checked > 250, (wrong, checked)
    assert kept.sum(1).min() >= 1 and (kept.sum(1) == 1).any() and (kept.sum(1) == 97).any()


def test_torch_path_samples_from_the_kept_set_and_greedy_rows_take_the_argmax():
    case = rule_case(rows=64, vocab=97, seed=1, greedy_every=4)
    tokens = sample_rows_torch(**case)
    x = case["logits"] * case["inv_temperature"][:, None]
    for row, token in enumerate(tokens.tolist()):
        if case["inv_temperature"][row] == 0:
            assert token == int(case["logits"][row].argmax())
        else:
            assert reference_kept(x[row], int(case["top_k"][row]), float(case["top_p"][row]))[0][token]


def test_filtered_frequencies_follow_the_renormalized_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = torch.tensor([2.0, 1.0, 0.5]).exp()
    probs /= probs.sum()  # top_k=4 keeps 4 tokens; top_p=0.8 of their mass: the first 3 (0.58, 0.79, 0.92)
    draws = 8000
    sampler = Sampler("cpu")
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=0.8, seed=u) for u in range(draws)]
    counts = torch.bincount(sampler.sample(logits.expand(draws, -1), params, list(range(draws))), minlength=6)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3] / draws, probs, atol=0.02), (counts, probs)


# -- the Triton kernel on the CPU (interpreter subprocess) and for sm_90 (compiler only) --------------------


def _pin_rows(case: dict[str, torch.Tensor]) -> None:
    """Rows 0-2 of `case` become tie cases across chunks: a greedy row whose maximum sits in its last two
    chunks only, a top-k 1 row sampling among those ties, a constant row under top-p (all kept); rows 5
    and 9 sample with temperature alone and with top-k 5 alone."""
    case["top_k"][[5, 9]] = torch.tensor([TOP_K_OFF, 5])
    case["top_p"][[5, 9]] = 1.0
    vocab = case["logits"].shape[1]
    case["logits"][:3] = (case["logits"][:3] * 2).round() / 2
    case["logits"][:2, [vocab // 2, vocab - 3]] = 20.0
    case["logits"][2] = 1.5
    case["inv_temperature"][:3] = torch.tensor([0.0, 0.8, 1.2])
    case["top_k"][:3] = torch.tensor([TOP_K_OFF, 1, TOP_K_OFF])
    case["top_p"][:3] = torch.tensor([1.0, 1.0, 0.5])


def _interp_kernel_matches_torch() -> dict[str, Any]:
    from hf_radix.kernels.triton_sampling import sample_rows

    case = rule_case(rows=12, vocab=600, seed=2, greedy_every=4)
    _pin_rows(case)
    mismatched, steps_ok, repeated = [], True, True
    # blocks of 64 columns, chunks of 4 blocks: 3 programs per row, the last chunk and block partial
    for dtype, digit_bits in ((torch.float32, 4), (torch.float16, 8)):  # fp16: the kernel reads any float
        case["logits"] = case["logits"].to(dtype)
        want = sample_rows_torch(**case)
        before = case["steps"].clone()
        got = sample_rows(**case, block=64, chunk=256, digit_bits=digit_bits)
        sampled = case["inv_temperature"] != 0
        steps_ok &= torch.equal(case["steps"], before + sampled)
        mismatched += [(str(dtype), r) for r in (got != want).nonzero().flatten().tolist()]
        if dtype == torch.float16:  # the same call again: the same tokens (no atomics, no races)
            case["steps"] = before.clone()
            repeated = torch.equal(sample_rows(**case, block=64, chunk=256, digit_bits=digit_bits), got)
    return {"ok": not mismatched and steps_ok and repeated, "mismatched": mismatched,
            "steps_advanced": steps_ok, "repeated": repeated}


def _interp_kernel_kept_set_is_the_rule() -> dict[str, Any]:
    from hf_radix.kernels.triton_sampling import sample_rows

    report = {}
    for digit_bits, rows, vocab in ((4, 16, 96), (2, 6, 64)):
        case = rule_case(rows=rows, vocab=vocab, seed=3)
        x = case["logits"] * case["inv_temperature"][:, None]
        _, floors = sample_rows(**case, digit_bits=digit_bits, block=16, chunk=32, num_warps=1,
                                with_floors=True)
        wrong, checked = kept_mismatches(x, _order_keys(x) >= floors[:, None], case)
        report[digit_bits] = {"wrong": wrong, "checked": checked, "rows": rows}
    return {"ok": all(not r["wrong"] and r["checked"] >= 0.6 * r["rows"] for r in report.values()), **report}


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 order keys of fp32 `x`, as the kernel makes them (-0 as +0)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits ^ 0xFFFFFFFF, bits | (1 << 31))


def _interp_kernel_frequencies() -> dict[str, Any]:
    from hf_radix.kernels.triton_sampling import sample_rows

    draws = 120
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(draws, -1).contiguous()
    probs = torch.tensor([2.0, 1.0, 0.5]).exp()
    probs /= probs.sum()
    tokens = sample_rows(logits, torch.ones(draws), torch.full((draws,), 4), torch.full((draws,), 0.8),
                         torch.from_numpy(seed_keys(range(draws))), torch.zeros(draws, dtype=torch.int64),
                         digit_bits=8)  # 4 passes per threshold: the interpreter is slow
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = float(((counts[:3] - draws * probs) ** 2 / (draws * probs)).sum())
    return {"ok": counts[3:].sum() == 0 and chi2 < 13.8, "counts": counts.tolist(), "chi2": chi2}  # p=0.001


def _interp_sampler_on_the_kernel() -> dict[str, Any]:
    """The Sampler runs the kernel under the interpreter: per-request reproducibility, the torch tokens."""
    import hf_radix.scheduling.sampling as sampling

    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    logits_of = {uid: _logits(4, seed=uid) for uid in range(4)}
    logits_of[9] = logits_of[0]
    mates = [(1, SamplingParams(temperature=1.3, seed=3)), (2, SamplingParams()),
             (3, SamplingParams(temperature=1.0, top_p=0.5, seed=11))]
    # the last two batches: no row uses top-k (its launches are left out), then neither top-k nor top-p
    batches = [[(9, params)], [*mates, (9, params)], [(9, params), mates[0]],
               [mates[2], (9, params), mates[1]], [mates[2], mates[0]], [mates[1], mates[0]]]
    alone = _run(Sampler("cpu"), logits_of, [[(0, params)]] * 4)[0]
    mixed = _run(Sampler("cpu"), logits_of, batches)
    sampling.triton_runs_on = lambda tensor: False
    torch_path = _run(Sampler("cpu"), logits_of, batches)
    return {"ok": mixed[9] == alone and mixed == torch_path, "alone": alone, "mixed": mixed,
            "torch": torch_path}


INTERP_CHECKS = {
    "kernel_matches_torch": _interp_kernel_matches_torch,
    "kernel_kept_set_is_the_rule": _interp_kernel_kept_set_is_the_rule,
    "kernel_frequencies": _interp_kernel_frequencies,
    "sampler_on_the_kernel": _interp_sampler_on_the_kernel,
}


@pytest.fixture(scope="module")
def interp_report() -> dict[str, Any]:
    return interpreter_report(__file__)


@pytest.mark.slow  # the kernels alone: no transformers version changes them
@pytest.mark.parametrize("name", list(INTERP_CHECKS))
def test_sampling_kernel_under_the_interpreter(interp_report: dict[str, Any], name: str):
    assert_check_passed(interp_report, name)


@pytest.mark.slow
@pytest.mark.parametrize("kernel_name, extra", [
    ("_block_max_kernel", {}), ("_digit_kernel", {"MASS": False}), ("_digit_kernel", {"MASS": True}),
    ("_gumbel_max_kernel", {}), ("_pick_kernel", {}),
])
def test_sampling_kernels_compile_for_sm90(kernel_name: str, extra: dict):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_radix.kernels import FP_FUSION, triton_sampling

    kernel = getattr(triton_sampling, kernel_name)
    pointers = {"Logits": "*bf16", "BlockKey": "*i32", "BestIndex": "*i32"}
    pointers.update({name: "*fp32" for name in ("InvTemperature", "TopP", "ChunkMax", "Partials", "Goal",
                                                 "BestValue")})
    pointers.update({name: "*i64" for name in ("TopK", "Key0", "Key1", "Steps", "State", "Out")})
    sizes = dict(BLOCK=64, BLOCKS_PER_CHUNK=32, CHUNKS=64, DIGIT_BITS=4, **extra)  # the defaults
    constexprs = {k: v for k, v in sizes.items() if k in kernel.arg_names}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 1, "num_stages": 1,  # fusion as launched
                                       "enable_fp_fusion": FP_FUSION and kernel_name != "_gumbel_max_kernel"})
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_torch_at_full_vocabulary_on_gpu():
    from hf_radix.kernels.triton_sampling import sample_rows

    case = {k: v.cuda() for k, v in rule_case(rows=64, vocab=128_256, seed=4, greedy_every=8).items()}
    mismatched = 0
    for dtype in (torch.bfloat16, torch.float32):
        case["logits"] = case["logits"].to(dtype)
        for _ in range(2):
            want = sample_rows_torch(**case)
            before = case["steps"].clone()
            got = sample_rows(**case)  # advances the steps: new noise each time
            mismatched += int((got != want).sum())
            case["steps"], advanced = before.clone(), case["steps"].clone()
            assert torch.equal(sample_rows(**case), got)  # no atomics: partials are summed in a fixed order
            assert torch.equal(case["steps"], advanced)
    # equal but where a token sits within fp32 rounding of the nucleus boundary (sums in another order)
    assert mismatched <= 1, mismatched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_staged_step_launches_the_same_kernels_whatever_the_batch_on_gpu():
    from torch.profiler import ProfilerActivity, profile

    launched = set()
    for rows in (48, 200):
        logits = torch.randn(rows, 4096, device="cuda")
        sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=40)
        params = [dataclasses.replace(sampled, seed=i) if i % 3 else SamplingParams() for i in range(rows)]
        sampler = Sampler(logits.device)
        first = sampler.sample(logits, params, list(range(rows)))  # stages the batch
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            second = sampler.sample(logits, params, list(range(rows)))
            torch.cuda.synchronize()
        launched.add(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
        greedy = torch.tensor([i % 3 == 0 for i in range(rows)], device="cuda")
        assert torch.equal(first[greedy], logits.argmax(-1)[greedy])
        assert torch.equal(second[greedy], first[greedy])
        assert not torch.equal(first[~greedy], second[~greedy])  # the next step's noise
    assert launched == {3 + 64 // 4}, launched  # block maxima, 8 top-k and 8 top-p digits, Gumbel-max, pick


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_searches_no_row_uses_are_not_launched_and_change_no_token_on_gpu():
    from torch.profiler import ProfilerActivity, profile

    from hf_radix.kernels.triton_sampling import sample_rows

    for top_k_rows, top_p_rows, launches in ((False, True, 11), (True, False, 12), (False, False, 4)):
        case = {k: v.cuda() for k, v in rule_case(rows=64, vocab=128_256, seed=5, greedy_every=8).items()}
        case["logits"] = case["logits"].to(torch.bfloat16)
        if not top_k_rows:
            case["top_k"].fill_(TOP_K_OFF)
        if not top_p_rows:
            case["top_p"].fill_(1.0)
        before = case["steps"].clone()
        want = sample_rows(**case)
        case["steps"] = before.clone()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = sample_rows(**case, top_k_rows=top_k_rows, top_p_rows=top_p_rows)
            torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) == launches


if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks({name: check for name, check in INTERP_CHECKS.items()})
