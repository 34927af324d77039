"""End-to-end on the GPU: Triton kernels, CUDA store kernel and decode CUDA graphs vs plain `generate`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_ids

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.paged_attention.forward_batch import StepRows
from hf_radix.tiny import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
    if cuda_graph:  # prefill rounds of <= 64 tokens replay extend graphs
        assert runner.model_runner.extend_graphs.replays > 0
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
    engine = hf_radix.get_engine(model)
    engine.check_integrity()
    decode, extend = engine.model_runner.decode_graphs, engine.model_runner.extend_graphs
    assert extend.replays == 1 and decode.replays == 2 * 7 + 1  # the second call's prompts were cached
    assert decode.prepared_replays == 2 * 7  # every decode step's inputs loaded during the step before


def test_prepared_decode_inputs_serve_only_their_own_step_on_gpu():
    model = tiny_model("llama").cuda()
    engine = hf_radix.configure(model, max_total_tokens=4096, attn_backend="triton")
    graphs = engine.model_runner.decode_graphs
    manager = engine.manager
    rows = []
    for first in (3, 4):
        handle = manager.match([first] * 40)
        manager.lock(handle)
        rows.append(manager.open_row(handle))
    manager.allocate(rows, [40, 40])

    def step(prefix_lens: list[int], ids: list[int]) -> StepRows:
        return StepRows.of(rows, prefix_lens, [np.array([i]) for i in ids])

    def run(s: StepRows) -> torch.Tensor:
        return graphs.run(s).clone()

    a, b = step([20, 30], [11, 12]), step([21, 30], [11, 12])
    want_a, want_b = run(a), run(b)
    graphs.prepare(step([20, 30], [0, 0]))
    assert torch.equal(run(a), want_a) and graphs.prepared_replays == 1  # only the ids written
    graphs.prepare(step([20, 30], [0, 0]))
    assert torch.equal(run(b), want_b) and graphs.prepared_replays == 1  # another step: loaded afresh
    graphs.prepare(step([20, 30], [0, 0]))
    loads = graphs.loads
    graphs.capture_shape((16, 16))  # another shape's capture loads the static buffers
    assert graphs.loads > loads
    assert torch.equal(run(a), want_a) and graphs.prepared_replays == 1
    graphs.prepare(step([21, 30], [0, 0]))
    assert torch.equal(run(b), want_b) and graphs.prepared_replays == 2
    for row in rows:
        manager.cache_req(row, [], 0, finished=True)
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_generate_short_prefills_after_a_cached_prefix_replay_graphs(page_size: int):
    """The time-to-first-token path: questions after a cached few-shot prefix, one call after another."""
    model = tiny_model("qwen2").cuda()  # sliding-window layers too
    engine = hf_radix.configure(model, max_total_tokens=8192, attn_backend="triton", page_size=page_size)
    gen = torch.Generator().manual_seed(2)
    prefix = random_ids(gen, 300)
    questions = [random_ids(gen, n) for n in (20, 64, 7, 200)]
    answers = []
    for question in questions:
        prompt = prefix + question
        answers.append(_hf_greedy_radix(model, prompt, 4))
        assert answers[-1] == _hf_greedy(model, prompt, 4)
    decode, extend = engine.model_runner.decode_graphs, engine.model_runner.extend_graphs
    assert extend.replays == len(questions) - 1  # the first call computed the prefix eagerly
    assert decode.replays == sum(len(a) - 1 for a in answers)
    assert engine.stats.cached_tokens >= (len(questions) - 1) * (300 - page_size)
    engine.check_integrity()


def _hf_greedy_radix(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
            cache_implementation="radix",
        )
    return out[0, len(prompt) :].tolist()


def test_runner_overlap_and_graphs_match_hf_on_gpu():
    """Overlap on and off, decode graphs for 40 rows, mixed rounds: HF's greedy tokens, per-step timings."""
    model = tiny_model("llama").cuda()
    gen = torch.Generator().manual_seed(5)
    system = random_ids(gen, 90)
    prompts = [system + random_ids(gen, 3 + i % 11) for i in range(40)]
    params = [SamplingParams(max_new_tokens=12, stop_token_ids=[7 + i % 5], ignore_eos=True)
              for i in range(40)]
    results = []
    for overlap in (False, True):
        runner = RadixBatchRunner(
            model, max_total_tokens=8192, attn_backend="triton", max_running_requests=40,
            chunked_prefill_size=128, overlap=overlap, profile=True,
        )
        runner.reset_cache()
        assert runner.model_runner.max_graph_batch >= 40
        outs = runner.run(prompts, params)
        runner.check_integrity()
        results.append([o.token_ids for o in outs])
        assert runner.model_runner.decode_graphs.replays > 0
        times = runner.step_times
        assert times.host_s and len(times.gpu_s) == len(times.host_s) == len(times.launch_s)
        assert all(launch <= host for launch, host in zip(times.launch_s, times.host_s))
    assert results[0] == results[1]
    for prompt, tokens, p in zip(prompts, results[0], params):
        ref = _hf_greedy(model, prompt, 12)
        stop = p.stop_token_ids[0]
        assert tokens == (ref[: ref.index(stop) + 1] if stop in ref else ref)


def test_generate_batch_of_64_rows_decodes_from_graphs():
    model = tiny_model("qwen2").cuda()
    engine = hf_radix.configure(model, max_total_tokens=16384, attn_backend="triton")
    gen = torch.Generator().manual_seed(6)
    rows = [random_ids(gen, 5 + i % 9) for i in range(64)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
    pads = torch.tensor([width - len(r) for r in rows], device="cuda")
    mask = (torch.arange(width, device="cuda")[None, :] >= pads[:, None]).long()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    decode = engine.model_runner.decode_graphs
    before = decode.replays
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         cache_implementation="radix")
    assert torch.equal(out, ref)
    assert decode.replays - before == 5  # every decode step of the 64-row batch replayed a graph
    engine.check_integrity()


@pytest.mark.parametrize("name", ["GptOss", "DeepseekV3", "Llama", "Gemma2", "Qwen2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_matrix_families_exact_with_triton_on_gpu(name: str, page_size: int):
    """Attention sinks (GptOss) and MLA latents (DeepseekV3) through the Triton kernels, fp32 on the GPU,
    against plain transformers: runner greedy, generate tokens and step logits, log-likelihoods."""
    from model_matrix import check_architecture

    result = check_architecture(name, page_size=page_size, attn_backend="triton", device="cuda",
                                logit_tol=1e-4, logprob_tol=5e-4)
    assert result["status"] == "exact", result
    print(name, page_size, result)


def test_graphs_made_inside_inference_mode_replay_outside_it():
    """The runner captures (and makes the shared extend graphs' buffers) inside inference_mode; a later
    generate (no_grad) and a runner call with gradients enabled still replay them."""
    model = tiny_model("llama").cuda()
    runner = RadixBatchRunner(model, max_total_tokens=4096, attn_backend="triton")
    prompt = random_ids(torch.Generator().manual_seed(4), 20)
    want = _hf_greedy(model, prompt, 5)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    with torch.inference_mode():
        assert runner.run([prompt], params)[0].token_ids == want
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=5, do_sample=False,
                         pad_token_id=0, eos_token_id=None, cache_implementation="radix")
    assert out[0, len(prompt):].tolist() == want
    assert runner.run([prompt], params)[0].token_ids == want
    runner.check_integrity()


def test_first_radix_generate_warms_up_once_and_a_new_pool_releases_the_graphs():
    """The first radix generate captures every shape (none inline later); a new pool frees the old graphs."""
    import gc
    import weakref

    model = tiny_model("llama").cuda()
    engine = hf_radix.configure(model, max_total_tokens=4096, attn_backend="triton", cuda_graph_max_batch=16)
    gen = torch.Generator().manual_seed(8)
    prompt = random_ids(gen, 20)
    want = _hf_greedy(model, prompt, 5)
    assert _hf_greedy_radix(model, prompt, 5) == want
    core = engine.model_runner
    assert set(core.warm_up_times) == {"eager_s", "capture_s"}
    decode, extend = core.decode_graphs, core.extend_graphs
    assert decode.num_graphs == len(decode.shapes()) and extend.num_graphs == len(extend.shapes())
    captured = (decode.capture_time, extend.capture_time)
    rows = [random_ids(gen, 5 + i) for i in range(9)]
    for row in rows:
        assert _hf_greedy_radix(model, prompt + row, 4) == _hf_greedy(model, prompt + row, 4)
    assert (decode.capture_time, extend.capture_time) == captured  # nothing captured inline
    held = [weakref.ref(decode), weakref.ref(extend)]
    del decode, extend
    new = hf_radix.configure(model, max_total_tokens=8192)
    gc.collect()
    assert [g() for g in held] == [None, None] and core.released and engine.closed
    assert _hf_greedy_radix(model, prompt, 5) == want
    assert new.model_runner.warm_up_times and new.model_runner.decode_graphs.replays == 4
    new.check_integrity()


def test_pool_sized_from_free_memory_keeps_room_for_the_graphs():
    model = tiny_model("llama").cuda()
    engine = hf_radix.configure(model, mem_fraction=0.01, attn_backend="triton")
    assert engine.graph_reserve > 0
    prompt = random_ids(torch.Generator().manual_seed(9), 30)
    assert _hf_greedy_radix(model, prompt, 4) == _hf_greedy(model, prompt, 4)  # warm-up captured all
    decode = engine.model_runner.decode_graphs
    assert decode.num_graphs == len(decode.shapes())  # per-row and shared-prefix graphs of every size
    engine.check_integrity()
