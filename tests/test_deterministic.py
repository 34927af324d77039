"""Deterministic mode on the CPU: the option's plumbing and refusals, the scoped overrides, and (Triton
interpreter, one subprocess) the invariant attention, row mean and a whole runner bit for bit.

The interpreter computes `tl.dot` with numpy's BLAS, whose result for a row depends on the row's place in
the tile; a GPU's matrix instructions compute every row alike. The interpreter checks therefore run with a
row-uniform dot (`_row_uniform_dot`), so what they test is the kernels' own order: key blocks, masks,
tiles.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from interpreter import interpreter_test, report_checks

from hf_radix.attention import make_backend
from hf_radix.forward import invariant_ops as inv
from hf_radix.options import EngineOptions
from hf_radix.scheduling.logprobs import target_logprobs


def test_option_default_and_conversion() -> None:
    assert EngineOptions().deterministic is False
    assert EngineOptions.convert("deterministic", "true") is True


def test_lm_eval_model_args_turn_the_mode_on() -> None:
    model_args = pytest.importorskip("hf_radix.lm_eval_backend.model_args", exc_type=ImportError)
    args = {"deterministic": "True", "page_size": "16"}
    assert model_args.engine_options(args) == {"deterministic": True, "page_size": 16}


def test_refusals() -> None:
    with pytest.raises(ValueError, match="Triton"):
        make_backend("torch", torch.device("cpu"), deterministic=True)
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="hybrid.*several devices"):
        inv.refuse_deterministic(plain, True, False, False)
    with pytest.raises(ValueError, match="MLA"):
        inv.refuse_deterministic(plain, False, True, True)
    inv.refuse_deterministic(plain, False, True, False)


def test_quantized_models_are_refused_before_any_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_radix
    from hf_radix import attention
    from hf_radix.tiny import tiny_model

    monkeypatch.setattr(attention, "triton_runs_on", lambda t: True)  # past the backend's own refusal
    model = tiny_model("llama", num_hidden_layers=1)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match="quantized models"):
        hf_radix.configure(model, deterministic=True, attn_backend="triton")
        hf_radix.get_engine(model)
    assert not forwards


def test_several_devices_are_refused_before_any_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose layers accelerate placed on two devices: refused before a state or K/V pool is made."""
    from types import SimpleNamespace

    import hf_radix
    from hf_radix import attention, engine
    from hf_radix.tiny import tiny_model

    monkeypatch.setattr(attention, "triton_runs_on", lambda t: True)  # past the backend's own refusal
    pools: list[int] = []
    monkeypatch.setattr(engine, "make_kv_pool", lambda *a, **k: pools.append(1))
    model = tiny_model("llama", num_hidden_layers=2)
    model.model.layers[1]._hf_hook = SimpleNamespace(execution_device=torch.device("cuda", 1))  # named only
    with pytest.raises(ValueError, match="several devices"):
        hf_radix.configure(model, deterministic=True, attn_backend="triton")
    assert not pools


def test_configure_refuses_off_triton() -> None:
    import hf_radix
    from hf_radix.tiny import tiny_model

    with pytest.raises(ValueError, match="deterministic=True needs the Triton"):
        hf_radix.configure(tiny_model("llama", num_hidden_layers=1), deterministic=True, attn_backend="torch")


def _active_modes() -> int:
    return len(torch.overrides._get_current_function_mode_stack())


def test_override_scoped_to_block_and_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    from hf_radix.kernels import triton_invariant_matmul as matmul

    counted = lambda x, *a, **k: calls.append(1) or F.linear(x, *a, **k)  # noqa: E731
    monkeypatch.setattr(matmul, "invariant_matmul", counted)
    monkeypatch.setattr(inv, "triton_runs_on", lambda t: True)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    other: list[int] = []
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), inv.invariant_ops():
        layer(x)
        thread = threading.Thread(target=lambda: other.append(_active_modes()) or layer(x))
        thread.start()
        thread.join()
        raise RuntimeError("boom")
    assert calls == [1] and other == [0]  # the other thread ran the plain linear
    assert _active_modes() == 0
    layer(x)  # with autograd again: the plain linear
    assert calls == [1]


def test_products_outside_linear_layers_are_refused() -> None:
    """A product the mode does not make invariant (a reduction outside `nn.Linear`) fails the forward with
    the reason; products without a reduction (rotary's outer product) and linear layers pass."""
    x, w = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with inv.invariant_ops():
        for call in (lambda: torch.bmm(x, w), lambda: x @ w, lambda: torch.einsum("bij,bjk->bik", x, w),
                     lambda: torch.addmm(torch.zeros(3, 5), x[0], w[0]), lambda: x[0].matmul(w[0])):
            with pytest.raises(ValueError, match="deterministic=True: the model computes .* outside its"):
                call()
        freqs = torch.randn(1, 4, 1) @ torch.arange(6.0)[None, None, :]  # Llama's rotary: no reduction
        assert freqs.shape == (1, 4, 6)
        assert torch.einsum("i,j->ij", torch.randn(3), torch.randn(4)).shape == (3, 4)
        assert torch.nn.Linear(4, 5)(x).shape == (2, 3, 5)


def test_linear_config_takes_the_largest_tiles_that_fill_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's launch config by shape, on Hopper-like candidates and 132 SMs (Llama-8B's shapes):
    the largest tiles that give most SMs a tile, row tiles no taller than needed, few rows the narrow tile."""
    from hf_radix.kernels import triton_invariant_matmul as matmul

    wide, mid, narrow, thin = ({"name": name, "BLOCK_M": m, "BLOCK_N": n} for name, m, n in (
        ("wide", 128, 256), ("mid", 128, 128), ("narrow", 64, 128), ("thin", 64, 32)))
    monkeypatch.setattr(matmul, "candidate_configs", lambda dtype, device: (wide, mid, narrow, thin))
    monkeypatch.setattr(matmul, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    picks = {(rows, columns): matmul.linear_config(rows, columns, torch.bfloat16, cuda)["name"]
             for rows in (1, 16, 64, 256, 2048, 8192) for columns in (1024, 4096, 14336)}
    assert {key for key, name in picks.items() if name == "narrow"} == {
        (1, 1024), (1, 4096), (1, 14336), (16, 14336), (64, 14336), (256, 4096)}
    assert {key for key, name in picks.items() if name == "thin"} == {
        (16, 1024), (16, 4096), (64, 1024), (64, 4096), (256, 1024)}
    assert {key for key, name in picks.items() if name == "mid"} == {(2048, 1024)}
    assert picks[256, 14336] == picks[8192, 1024] == picks[2048, 4096] == "wide"


def test_mean_left_alone_where_triton_cannot_run() -> None:
    x = torch.randn(4, 6)
    with inv.invariant_ops():
        assert torch.equal(x.mean(-1, keepdim=True), x.mean(-1, keepdim=True))
        assert x.mean(0).shape == (6,)


@pytest.mark.parametrize("n", [1, 3, 7, 8])
def test_logprobs_fixed_shape(n: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(10, 50)
    rows, targets = torch.randint(0, 10, (n,)), torch.randint(0, 50, (n,))
    plain = target_logprobs(logits, rows, targets, chunk_rows=4)
    fixed = target_logprobs(logits, rows, targets, chunk_rows=4, fixed_shape=True)
    torch.testing.assert_close(fixed[0], plain[0])
    assert torch.equal(fixed[1], plain[1])


# --------------------------------------------------------------------------------------------------------
# Interpreter checks (one TRITON_INTERPRET=1 subprocess)
# --------------------------------------------------------------------------------------------------------


def _row_uniform_dot() -> None:
    """`tl.dot` in the interpreter computing every row the same way (as GPU matrix instructions do)."""
    import triton.runtime.interpreter as interp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (np.ascontiguousarray(t.data.astype(np.float32)) for t in (a, b))  # einsum sums by strides
        out = np.einsum("ik,kj->ij", a, b, optimize=False)
        return interp.TensorHandle(out.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot


def _attention(rows, kc, vc, **kwargs) -> torch.Tensor:
    """Runs the invariant kernel on rows given as (context slots, new tokens, the row's queries)."""
    from hf_radix.kernels.triton_invariant_attention import invariant_attention

    qo, kv, kvp = [0], [], [0]
    for slots, new, _ in rows:
        qo.append(qo[-1] + new)
        kv += slots
        kvp.append(kvp[-1] + len(slots))
    q = torch.cat([qs[len(qs) - new:] for _, new, qs in rows])
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return invariant_attention(q, kc, vc, i32(qo), torch.tensor(kv), i32(kvp), 0.3, **kwargs)


def _reference(q, k, v, group: int, window: int | None) -> torch.Tensor:
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n = q.shape[0]
    scores = torch.einsum("nhd,lhd->hnl", q, k) * 0.3
    pos = torch.arange(n)
    hidden = pos[None, :] > pos[:, None]
    if window:
        hidden |= pos[:, None] - pos[None, :] >= window
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def _split_decode(slots, query, kc, vc, **kwargs) -> torch.Tensor:
    """The decode kernels' output for one row (its last query) over context ``slots``."""
    from hf_radix.kernels.triton_split_decode import split_decode_attention

    indptr = torch.tensor([0, len(slots)], dtype=torch.int32)
    return split_decode_attention(query[None], kc, vc, torch.tensor(slots), indptr, 0.3, **kwargs)[0]


def check_attention(window: int | None = None) -> dict:
    """Each token of a 75-token context (three pieces of 32 keys) decoded alone after a cached prefix (by the
    extend kernel and by the decode kernels), in one prefill, and in a batch with other rows: bit-identical,
    and equal to the reference."""
    _row_uniform_dot()
    torch.manual_seed(0)
    kc, vc = torch.randn(200, 2, 16), torch.randn(200, 2, 16)
    slots = torch.randperm(200)[:75].tolist()
    q = torch.randn(75, 4, 16)
    kw = {"sliding_window": window}
    whole = _attention([(slots, 75, q)], kc, vc, **kw)
    ref = _reference(q, kc[slots], vc[slots], 2, window)
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    for n in range(1, 76):
        alone = _attention([(slots[:n], 1, q[:n])], kc, vc, **kw)
        assert torch.equal(alone[0], whole[n - 1]), n
        assert torch.equal(_split_decode(slots[:n], q[n - 1], kc, vc, **kw), whole[n - 1]), n
    other = torch.randn(50, 4, 16)
    mixed = _attention([(list(range(50)), 20, other), (slots[:30], 9, q[:30]), (slots, 1, q)], kc, vc, **kw)
    assert torch.equal(mixed[20:29], whole[21:30]) and torch.equal(mixed[29], whole[74])
    return {"ok": True}


def check_row_mean() -> dict:
    from hf_radix.kernels.triton_row_mean import row_mean

    torch.manual_seed(0)
    x = torch.randn(9, 2500)
    out = row_mean(x, keepdim=True)
    torch.testing.assert_close(out, x.mean(-1, keepdim=True))
    with inv.invariant_ops():
        routed = x.pow(2).mean(-1, keepdim=True)
    assert torch.equal(routed, row_mean(x.pow(2), keepdim=True))
    for i in (0, 4, 8):
        assert torch.equal(row_mean(x[i : i + 1])[0], out[i, 0])
    return {"ok": True}


def check_matmul() -> dict:
    """The fixed-tile product: close to F.linear; a row's result the same bits alone, among 70 rows at
    every place of a tile, in the interpreter's tiles of another row count, and through both kernels."""
    from hf_radix.kernels.triton_invariant_matmul import invariant_matmul

    _row_uniform_dot()
    torch.manual_seed(0)
    for n, k, bias in ((48, 64, True), (37, 50, False)):  # even and uneven K, a partial column tile
        x, w = torch.randn(70, k), torch.randn(n, k)
        b = torch.randn(n) if bias else None
        out = invariant_matmul(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        for i in range(70):
            assert torch.equal(invariant_matmul(x[i : i + 1], w, b)[0], out[i]), (n, i)
        assert torch.equal(invariant_matmul(x[3:40].view(1, 37, k), w, b)[0], out[3:40])
        tiles = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)
        for programs in (0, 3):  # the tensor-memory kernel, one program a tile or persistent
            cfg = dict(tiles, TMA=True, NUM_PROGRAMS=programs)
            assert torch.equal(invariant_matmul(x, w, b, config=cfg), out)
            assert torch.equal(invariant_matmul(x[7:8], w, b, config=cfg)[0], out[7])
        with inv.invariant_ops():
            routed = F.linear(x, w, b)
        assert torch.equal(routed, out)
    return {"ok": True}


def check_refused_model() -> dict:
    """GPT-2 (Conv1D layers: `torch.addmm`, not `F.linear`): its first forward raises the reason (on a GPU,
    the runner's warm-up's) and leaves the cache consistent."""
    sys.path.insert(0, str(Path(__file__).parent))
    from model_matrix import tiny_matrix_model

    from hf_radix import RadixBatchRunner, SamplingParams

    model = tiny_matrix_model("GPT2")
    runner = RadixBatchRunner(model, deterministic=True, attn_backend="triton", cuda_graph=False,
                              warm_up=False)
    with pytest.raises(ValueError, match="computes addmm"):
        runner.run([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2), progress=False)
    runner.check_integrity()
    assert runner.engine.manager.num_rows == 0
    return {"ok": True}


def check_runner() -> dict:
    """A tiny Llama in deterministic mode: tokens and log-likelihoods alone, in a batch (its decode steps
    grouped: the rows share a 40-token prefix), in reverse order after a warm cache, with pages of 4 and
    prefill chunks of 16 tokens, through the decode graphs' padded batches and without grouped decode, bit
    for bit; the generated tokens' K/V, computed in grouped decode steps and read back from the cache,
    score as when computed in a prefill."""
    _row_uniform_dot()
    from hf_radix import RadixBatchRunner, SamplingParams
    from hf_radix.attention import InvariantBackend
    from hf_radix.forward.cuda_graph import DecodeGraphs, ExtendGraphs
    from hf_radix.paged_attention.grouped_decode import GroupedDecode
    from hf_radix.tiny import tiny_model

    model = tiny_model("llama", num_hidden_layers=2)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, 300, (40,), generator=gen).tolist()
    prompts = [prefix + torch.randint(5, 300, (3 + 5 * i,), generator=gen).tolist() for i in range(4)]
    params = SamplingParams(max_new_tokens=5)

    def runner(**options) -> RadixBatchRunner:
        options = {"cuda_graph": False, **options}
        return RadixBatchRunner(model, deterministic=True, attn_backend="triton", warm_up=False, **options)

    first = runner()
    assert isinstance(first.engine.backend, InvariantBackend)
    assert isinstance(first.engine.model_runner.eager_shared, GroupedDecode)
    assert ExtendGraphs(first.engine).context and DecodeGraphs(first.engine, 4).context
    alone = [first.run([p], params, progress=False)[0].token_ids for p in prompts[:2]]
    first.reset_cache()
    grouped_before = first.engine.model_runner.shared_prefix_steps
    batch = [o.token_ids for o in first.run(prompts, params, progress=False)]
    assert first.engine.model_runner.shared_prefix_steps - grouped_before == params.max_new_tokens - 1
    continued = [(p + out[:-2], out[-2:]) for p, out in zip(prompts, batch)]
    decoded_kv = first.loglikelihood(continued)  # contexts read from the cache: decode-computed K/V
    reverse = [o.token_ids for o in first.run(prompts[::-1], params, progress=False)][::-1]
    pairs = [(p[:-3], p[-3:]) for p in prompts]
    scores = first.loglikelihood(pairs)
    paged = runner(page_size=4, chunked_prefill_size=16)
    assert paged.engine.options.page_size == 4
    chunked = [o.token_ids for o in paged.run(prompts, params, progress=False)]
    assert alone == batch[:2] and batch == reverse == chunked
    assert [paged.loglikelihood([p])[0] for p in pairs[:2]] == scores[:2]
    paged.check_integrity()
    graphed = runner(cuda_graph=True)  # the decode graphs' padded batches (a padding row alone), eagerly
    graphs = graphed.model_runner.decode_graphs = DecodeGraphs(graphed.engine, 8, shared_prefix=True)
    graphed.reset_cache()
    assert [o.token_ids for o in graphed.run(prompts[:3], params, progress=False)] == batch[:3]
    assert isinstance(graphs.shared, GroupedDecode) and graphs.shared.steps == params.max_new_tokens - 1
    ungrouped = runner(shared_prefix=False)
    assert ungrouped.engine.model_runner.eager_shared is None
    ungrouped.reset_cache()
    assert [o.token_ids for o in ungrouped.run(prompts, params, progress=False)] == batch
    assert ungrouped.loglikelihood(continued) == decoded_kv  # decode-computed, per row
    ungrouped.reset_cache()
    assert ungrouped.loglikelihood(continued) == decoded_kv  # computed in a prefill
    return {"ok": True}


CHECKS = {
    "attention": check_attention,
    "attention_window": lambda: check_attention(window=9),
    "attention_long_window": lambda: check_attention(window=40),
    "row_mean": check_row_mean,
    "matmul": check_matmul,
    "runner": check_runner,
    "refused_model": check_refused_model,
}

test_triton_interpreter = pytest.mark.slow(interpreter_test(__file__, CHECKS))

if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)
