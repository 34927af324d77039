"""GPU tests for hf_radix.kernels (skipped without CUDA).

Triton attention in bf16 at realistic sizes against a float64 reference, the CUDA store kernel (bit-exact),
CUDA-graph capture, and the store kernel's build time.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _helpers() -> Any:
    """tests/test_kernels.py (case builders + float64 reference), loaded by path."""
    name = "_hf_radix_kernel_test_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_kernels.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


H = _helpers()
REL_TOL_BF16 = 1e-2

EXTEND_CASES = {
    "llama_gqa_d128_p16": dict(
        rows=[(0, 300), (2048, 256), (513, 77), (100, 1), (37, 0), (0, 1)], hq=32, hkv=8, d=128, page_size=16
    ),
    "mha_d64_p1": dict(rows=[(1000, 129), (0, 64), (5, 700)], hq=8, hkv=8, d=64, page_size=1),
    "phi_d80": dict(rows=[(300, 200), (17, 33)], hq=8, hkv=8, d=80, page_size=16),
    "d96_group7": dict(rows=[(257, 190), (0, 5)], hq=28, hkv=4, d=96, page_size=1),
    "gemma2_d256": dict(rows=[(700, 300), (0, 129), (4000, 2)], hq=16, hkv=8, d=256, page_size=16),
}
EXTEND_CASES["ttft_d128"] = dict(rows=[(4096, 64), (0, 0)], hq=32, hkv=8, d=128, page_size=1)
EXTEND_KW = {
    "gemma2_d256": [dict(), dict(sliding_window=256, softcap=50.0), dict(sliding_window=256, splits=6)],
    "d96_group7": [dict(), dict(sliding_window=100), dict(pack_gqa=True, sliding_window=100, splits=3)],
    "llama_gqa_d128_p16": [dict(), dict(splits=5), dict(pack_gqa=True, max_prefix_len=4096)],
    "ttft_d128": [dict(), dict(max_prefix_len=8192), dict(splits=16, pack_gqa=False)],
}

DECODE_CASES = {
    "llama_gqa_d128_p1": dict(seq_lens=[1, 17, 2048, 4000, 333, 64], hq=32, hkv=8, d=128, page_size=1),
    "llama_gqa_d128_p16": dict(seq_lens=[5000, 1, 129, 8], hq=32, hkv=8, d=128, page_size=16),
    "mha_d64": dict(seq_lens=[1000, 3, 777], hq=16, hkv=16, d=64, page_size=1),
    "phi_d80": dict(seq_lens=[300, 1200], hq=8, hkv=8, d=80, page_size=16),
    "d96_group7": dict(seq_lens=[900, 31, 2], hq=28, hkv=4, d=96, page_size=1),
    "gemma2_d256": dict(seq_lens=[4500, 100, 1], hq=16, hkv=8, d=256, page_size=16),
}
DECODE_KW = {
    "gemma2_d256": [
        dict(),
        dict(sliding_window=1024, softcap=50.0),
        dict(sliding_window=1024, splits=5),
    ],
    "llama_gqa_d128_p1": [dict(), dict(splits=1), dict(splits=7), dict(splits=32)],
    "d96_group7": [dict(), dict(splits=4, sliding_window=64)],
}


# kw: the kernel's keyword arguments, "splits" its split count (extend's num_splits, decode's num_kv_splits)
BF16_CASES = {"extend": (EXTEND_CASES, EXTEND_KW), "decode": (DECODE_CASES, DECODE_KW)}


def _kw_id(kw: dict[str, Any]) -> str:
    return "-".join(f"{k}{v}" for k, v in kw.items()) or "plain"


def _attention(op: str, spec: dict[str, Any], dtype: torch.dtype, seed: int,
               kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Runs the ``op`` ("extend" or "decode") kernel on the case ``spec`` builds: (output, float64
    reference, case). Extend is told its longest row (``max_new_len``), as the model runner tells it."""
    kw = dict(kw)
    splits = kw.pop("splits", None)
    scaling = 1.0 / math.sqrt(spec["d"])
    window, softcap = kw.get("sliding_window"), kw.get("softcap")
    if op == "extend":
        case = H.make_extend_case(**spec, dtype=dtype, device="cuda", seed=seed)
        max_new = max(n for _, n in case["rows"])
        out = H.run_extend(case, scaling, max_new_len=max_new, num_splits=splits, **kw)
        return out, H.ref_extend(case, scaling, window, softcap), case
    case = H.make_decode_case(**spec, dtype=dtype, device="cuda", seed=seed)
    out = H.run_decode(case, scaling, num_kv_splits=splits, **kw)
    return out, H.ref_decode(case, scaling, window, softcap), case


def _assert_close(out: torch.Tensor, ref: torch.Tensor, case: dict[str, Any], dtype: torch.dtype,
                  label: str) -> None:
    err = H.rel_err(out, ref)
    print(f"{label}: rel err {err:.2e}")
    assert out.shape == (*case["q"].shape[:2], case["v_cache"].shape[-1])
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert err <= (REL_TOL_BF16 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize(
    "op,name,kw",
    [(op, name, kw) for op, (cases, kws) in BF16_CASES.items() for name in cases
     for kw in kws.get(name, [dict()])],
    ids=lambda x: x if isinstance(x, str) else _kw_id(x),
)
def test_attention_bf16(op: str, name: str, kw: dict[str, Any]) -> None:
    cases = BF16_CASES[op][0]
    out, ref, case = _attention(op, cases[name], torch.bfloat16, {"extend": 3, "decode": 4}[op], kw)
    _assert_close(out, ref, case, torch.bfloat16, f"{op} {name} {kw}")


def _compiled_variants(fn: Any) -> int:
    """How many variants of a Triton kernel are compiled (all devices; the first entry of each device's
    cache tuple is its kernel cache in Triton 3.2 to 3.9)."""
    if not hasattr(fn, "device_caches"):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(cache[0]) for cache in fn.device_caches.values())


def test_no_recompiles_for_new_lengths() -> None:
    """Once each row class and the direct / split epilogues have run, new lengths, row counts and split
    counts reuse the compiled extend and decode kernels (nothing about a length is specialized on); few
    rows (`FEW_ROWS`) reuse the last class's kernel."""
    from hf_radix.kernels import triton_decode, triton_extend

    geo = dict(hq=32, hkv=8, d=128, page_size=16, dtype=torch.bfloat16, device="cuda")
    warm = H.make_extend_case(rows=[(2048, 256), (100, 1), (50, 10), (0, 3)], seed=5, **geo)
    assert warm["prefix_lens"].shape[0] > triton_extend.FEW_ROWS  # every row class runs
    for splits in (1, 3):
        H.run_extend(warm, 128**-0.5, max_new_len=256, num_splits=splits)
    for splits in (1, 3):
        H.run_decode(H.make_decode_case(seq_lens=[5, 300], seed=5, **geo), 128**-0.5, num_kv_splits=splits)
    torch.cuda.synchronize()
    before = _compiled_variants(triton_extend._extend_kernel), _compiled_variants(
        triton_decode._decode_stage1_kernel)
    for rows, splits in (([(1000, 33), (7, 2), (300, 12), (0, 5), (64, 90)], 5), ([(1600, 12)] * 9, 1),
                         ([(16, 1)] * 17, 2), ([(4096, 64)], 16), ([(0, 700), (3, 1)], 1)):
        case = H.make_extend_case(rows=rows, seed=6, **geo)
        out = H.run_extend(case, 128**-0.5, max_new_len=max(n for _, n in rows), num_splits=splits)
        assert H.rel_err(out, H.ref_extend(case, 128**-0.5)) <= REL_TOL_BF16
    for lens, splits in (([1, 17, 2048, 4000], 7), ([33] * 65, 1), ([9000], 16), ([2, 3], 2)):
        H.run_decode(H.make_decode_case(seq_lens=lens, seed=6, **geo), 128**-0.5, num_kv_splits=splits)
    torch.cuda.synchronize()
    after = _compiled_variants(triton_extend._extend_kernel), _compiled_variants(
        triton_decode._decode_stage1_kernel)
    assert after == before, f"compiled variants (extend, decode) grew from {before} to {after}"


# gpt-oss attention sinks (64 query heads over 8 KV heads, head 64, 128-token windows) and DeepSeek-V3 MLA
# as transformers expands it (128 heads, K 192 = nope 128 + rope 64, V 128), bf16 and fp32.
SPECIAL = {
    ("sinks", "extend"): dict(rows=[(0, 300), (2048, 129), (700, 1), (37, 0)], hq=64, hkv=8, d=64,
                              page_size=16, sinks=True),
    ("sinks", "decode"): dict(seq_lens=[1, 130, 4000, 777], hq=64, hkv=8, d=64, page_size=16, sinks=True),
    ("mla", "extend"): dict(rows=[(0, 200), (1500, 64), (300, 1)], hq=128, hkv=128, d=192, dv=128,
                            page_size=1),
    ("mla", "decode"): dict(seq_lens=[1, 300, 3000], hq=128, hkv=128, d=192, dv=128, page_size=1),
}
SPECIAL_KW = [dict(), dict(sliding_window=128), dict(sliding_window=128, splits=5), dict(splits=7)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "kind,op,kw",
    [(kind, op, kw) for kind, op in SPECIAL for kw in SPECIAL_KW
     if not (kind == "mla" and "sliding_window" in kw)],  # DeepSeek-V3 has no sliding window
    ids=lambda x: x if isinstance(x, str) else _kw_id(x),
)
def test_sinks_and_mla(kind: str, op: str, kw: dict[str, Any], dtype: torch.dtype) -> None:
    out, ref, case = _attention(op, SPECIAL[kind, op], dtype, {"extend": 5, "decode": 6}[op], kw)
    _assert_close(out, ref, case, dtype, f"{op} {kind} {dtype} {kw}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_cuda_mla_latents(dtype: torch.dtype) -> None:
    """DeepSeek-V3's latent pool: K rows 512 wide (compressed K/V), V rows 64 wide (rotary key)."""
    from hf_radix.kernels.store import cuda_store_available, store_kv

    if not cuda_store_available():
        pytest.skip("CUDA store kernel unavailable (nvcc?)")
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_cache = torch.zeros((4096, 1, 512), dtype=dtype, device="cuda")
    v_cache = torch.zeros((4096, 1, 64), dtype=dtype, device="cuda")
    k = torch.randn((1, 700, 512), device="cuda", generator=gen).to(dtype).transpose(0, 1)  # HF [1, T, D]
    v = torch.randn((1, 700, 64), device="cuda", generator=gen).to(dtype).transpose(0, 1)
    loc = torch.randperm(4096, device="cuda", generator=gen)[:700]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k_cache, v_cache, loc, k, v, backend="cuda")
    store_kv(ref_k, ref_v, loc, k, v, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def test_fp32_and_fp16_on_gpu() -> None:
    case = H.make_extend_case(
        [(100, 70), (0, 20)], hq=4, hkv=2, d=64, page_size=4, dtype=torch.float32, device="cuda"
    )
    out = H.run_extend(case, 0.125)
    assert H.rel_err(out, H.ref_extend(case, 0.125)) <= 1e-4
    case = H.make_decode_case([100, 7], hq=4, hkv=2, d=64, dtype=torch.float32, device="cuda")
    out = H.run_decode(case, 0.125, num_kv_splits=3)
    assert H.rel_err(out, H.ref_decode(case, 0.125)) <= 1e-4
    case = H.make_decode_case([300, 7], hq=8, hkv=2, d=128, dtype=torch.float16, device="cuda")
    out = H.run_decode(case, 0.1)
    assert H.rel_err(out, H.ref_decode(case, 0.1)) <= 2e-3


def test_kernels_cuda_graph_capture() -> None:
    """decode/extend (with the sizes given) and store_kv launch without host syncs, so they capture."""
    from hf_radix.kernels.store import cuda_store_available, store_kv

    dec = H.make_decode_case(
        [700, 64, 1], hq=32, hkv=8, d=128, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    ext = H.make_extend_case(
        [(300, 40), (0, 9)], hq=32, hkv=8, d=128, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    k = torch.randn((5, 8, 128), device="cuda", dtype=torch.bfloat16)
    loc = torch.tensor([3, 9, 1, 0, 7], device="cuda")
    kc = torch.zeros((16, 8, 128), device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    backend = "cuda" if cuda_store_available() else "torch"

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        a = H.run_decode(dec, 0.08, num_kv_splits=4)
        b = H.run_extend(ext, 0.08, max_new_len=40)
        store_kv(kc, vc, loc, k, k, backend=backend)
        return a, b

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile kernels / build the store library outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b = step()
    kc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert H.rel_err(a, H.ref_decode(dec, 0.08)) <= REL_TOL_BF16
    assert H.rel_err(b, H.ref_extend(ext, 0.08)) <= REL_TOL_BF16
    assert torch.equal(kc[loc], k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_and_rope_kernels_match_hf_at_8b_shapes(dtype: torch.dtype) -> None:
    """The rotary embedding is bit-identical to HF's; the norm differs at most by a last-bit rounding."""
    from transformers.models.llama import modeling_llama

    from hf_radix.kernels.triton_norm_rope import rms_norm, rotary_embedding

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 64, 32, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, 64, 8, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(1, 64, 128, device="cuda", generator=gen).to(dtype) for _ in range(2))
    for out, ref in zip(rotary_embedding(q, k, cos, sin), modeling_llama.apply_rotary_pos_emb(q, k, cos, sin),
                        strict=True):
        assert torch.equal(out, ref) and out.stride() == ref.stride()

    norm = modeling_llama.LlamaRMSNorm(4096, eps=1e-5).to("cuda", dtype)
    norm.weight.data.normal_(generator=gen)
    x = torch.randn(3, 64, 4096, device="cuda", generator=gen).to(dtype)
    out, ref = rms_norm(x, norm.weight, 1e-5), norm(x)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert out.dtype == ref.dtype and ((out.float() - ref.float()).abs() <= ulp * ref.float().abs()).all()
    if dtype == torch.bfloat16:  # the fp32 sums differ in their last bits, which bf16 rounding mostly hides
        assert (out != ref).float().mean() < 0.01


# --------------------------------------------------------------------------------------------------------
# Store kernel
# --------------------------------------------------------------------------------------------------------


def test_store_kernel_build_time(tmp_path: Path) -> None:
    from hf_radix.kernels import store

    if store.find_nvcc() is None:
        pytest.skip("nvcc not found")
    arch = store.device_arch()
    t0 = time.perf_counter()
    store.compile_store_kernel(tmp_path / "store.so", arch=arch)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    store._load(tmp_path / "store.so")
    load = time.perf_counter() - t0
    secs = store.build_store_kernel()
    print(
        f"\nstore kernel: cold nvcc build {cold:.2f}s, ctypes load {load * 1e3:.1f}ms, "
        f"process first use {store.STORE_BUILD_INFO}, build_store_kernel() now {secs:.3f}s"
    )
    assert store.cuda_store_available()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_store_kv_cuda_exact(dtype: torch.dtype, index_dtype: torch.dtype, layout: str) -> None:
    from hf_radix.kernels.store import cuda_store_available, store_kv

    if not cuda_store_available():
        pytest.skip("CUDA store kernel unavailable (nvcc?)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hkv, d, slots = 1000, 8, 128, 4096
    pool = torch.zeros((2, slots, hkv, d), dtype=dtype, device="cuda")
    ref_pool = pool.clone()
    if layout == "contiguous":
        k = torch.randn((t, hkv, d), device="cuda", generator=gen).to(dtype)
        v = torch.randn((t, hkv, d), device="cuda", generator=gen).to(dtype)
    else:  # HF layout [Hkv, T, D] viewed as [T, Hkv, D]
        k = torch.randn((hkv, t, d), device="cuda", generator=gen).to(dtype).transpose(0, 1)
        v = torch.randn((hkv, t, d), device="cuda", generator=gen).to(dtype).transpose(0, 1)
    loc = torch.randperm(slots, device="cuda", generator=gen)[:t].to(index_dtype)
    store_kv(pool[0], pool[1], loc, k, v, backend="cuda")
    store_kv(ref_pool[0], ref_pool[1], loc, k, v, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))


@pytest.mark.parametrize("row", [(1, 3), (3, 5), (2, 4), (1, 1), (4, 2)])
def test_store_kv_cuda_odd_rows(row: tuple[int, int]) -> None:
    """Row sizes that force 1/2/4/8-byte copy units; 2-D rows and empty batches."""
    from hf_radix.kernels.store import cuda_store_available, store_kv

    if not cuda_store_available():
        pytest.skip("CUDA store kernel unavailable (nvcc?)")
    for dtype in (torch.float16, torch.float32):
        kc = torch.zeros((50, *row), dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        k = torch.randn((7, *row), device="cuda").to(dtype)
        v = torch.randn((7, *row), device="cuda").to(dtype)
        loc = torch.tensor([49, 0, 3, 7, 11, 2, 30], device="cuda")
        store_kv(kc, vc, loc, k, v, backend="cuda")
        assert torch.equal(kc[loc], k) and torch.equal(vc[loc], v)
        flat = kc.view(50, -1)
        store_kv(flat, vc.view(50, -1), loc[:3], k.reshape(7, -1)[:3] * 2, v.reshape(7, -1)[:3] * 2, "cuda")
        assert torch.equal(flat[loc[:3]], k.reshape(7, -1)[:3] * 2)
        store_kv(kc, vc, loc[:0], k[:0], v[:0], backend="cuda")
    # byte-misaligned base pointer (odd fp16 offset) still copies correctly
    base = torch.zeros(2 * 50 * 3 + 1, dtype=torch.float16, device="cuda")
    kc = base[1:].view(2, 50, 3)[0]
    vc = base[1:].view(2, 50, 3)[1]
    k = torch.randn((4, 3), device="cuda").half()
    loc = torch.tensor([5, 6, 0, 49], device="cuda", dtype=torch.int32)
    store_kv(kc, vc, loc, k, k + 1, backend="cuda")
    assert torch.equal(kc[loc.long()], k) and torch.equal(vc[loc.long()], k + 1)
