"""One Triton launch that samples every row of a batch: greedy, temperature, top-k, top-p, seeded noise.

One program per row reads its logits row a fixed number of times, never sorting it:

1. the row's maximum `m` of `x = logit * inv_temperature` (greedy rows: the argmax of the logits; done);
2. top-k (when `k < vocab`): the k-th largest `x`, found digit by digit on the float's order-preserving
   32-bit key (`32 / DIGIT_BITS` passes, each counting the row's keys at or above `2**DIGIT_BITS`
   candidate thresholds), so the threshold is exactly an element's key and ties at it are all kept;
3. top-p (when `top_p < 1`): the same digit search on mass, `exp(x - m)` summed over the top-k tokens
   at or above each candidate: the largest value `v` whose tokens at or above it hold at least
   `top_p` of the top-k mass (the smallest such set of most likely tokens; ties at `v` are all kept);
4. Gumbel-max over the kept tokens: the argmax of `x + g`, `g` a counter-based Gumbel variate of
   (the row's seed keys, its step, the token's index) computed in the kernel (`hf_radix.sampling`
   defines the same numbers in torch); ties go to the lowest index. The row's step is advanced here.

The rule is the one `hf_radix.sampling.sample_rows_torch` computes with a sort; the two agree exactly
except where a token sits within float rounding of the nucleus boundary (sums in another order) or two
perturbed scores are within an ulp (`log` of another library).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keep in step with hf_radix.sampling (mix32, column and row keys, uniform from the top 24 bits).
_MIX_0 = tl.constexpr(0x21F0AAAD)
_MIX_1 = tl.constexpr(0x735A2D97)
_COLUMN_SALT = tl.constexpr(0x27D4EB2F)


@triton.jit
def _mix32(x):
    """`hf_radix.sampling.mix32` on uint32 (the products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * _MIX_0
    x = x ^ (x >> 15)
    x = x * _MIX_1
    return x ^ (x >> 15)


@triton.jit
def _gumbel(row_key, offs):
    """`hf_radix.sampling.gumbel_noise` of one row at columns `offs` (three `mix32` rounds inline)."""
    x = offs.to(tl.uint32) ^ _COLUMN_SALT
    for _ in tl.static_range(2):  # the column's key
        x = x ^ (x >> 16)
        x = x * _MIX_0
        x = x ^ (x >> 15)
        x = x * _MIX_1
        x = x ^ (x >> 15)
    x = x ^ row_key
    x = x ^ (x >> 16)
    x = x * _MIX_0
    x = x ^ (x >> 15)
    x = x * _MIX_1
    x = x ^ (x >> 15)
    uniform = ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
    return -tl.log(-tl.log(uniform))


@triton.jit
def _load(row_ptr, offs, n_cols, scale):
    """`x = logit * scale` at `offs` (-inf past the row), its order key, and which lanes are in the row.

    Keys are uint32 ordered as the floats are (-0 and +0 share one).
    """
    valid = offs < n_cols
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) * scale
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    key = tl.where(x == 0.0, sign, tl.where((bits & sign) != 0, ~bits, bits | sign))
    return x, key, valid


@triton.jit
def _row_max(row_ptr, n_cols, scale, BLOCK: tl.constexpr):
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        logit = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf"))
        best = tl.maximum(best, logit.to(tl.float32))
    return tl.max(best, axis=0) * scale  # max(logit) * scale is max(logit * scale): scale > 0


@triton.jit
def _threshold_key(row_ptr, n_cols, scale, floor, m, target, MASS: tl.constexpr, BLOCK: tl.constexpr,
                   DIGIT_BITS: tl.constexpr):
    """The largest key `t` such that the row's weights at keys >= max(t, floor) reach the target.

    Weights are 1 (`MASS=False`: the target is a count, k) or `exp(x - m)` (`MASS=True`: the target is
    the fraction `top_p` of the weight at keys >= floor). One pass over the row per digit of the key.
    """
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    digits = tl.arange(0, RADIX)
    prefix = tl.full((), 0, tl.uint32)
    goal = target
    for i in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (i + 1)
        candidates = prefix + (digits.to(tl.uint32) << shift)
        partial = tl.zeros([BLOCK, RADIX], tl.float32)  # summed across lanes once, after the pass
        for start in range(0, n_cols, BLOCK):
            x, key, valid = _load(row_ptr, start + tl.arange(0, BLOCK), n_cols, scale)
            kept = valid & (key >= floor)
            weight = tl.where(kept, tl.exp(x - m), 0.0) if MASS else kept.to(tl.float32)
            above = key[:, None] >= candidates[None, :]
            partial += tl.where(above, weight[:, None], 0.0)
        reached = tl.sum(partial, axis=0)
        if MASS and i == 0:  # candidate 0 of the first digit is every kept token: their total mass
            goal = target * tl.sum(tl.where(digits == 0, reached, 0.0), axis=0)
        # `reached` falls with the digit; the largest digit still reaching the goal extends the prefix
        digit = tl.maximum(tl.sum((reached >= goal).to(tl.int32), axis=0) - 1, 0)
        prefix = prefix + (digit.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _kept_floor(row_ptr, n_cols, scale, top_k, top_p, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The order key of the row's least kept `x` under top-k then top-p (0: every token is kept)."""
    floor = tl.full((), 0, tl.uint32)
    m = _row_max(row_ptr, n_cols, scale, BLOCK)
    if top_k < n_cols:
        floor = _threshold_key(row_ptr, n_cols, scale, floor, m, top_k.to(tl.float32), False, BLOCK,
                               DIGIT_BITS)
    if top_p < 1.0:
        floor = _threshold_key(row_ptr, n_cols, scale, floor, m, top_p, True, BLOCK, DIGIT_BITS)
    return floor


@triton.jit
def _argmax(row_ptr, n_cols, scale, floor, row_key, NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """The lowest index of the largest `x + g` (`x` alone without noise) among keys >= floor."""
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key, valid = _load(row_ptr, offs, n_cols, scale)
        score = x
        if NOISE:
            score = tl.where(valid & (key >= floor), x + _gumbel(row_key, offs), float("-inf"))
        value, index = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = value > best
        best = tl.where(better, value, best)
        best_index = tl.where(better, start + index, best_index)
    return best_index


@triton.jit
def _sample_kernel(Logits, stride_row, n_cols, InvTemperature, TopK, TopP, Key0, Key1, Steps, Out,
                   BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = Logits + row.to(tl.int64) * stride_row
    scale = tl.load(InvTemperature + row)
    if scale == 0.0:
        token = _argmax(row_ptr, n_cols, 1.0, 0, 0, False, BLOCK)
    else:
        top_k, top_p = tl.load(TopK + row), tl.load(TopP + row)
        floor = _kept_floor(row_ptr, n_cols, scale, top_k, top_p, BLOCK, DIGIT_BITS)
        step = tl.load(Steps + row)
        key0 = tl.load(Key0 + row).to(tl.uint32)
        key1 = tl.load(Key1 + row).to(tl.uint32)
        row_key = _mix32(_mix32(key0 ^ step.to(tl.uint32)) ^ key1)
        token = _argmax(row_ptr, n_cols, scale, floor, row_key, True, BLOCK)
        tl.store(Steps + row, step + 1)
    tl.store(Out + row, token.to(tl.int64))


def sample_rows(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed_keys: torch.Tensor,
    steps: torch.Tensor,
    *,
    digit_bits: int = 4,
    block: int = 512,
    num_warps: int = 8,
) -> torch.Tensor:
    """Next token `[B]` int64 of each row of `logits` `[B, vocab]`; one launch; advances sampled `steps`.

    Per row: `inv_temperature` (0: greedy), `top_k` (>= vocab: off), `top_p` (1: off) `[B]`,
    `seed_keys` `[2, B]` and `steps` `[B]` int64 (see `hf_radix.sampling`). `digit_bits` (a divisor of 32;
    4: 8 passes per threshold, 16 candidates each), `block` and `num_warps` tune the kernel (the
    defaults: 79 registers for sm_90, three programs per SM, so 256 rows run in one wave on an H200).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(vocab))
        _sample_kernel[(rows,)](
            logits, logits.stride(0), vocab, inv_temperature, top_k, top_p, seed_keys[0], seed_keys[1], steps,
            out, BLOCK=block, DIGIT_BITS=digit_bits, num_warps=min(num_warps, max(1, block // 64)),
            enable_fp_fusion=False,  # x * scale + g rounded twice, as torch rounds it
        )
    return out
