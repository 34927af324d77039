"""The fused RMSNorm / rotary-embedding kernels and the swap that puts them into captured graphs.

The kernels run under the Triton interpreter (one subprocess, `tests/interpreter.py`): the rotary embedding
must equal HF's bit for bit, the norm up to the order of its sum, and whole tiny models must give the
same logits with the swap as without. The swap itself (what is swapped, that all of it is restored) is
checked in-process.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from interpreter import interpreter_test, report_checks

pytest.importorskip("triton")

from transformers.models.llama import modeling_llama  # noqa: E402

from hf_radix.forward import fused_ops  # noqa: E402
from hf_radix.tiny import tiny_model  # noqa: E402

# norm modules swapped per tiny architecture (2 layers): 2 per layer + the final one (+ q/k norms in Qwen3);
# gemma2's norm is `1 + weight`, not Llama's, so only its rotary embedding is swapped
SWAPPED_NORMS = {"llama": 5, "qwen2": 5, "qwen3": 9, "mistral": 5, "gemma2": 0}


@pytest.mark.parametrize("arch", list(SWAPPED_NORMS))
def test_swaps_llama_style_code_and_restores_it(arch: str) -> None:
    model = tiny_model(arch)
    namespace = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original_rope = namespace.apply_rotary_pos_emb
    ids = torch.randint(2, 384, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
    with fused_ops.fused_norm_and_rope(model) as swapped, torch.inference_mode():
        assert swapped == SWAPPED_NORMS[arch] + 1
        assert namespace.apply_rotary_pos_emb is not original_rope
        assert sum("forward" in vars(m) for m in model.modules()) == SWAPPED_NORMS[arch]
        assert torch.equal(model(input_ids=ids).logits, plain)  # CPU tensors: HF's own code runs
    assert namespace.apply_rotary_pos_emb is original_rope
    assert not any("forward" in vars(m) for m in model.modules())


def test_restores_when_the_block_raises() -> None:
    model = tiny_model("llama")
    original = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="boom"), fused_ops.fused_norm_and_rope(model):
        raise RuntimeError("boom")
    assert modeling_llama.apply_rotary_pos_emb is original
    assert not any("forward" in vars(m) for m in model.modules())


def test_leaves_instance_level_forwards_alone() -> None:
    model = tiny_model("llama")
    hooked = model.model.norm
    hooked.forward = lambda x: x  # what an accelerate hook looks like
    with fused_ops.fused_norm_and_rope(model) as swapped:
        assert swapped == SWAPPED_NORMS["llama"]  # 4 norms + the rotary embedding
    assert hooked.forward(torch.ones(1)).item() == 1.0


def test_rope_shapes_the_kernel_does_not_take_fall_back(monkeypatch) -> None:
    q, k = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    cos = torch.zeros(1, 3, 16)
    assert not fused_ops._rope_fits(q, k, cos, cos)  # CPU tensors outside the interpreter
    monkeypatch.setattr(fused_ops, "triton_runs_on", lambda tensor: True)
    assert fused_ops._rope_fits(q, k, cos, cos)
    assert not fused_ops._rope_fits(q, k, cos.half(), cos.half())
    assert not fused_ops._rope_fits(q[..., :12], k[..., :12], cos[..., :12], cos[..., :12])  # not 2^n
    assert not fused_ops._rope_fits(q, k, cos.expand(2, 3, 16), cos)  # strides differ
    assert not fused_ops._rope_fits(q.transpose(2, 3), k, cos, cos)


# --------------------------------------------------------------------------------------------------------
# Interpreter checks
# --------------------------------------------------------------------------------------------------------


def _check_rope(dtype: torch.dtype, broadcast: bool) -> dict[str, Any]:
    from hf_radix.kernels.triton_norm_rope import rotary_embedding

    gen = torch.Generator().manual_seed(0)
    # [B, T, heads, D] transposed, as HF's attention makes them
    q = torch.randn(2, 5, 4, 16, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(2, 5, 2, 16, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(1 if broadcast else 2, 5, 16, generator=gen).to(dtype) for _ in range(2))
    ref = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    out = rotary_embedding(q, k, cos, sin)
    same = all(torch.equal(o, r) and o.stride() == r.stride() for o, r in zip(out, ref, strict=True))
    return {"ok": same}


def _check_norm(dtype: torch.dtype, weight_dtype: torch.dtype) -> dict[str, Any]:
    from hf_radix.kernels.triton_norm_rope import rms_norm

    torch.manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(48, eps=1e-5).to(weight_dtype)
    norm.weight.data.normal_()
    x = torch.randn(3, 7, 48).to(dtype)
    ref, out = norm(x), rms_norm(x, norm.weight, 1e-5)
    err = float((out.double() - ref.double()).abs().max())
    tol = 1e-6 if ref.dtype == torch.float32 and dtype == torch.float32 else 1e-2
    return {"ok": out.dtype == ref.dtype and out.shape == ref.shape and err <= tol, "err": err}


def _check_model(arch: str) -> dict[str, Any]:
    model = tiny_model(arch)
    ids = torch.randint(2, 384, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        with fused_ops.fused_norm_and_rope(model) as swapped:
            out = model(input_ids=ids).logits
    err = float((out - ref).abs().max())
    return {"ok": swapped == SWAPPED_NORMS[arch] + 1 and err <= 1e-5, "err": err}


CHECKS = {
    "rope_fp32": lambda: _check_rope(torch.float32, broadcast=False),
    "rope_fp16_broadcast_cos": lambda: _check_rope(torch.float16, broadcast=True),
    "norm_fp32": lambda: _check_norm(torch.float32, torch.float32),
    "norm_fp16": lambda: _check_norm(torch.float16, torch.float16),
    "norm_fp16_input_fp32_weight": lambda: _check_norm(torch.float16, torch.float32),
    **{f"model_{arch}": lambda arch=arch: _check_model(arch) for arch in ("llama", "qwen3", "gemma2")},
}


test_fused_kernels_under_the_interpreter = interpreter_test(__file__, CHECKS)


if __name__ == "__main__" and "--interp" in sys.argv:
    report_checks(CHECKS)


# --------------------------------------------------------------------------------------------------------
# Eager radix forwards on CUDA (GPU only)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eager_radix_forwards_run_fused_and_score_the_same(monkeypatch) -> None:
    """With fused_ops on, prefill/scoring forwards swap in the fused kernels and score as without them."""
    import hf_radix
    from hf_radix import engine as engine_module

    model = tiny_model("llama").cuda()
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(2, 384, (40,), generator=gen).tolist()
    pairs = [(prefix + torch.randint(2, 384, (5,), generator=gen).tolist(), [7, 8, 9]) for _ in range(6)]
    swaps = []
    real = engine_module.fused_norm_and_rope

    def counting(m):
        swaps.append(m)
        return real(m)

    monkeypatch.setattr(engine_module, "fused_norm_and_rope", counting)
    scores = {}
    for fused in (True, False):
        hf_radix.configure(model, fused_ops=fused, attn_backend="triton", max_total_tokens=4096)
        runner = hf_radix.RadixBatchRunner(model, cuda_graph=False)
        runner.reset_cache()
        before = len(swaps)
        scores[fused] = [logprob for logprob, _ in runner.loglikelihood(pairs, progress=False)]
        runner.check_integrity()
        assert (len(swaps) > before) == fused
    with torch.inference_mode():
        ids = torch.tensor([pairs[0][0] + pairs[0][1]], device="cuda")
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(pairs[0][0])
    ref = sum(float(logp[n - 1 + i, t]) for i, t in enumerate(pairs[0][1]))
    assert scores[True] == pytest.approx(scores[False], abs=1e-4)
    assert scores[True][0] == pytest.approx(ref, abs=1e-4)
