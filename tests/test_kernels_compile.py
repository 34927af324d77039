"""The Triton kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter tests check what the kernels compute; this checks that the compiler accepts them, so a
change that only the GPU build would reject fails in CI.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from hf_radix.kernels import FP_FUSION, triton_decode, triton_extend, triton_split_merge  # noqa: E402

pytestmark = pytest.mark.slow  # kernels alone: no transformers version changes them

SM90 = backends.GPUTarget("cuda", 90, 32)


def _compile(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
             aligned: tuple[str, ...] = (), fp_fusion: bool = FP_FUSION):
    """Compiles for sm_90; ``aligned`` arguments are multiples of 16 (as a launch finds pool strides)."""
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in fn.arg_names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in aligned}
    source = compiler.ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion}  # as launched
    return triton.compile(source, target=SM90, options=options)


@pytest.mark.parametrize(
    "window,softcap,head_dim,head_dim_v,direct,pack,sinks,block_m,row_grid",
    [
        (False, False, 128, 128, True, False, False, 128, False),
        (False, False, 128, 128, False, True, False, 128, False),
        (False, False, 128, 128, True, True, False, 16, True),  # short rows: one small tile per row
        (True, True, 96, 96, False, True, True, 64, True),
        (False, False, 128, 64, True, False, False, 128, False),  # MLA-style: V narrower than K
    ],
)
def test_extend_kernel_compiles_for_sm90(
    window: bool, softcap: bool, head_dim: int, head_dim_v: int, direct: bool, pack: bool, sinks: bool,
    block_m: int, row_grid: bool,
) -> None:
    pointers = {name: "*bf16" for name in ("Q", "K_new", "V_new", "K_cache", "V_cache", "Out")}
    pointers.update({name: "*i32" for name in ("qo_indptr", "prefix_lens", "prefix_kv_indptr")})
    pointers.update(prefix_kv_indices="*i64", Mid_o="*fp32", Mid_lse="*fp32", Sinks="*fp32")
    pointers.update(qk_scale="fp32", cap_scale="fp32")
    constexprs = dict(
        GROUP=4, HEAD_DIM=head_dim, BLOCK_D=128, HEAD_DIM_V=head_dim_v,
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
        BLOCK_M=block_m, BLOCK_N=64, USE_WINDOW=window, SOFTCAP=softcap, DIRECT=direct, PACK_GQA=pack,
        ROW_GRID=row_grid, HAS_SINKS=sinks, DOT_PREC="tf32",
    )
    warps = 8 if block_m == 128 else 4
    aligned = (*pointers, "stride_qt", "stride_qh", "stride_knt", "stride_knh", "stride_vnt", "stride_vnh",
               "stride_kct", "stride_kch", "stride_vct", "stride_vch", "stride_ot", "stride_oh")
    kernel = _compile(triton_extend._extend_kernel, pointers, constexprs, num_warps=warps, num_stages=3,
                      aligned=aligned)
    ptx = kernel.asm["ptx"]
    assert "mma" in ptx and kernel.asm["cubin"]
    if head_dim % 16 == 0 and head_dim_v % 16 == 0:  # K/V tiles stream through shared memory, pipelined
        assert "cp.async" in ptx


@pytest.mark.parametrize("direct", [True, False])
def test_decode_kernels_compile_for_sm90(direct: bool):
    pointers = {name: "*bf16" for name in ("Q", "K_cache", "V_cache", "Out")}
    pointers.update(kv_indices="*i64", kv_indptr="*i32", Mid_o="*fp32", Mid_lse="*fp32", Sinks="*fp32",
                    qk_scale="fp32", cap_scale="fp32")
    constexprs = dict(
        GROUP=4, HEAD_BLOCKS=1, HEAD_DIM=128, BLOCK_D=128, HEAD_DIM_V=128, BLOCK_DV=128, BLOCK_H=16,
        BLOCK_N=64, USE_WINDOW=False, SOFTCAP=False, DIRECT=direct, HAS_SINKS=not direct, DOT_PREC="tf32",
    )
    stage1 = _compile(triton_decode._decode_stage1_kernel, pointers, constexprs, num_warps=4, num_stages=3)
    assert stage1.asm["cubin"]
    reduce = _compile(
        triton_split_merge._merge_splits_kernel,
        {"Mid_o": "*fp32", "Mid_lse": "*fp32", "Out": "*bf16", "Sinks": "*fp32"},
        dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, BLOCK_H=16, HAS_SINKS=True), num_warps=4, num_stages=1,
    )
    assert reduce.asm["cubin"]


def test_norm_and_rope_kernels_compile_for_sm90() -> None:
    from hf_radix.kernels import triton_norm_rope as fused

    norm = _compile(
        fused._rms_norm_kernel, {"X": "*bf16", "W": "*bf16", "Out": "*bf16", "eps": "fp32"}, dict(BLOCK=4096),
        num_warps=16, num_stages=1,
    )
    rope = _compile(
        fused._rope_kernel, {name: "*bf16" for name in ("Q", "K", "Cos", "Sin", "Q_out", "K_out")},
        dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8), num_warps=4, num_stages=1, fp_fusion=False,
    )
    assert norm.asm["cubin"] and rope.asm["cubin"]
