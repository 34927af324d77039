"""GPU tests of shared-prefix attention at Llama-3-8B head shapes (32 query / 8 KV heads, head_dim 128).

bf16 and fp32 against the float64 reference and the per-row kernels, page sizes 1 and 16, sliding window,
soft-capping, sinks, and replay of a CUDA graph captured once over static buffers refilled per batch; each
launch order (``mode``) against the per-row kernel and the fold path, eagerly and inside captured graphs
(the runner's decode graphs included).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_shared_prefix import (
    case_plan,
    make_shared_case,
    ref_shared,
    rel_err,
    run_per_row,
    run_shared,
    subset_case,
)

from hf_radix.paged_attention.prefix_groups import SharedPrefixBuffers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS = dict(hq=32, hkv=8, d=128)
SCALING = 1.0 / math.sqrt(128)
REL_TOL_BF16 = 1e-2


def _decode_groups(page: int) -> list[tuple[int, list[tuple[int, int]]]]:
    return [
        (2048, [((37 * i) % 300, 1) for i in range(40)]),  # 40 rows: two prefix tiles
        (1024, [(0, 1), (5, 1), (129, 1), (600, 1), (17, 1)]),
        (16 * page, [(3, 1), (200, 1)]),
        (512, [(31, 1)]),  # a group of one
    ]


def _extend_groups() -> list[tuple[int, list[tuple[int, int]]]]:
    return [(1504, [((11 * i) % 40, 64) for i in range(12)] + [(3, 0), (0, 200)]), (512, [(0, 7), (9, 33)])]


def _check(case: dict[str, Any], dtype: torch.dtype, per_row: bool, **kw: Any) -> torch.Tensor:
    out = run_shared(case, SCALING, **kw)
    ref = ref_shared(case, SCALING, kw.get("sliding_window"), kw.get("softcap"), kw.get("sinks"))
    err = rel_err(out, ref)
    print(f"rel err vs float64 {err:.2e}")
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert err <= (REL_TOL_BF16 if dtype == torch.bfloat16 else 1e-5)
    if per_row:
        base = run_per_row(case, SCALING, sliding_window=kw.get("sliding_window"), softcap=kw.get("softcap"))
        diff = rel_err(out, base)
        print(f"rel diff vs per-row kernel {diff:.2e}")
        assert diff <= (REL_TOL_BF16 if dtype == torch.bfloat16 else 1e-5)
    return out


KERNEL_KW = [
    dict(),
    dict(num_prefix_splits=4),
    dict(num_prefix_splits=3, num_suffix_splits=2),
    dict(num_prefix_splits=2, sliding_window=1500, softcap=30.0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kw", KERNEL_KW, ids=["plain", "psplit4", "merge", "window_softcap"])
def test_decode_llama_heads(dtype: torch.dtype, page: int, kw: dict[str, Any]) -> None:
    case = make_shared_case(_decode_groups(page), **HEADS, page_size=page, dtype=dtype, device="cuda",
                            seed=page, alone=[(2100, 1), (7, 1)])
    _check(case, dtype, per_row=True, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kw", KERNEL_KW[:1] + KERNEL_KW[2:], ids=["plain", "merge", "window_softcap"])
def test_extend_llama_heads(dtype: torch.dtype, page: int, kw: dict[str, Any]) -> None:
    case = make_shared_case(_extend_groups(), **HEADS, page_size=page, dtype=dtype, device="cuda",
                            seed=10 + page, alone=[(100, 50)])
    _check(case, dtype, per_row=True, **kw)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_sinks(mode: str) -> None:
    groups = _decode_groups(16) if mode == "decode" else _extend_groups()
    case = make_shared_case(groups, **HEADS, page_size=16, dtype=torch.bfloat16, device="cuda", seed=7)
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(1)).cuda() * 3.0
    split = dict(num_prefix_splits=3, num_suffix_splits=2, sliding_window=700)
    for kw in (dict(sinks=sinks), dict(sinks=sinks, **split)):
        _check(case, torch.bfloat16, per_row=False, **kw)


MODES = ["merge", "overlap", "fused"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", KERNEL_KW[1:], ids=["psplit4", "merge", "window_softcap"])
def test_decode_modes_llama_heads(dtype: torch.dtype, page: int, mode: str, kw: dict[str, Any]) -> None:
    """Each launch order against the per-row kernel and the fold path (the default)."""
    case = make_shared_case(_decode_groups(page), **HEADS, page_size=page, dtype=dtype, device="cuda",
                            seed=page, alone=[(2100, 1), (7, 1)])
    out = _check(case, dtype, per_row=True, mode=mode, **kw)
    fold = run_shared(case, SCALING, **kw)
    assert rel_err(out, fold) <= (REL_TOL_BF16 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_modes_with_sinks_and_extend(mode: str) -> None:
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(1)).cuda() * 3.0
    for groups in (_decode_groups(16), _extend_groups()):
        case = make_shared_case(groups, **HEADS, page_size=16, dtype=torch.bfloat16, device="cuda", seed=7)
        _check(case, torch.bfloat16, per_row=False, sinks=sinks, num_prefix_splits=3, sliding_window=700,
               mode=mode)


def test_overlap_eager_calls_agree_while_memory_is_reused() -> None:
    """The side stream reads tensors the caller's stream allocated and frees: calls with allocations in
    between (which reuse freed blocks at once) give the same result bit for bit."""
    case = make_shared_case(_decode_groups(16), **HEADS, page_size=16, dtype=torch.bfloat16, device="cuda")
    base = run_shared(case, SCALING, num_prefix_splits=4, mode="overlap").clone()
    for i in range(20):
        junk = torch.full((1 << (14 + i % 6),), float("nan"), device="cuda")  # fills freed blocks
        out = run_shared(case, SCALING, num_prefix_splits=4, mode="overlap")
        del junk
        assert torch.equal(out, base)


def test_membership_does_not_change_a_rows_result() -> None:
    case = make_shared_case(_decode_groups(16)[:1], **HEADS, page_size=16, dtype=torch.bfloat16,
                            device="cuda")
    base = run_shared(case, SCALING, num_prefix_splits=4)
    for rows in ([5, 0, 17], list(range(39, -1, -1)), [3, 9]):
        out = run_shared(subset_case(case, rows), SCALING, num_prefix_splits=4)
        assert torch.equal(out, base[rows])


@pytest.mark.parametrize("mode", ["fold", *MODES])
def test_cuda_graph_replays_refilled_buffers(mode: str) -> None:
    """One capture over static buffers; later batches (other groups, fewer rows) only refill them."""
    from hf_radix.kernels.triton_shared_prefix import shared_prefix_attention

    case = make_shared_case(_decode_groups(16), **HEADS, page_size=16, dtype=torch.bfloat16, device="cuda")
    rows = len(case["seq_lens"])
    plan = case_plan(case, prefix_parts=4)
    buffers = SharedPrefixBuffers(rows, rows, plan.prefix_tile_q, plan.suffix_tile_q, "cuda")
    q = torch.zeros_like(case["q"])
    slots = torch.zeros(int(case["seq_lens"].sum()), dtype=case["slots"].dtype, device="cuda")
    out = torch.empty_like(q)

    def step() -> None:
        shared_prefix_attention(q, case["k_cache"], case["v_cache"], slots, buffers, SCALING,
                                num_prefix_splits=4, out=out, mode=mode)

    def fill(sub: dict[str, Any]) -> None:
        buffers.load(case_plan(sub, prefix_parts=4))
        q[:len(sub["q"])].copy_(sub["q"])
        slots[:len(sub["slots"])].copy_(sub["slots"])

    fill(case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for sub in (case, subset_case(case, [44, 3, 40, 1, 46, 45, 0]), subset_case(case, list(range(10, 30)))):
        fill(sub)
        graph.replay()
        torch.cuda.synchronize()
        n = len(sub["q"])
        assert rel_err(out[:n], ref_shared(sub, SCALING)) <= REL_TOL_BF16


# --------------------------------------------------------------------------------------------------------
# Wired into the runner and generate: decode graphs (and eager decode) with shared-prefix attention
# --------------------------------------------------------------------------------------------------------


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _force_shared(planner) -> None:
    import dataclasses

    assert planner is not None
    planner.cost = dataclasses.replace(planner.cost, keep_all=True)


@pytest.mark.parametrize(
    "arch,page_size,cuda_graph,mode",
    [("llama", 1, True, "fold"), ("llama", 1, False, "fold"), ("gemma2", 16, True, "fold"),
     ("gemma2", 16, False, "fold"), ("llama", 1, True, "overlap"), ("gemma2", 16, True, "fused"),
     ("llama", 16, False, "overlap"), ("gemma2", 1, True, "merge")],
)
def test_runner_decode_with_shared_prefix_matches_hf(arch: str, page_size: int, cuda_graph: bool,
                                                     mode: str) -> None:
    """Groups of rows behind two system prompts, rows joining and finishing: HF's greedy tokens, with
    shared-prefix decode steps replayed from graphs (or eager), several plans, in each launch order."""
    from conftest import random_ids

    from hf_radix import RadixBatchRunner, SamplingParams, configure
    from hf_radix.tiny import tiny_model

    model = tiny_model(arch).cuda()
    configure(model, shared_prefix_mode=mode, max_total_tokens=8192)  # (a small pool: tests share the GPU)
    runner = RadixBatchRunner(model, page_size=page_size, max_total_tokens=8192, attn_backend="triton",
                              cuda_graph=cuda_graph, max_running_requests=12, warm_up=False)
    core = runner.model_runner
    planner = core.decode_graphs.shared if cuda_graph else core.eager_shared
    _force_shared(planner)
    gen = torch.Generator().manual_seed(0)
    systems = [random_ids(gen, 300), random_ids(gen, 97)]
    prompts = [systems[i % 2] + random_ids(gen, 1 + 7 * i % 40) for i in range(20)] + [random_ids(gen, 33)]
    params = [SamplingParams(max_new_tokens=6 + i % 5) for i in range(len(prompts))]
    outs = runner.run(prompts, params)
    runner.check_integrity()
    for prompt, out, p in zip(prompts, outs, params):
        assert out.token_ids == _hf_greedy(model, prompt, p.max_new_tokens)
    assert core.shared_prefix_steps > 0 and planner.plans >= 2
    if cuda_graph:
        assert any(len(key) == 3 for key in core.decode_graphs._graphs)  # shared graphs were replayed


def test_generate_decode_with_shared_prefix_matches_hf() -> None:
    """A cached few-shot prefix, then a batch of questions behind it: graphs with shared prefixes."""
    from conftest import random_ids

    import hf_radix
    from hf_radix.tiny import tiny_model

    model = tiny_model("llama").cuda()
    engine = hf_radix.configure(model, max_total_tokens=8192, attn_backend="triton")
    _force_shared(engine.model_runner.decode_graphs.shared)
    gen = torch.Generator().manual_seed(3)
    system = random_ids(gen, 200)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             cache_implementation="radix")
        return [row[width:].tolist() for row in out]

    generate([system + random_ids(gen, 4)])
    before = engine.model_runner.shared_prefix_steps
    prompts = [system + random_ids(gen, 3 + 5 * i) for i in range(6)] + [random_ids(gen, 20)]
    assert generate(prompts) == [_hf_greedy(model, p, 8) for p in prompts]
    assert engine.model_runner.shared_prefix_steps - before == 7
    engine.check_integrity()
