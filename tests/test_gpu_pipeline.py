"""End-to-end on the GPU: Triton kernels, CUDA store kernel and decode CUDA graphs vs plain `generate`."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.tiny import tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("qwen2", 16), ("gemma2", 4)])
def test_runner_greedy_matches_generate_on_gpu(arch: str, page_size: int, cuda_graph: bool):
    model = tiny_model(arch).cuda()
    runner = RadixBatchRunner(
        model,
        page_size=page_size,
        max_total_tokens=4096,
        attn_backend="triton",
        cuda_graph=cuda_graph,
        max_running_requests=24,
        chunked_prefill_size=64,
    )
    assert runner.engine.backend.name == "triton"
    gen = torch.Generator().manual_seed(0)
    system = random_ids(gen, 70)
    prompts = [system + random_ids(gen, n) for n in (1, 5, 17, 30)] + [random_ids(gen, 9), [5]] * 2
    outs = runner.run(prompts, SamplingParams(max_new_tokens=10))
    runner.check_integrity()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(model, prompt, 10)
    again = runner.run(prompts, SamplingParams(max_new_tokens=10))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.cached_tokens > 0 for o in again if len(o.prompt_token_ids) > page_size + 1)
    runner.check_integrity()


def test_generate_radix_matches_default_on_gpu():
    model = tiny_model("llama").cuda()
    hf_radix.configure(model, max_total_tokens=4096, attn_backend="triton")
    gen = torch.Generator().manual_seed(1)
    rows = [random_ids(gen, n) for n in (12, 40, 25)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
    mask = (
        torch.arange(width, device="cuda")[None, :]
        >= torch.tensor([width - len(r) for r in rows], device="cuda")[:, None]
    ).long()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for _ in range(2):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="radix",
        )
        assert torch.equal(out, ref)
    assert hf_radix.cache_stats(model)["cached_tokens"] > 0
    hf_radix.get_engine(model).check_integrity()
