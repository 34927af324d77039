"""Samples every row of a batch in a fixed number of Triton launches: greedy, temperature, top-k, top-p, seed.

Each row is cut into chunks of `chunk` columns (blocks of `block` columns each); every launch runs one
program per (row, chunk), so no program walks a whole row and a launch has `rows * chunks` programs:

1. `_block_max_kernel`: each block's and each chunk's largest logit (the row maximum `m` of
   `x = logit * inv_temperature` is the largest chunk maximum times the scale);
2. `_digit_kernel`, `32 / DIGIT_BITS` launches for top-k then as many for top-p (a search no row of the
   batch uses is not launched, but for top-p's first launch, which records top-k's floor): the threshold
   is found digit by digit on the float's order-preserving 32-bit key. Launch `s` sums, per chunk, the weights
   at or above each of its digit's `2**DIGIT_BITS` candidate keys (1 for top-k, where the target is `k`;
   `exp(x - m)` over the top-k tokens for top-p, where it is `top_p` of their mass) into a
   `[rows, 2, chunks, candidates]` scratch (by the launch's parity). Each program of launch `s + 1` sums
   its row's partials over the chunks in a fixed order, so every program of a row picks the same digit;
   the row's chunk 0 records the prefix for the launch after. Blocks whose maximum key is below the
   current candidate bucket hold no weight in it and are not read: past the first digits a search
   reads only the blocks holding the row's largest values;
3. `_gumbel_max_kernel`: per chunk, the lowest index of the largest `x + g` among the kept tokens
   (blocks whose maximum is below the threshold skipped), `g` a counter-based Gumbel variate of (the
   row's seed keys, its step, the token's index) computed in the kernel (`scheduling.sampling` defines the
   same numbers in torch); greedy rows: the first column holding the row's maximum logit;
4. `_pick_kernel`: per row, the best of its chunks (the lowest chunk on ties); advances sampled rows' steps.

No atomics and no host syncs: the tokens are the same from call to call. The rule is the one
`scheduling.sampling.sample_rows_torch` computes with a sort; the two agree exactly except where a token
sits within float rounding of the nucleus boundary (sums in another order) or two perturbed scores are
within an ulp (`log` of another library).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import FP_FUSION

# Keep in step with hf_radix.scheduling.sampling (mix32, column and row keys, uniform from the top 24 bits).
_MIX_0 = tl.constexpr(0x21F0AAAD)
_MIX_1 = tl.constexpr(0x735A2D97)
_COLUMN_SALT = tl.constexpr(0x27D4EB2F)
# State[row, :]: a search's prefix by launch parity (0, 1), the least key top-k keeps, the least key kept
_KEPT_FLOOR = tl.constexpr(2)
_FLOOR = tl.constexpr(3)
_STATE_SLOTS = tl.constexpr(4)


@triton.jit
def _mix32(x):
    """`hf_radix.scheduling.sampling.mix32` on uint32 (the products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * _MIX_0
    x = x ^ (x >> 15)
    x = x * _MIX_1
    return x ^ (x >> 15)


@triton.jit
def _gumbel(row_key, offs):
    """`scheduling.sampling.gumbel_noise` of one row at columns `offs` (three `mix32` rounds inline)."""
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
def _order_key(x):
    """uint32 keys ordered as the fp32 values `x` are (-0 and +0 share one)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    return tl.where(x == 0.0, sign, tl.where((bits & sign) != 0, ~bits, bits | sign))


@triton.jit
def _read_block(row_ptr, block_keys, block, end, n_cols, least, BLOCK: tl.constexpr):
    """A block's logits (-inf past the row) and whether it was read: only before block `end` and when its
    largest key is at least `least` (otherwise the masked load moves no memory)."""
    inside = block < end
    wanted = inside & (tl.load(block_keys + block, mask=inside, other=0).to(tl.uint32, bitcast=True) >= least)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    return tl.load(row_ptr + offs, mask=offs < tl.where(wanted, n_cols, 0), other=float("-inf")), wanted


@triton.jit
def _chunk_start(Logits, stride_row, BlockKey, row, chunk, n_blocks, n_cols, least, BLOCK: tl.constexpr,
                 BLOCKS_PER_CHUNK: tl.constexpr):
    """A program's walk over its chunk: the row's logits and block keys, the chunk's first and end blocks,
    and its first block as `_read_block` reads it."""
    row_ptr = Logits + row.to(tl.int64) * stride_row
    block_keys = BlockKey + row * n_blocks
    first = chunk * BLOCKS_PER_CHUNK
    end = tl.minimum(first + BLOCKS_PER_CHUNK, n_blocks)
    logit, wanted = _read_block(row_ptr, block_keys, first, end, n_cols, least, BLOCK)
    return row_ptr, block_keys, first, end, logit, wanted


@triton.jit
def _scaled(logit, block, n_cols, scale, BLOCK: tl.constexpr):
    """`x = logit * scale` of a block read by `_read_block`, its order key, and which lanes are in the row."""
    x = logit.to(tl.float32) * scale
    return x, _order_key(x), block * BLOCK + tl.arange(0, BLOCK) < n_cols


@triton.jit
def _row_max(ChunkMax, row, n_chunks, CHUNKS: tl.constexpr):
    """The row's largest logit, from its chunk maxima."""
    c = tl.arange(0, CHUNKS)
    return tl.max(tl.load(ChunkMax + row * n_chunks + c, mask=c < n_chunks, other=float("-inf")), axis=0)


@triton.jit
def _reached(Partials, row, parity, n_chunks, CHUNKS: tl.constexpr, RADIX: tl.constexpr):
    """`[RADIX]`: the row's weight at or above each candidate of one launch, its chunks summed in order."""
    c = tl.arange(0, CHUNKS)[:, None]
    d = tl.arange(0, RADIX)[None, :]
    partials = tl.load(Partials + ((row * 2 + parity) * n_chunks + c) * RADIX + d, mask=c < n_chunks,
                       other=0.0)
    return tl.sum(partials, axis=0)


@triton.jit
def _extend(State, row, step, reached, goal, DIGIT_BITS: tl.constexpr):
    """The prefix after launch `step`'s digit: the largest candidate whose weight still reaches `goal`."""
    LEVELS: tl.constexpr = 32 // DIGIT_BITS
    prefix = tl.load(State + row * _STATE_SLOTS + step % 2).to(tl.uint32)
    digit = tl.maximum(tl.sum((reached >= goal).to(tl.int32), axis=0) - 1, 0)  # `reached` falls with it
    shift = (32 - DIGIT_BITS * (step % LEVELS + 1)).to(tl.uint32)
    return prefix + (digit.to(tl.uint32) << shift)


@triton.jit
def _block_max_kernel(Logits, stride_row, n_cols, InvTemperature, BlockKey, ChunkMax, n_blocks, n_chunks,
                      BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    """Each chunk's largest logit; each block's largest `x` as an order key (greedy rows: of the logits)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = Logits + row.to(tl.int64) * stride_row
    scale = tl.load(InvTemperature + row)
    scale = tl.where(scale != 0.0, scale, 1.0)
    blocks = chunk * BLOCKS_PER_CHUNK + tl.arange(0, BLOCKS_PER_CHUNK)
    maxima = tl.full([BLOCKS_PER_CHUNK], float("-inf"), tl.float32)
    for j in tl.static_range(BLOCKS_PER_CHUNK):  # unrolled: every block's load in flight at once
        offs = (chunk * BLOCKS_PER_CHUNK + j) * BLOCK + tl.arange(0, BLOCK)
        logit = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        value = tl.max(logit, axis=0)
        maxima = tl.where(blocks == chunk * BLOCKS_PER_CHUNK + j, value, maxima)
    keys = _order_key(maxima * scale)  # above every key of its block: rounding keeps the order
    tl.store(BlockKey + row * n_blocks + blocks, keys.to(tl.int32, bitcast=True), mask=blocks < n_blocks)
    tl.store(ChunkMax + row * n_chunks + chunk, tl.max(maxima, axis=0))


@triton.jit(do_not_specialize=["step"])
def _digit_kernel(Logits, stride_row, n_cols, InvTemperature, TopK, TopP, BlockKey, ChunkMax, Partials, State,
                  Goal, n_blocks, n_chunks, step, MASS: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCKS_PER_CHUNK: tl.constexpr, CHUNKS: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """Launch `step` of the threshold searches: top-k's digits (MASS=False), then top-p's (MASS=True)."""
    LEVELS: tl.constexpr = 32 // DIGIT_BITS
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    row, chunk = tl.program_id(0), tl.program_id(1)
    state = State + row * _STATE_SLOTS
    scale = tl.load(InvTemperature + row)
    top_k, top_p = tl.load(TopK + row), tl.load(TopP + row)
    level = step % LEVELS
    kept_floor = tl.full((), 0, tl.uint32)  # the least key top-k keeps
    if MASS:
        if level == 0:  # top-k's last digit is decided here, once for every later launch
            if (scale != 0.0) & (top_k < n_cols):
                reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, RADIX)
                kept_floor = _extend(State, row, step - 1, reached, top_k.to(tl.float32), DIGIT_BITS)
            if chunk == 0:
                tl.store(state + _KEPT_FLOOR, kept_floor.to(tl.int64))
        else:
            kept_floor = tl.load(state + _KEPT_FLOOR).to(tl.uint32)
        searching = (scale != 0.0) & (top_p < 1.0)
        target = top_p
    else:
        searching = (scale != 0.0) & (top_k < n_cols)
        target = top_k.to(tl.float32)
    if searching:
        prefix = tl.full((), 0, tl.uint32)
        if level > 0:
            reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, RADIX)
            goal = target
            if MASS:
                if level == 1:  # candidate 0 of the first digit is every kept token: their total mass
                    goal = target * tl.sum(tl.where(tl.arange(0, RADIX) == 0, reached, 0.0), axis=0)
                    if chunk == 0:
                        tl.store(Goal + row, goal)
                else:
                    goal = tl.load(Goal + row)
            prefix = _extend(State, row, step - 1, reached, goal, DIGIT_BITS)
        if chunk == 0:
            tl.store(state + step % 2, prefix.to(tl.int64))
        m = _row_max(ChunkMax, row, n_chunks, CHUNKS) * scale  # max(logit) * scale: scale > 0
        shift = (32 - DIGIT_BITS * (level + 1)).to(tl.uint32)
        candidates = prefix + (tl.arange(0, RADIX).to(tl.uint32) << shift)
        least = tl.maximum(prefix, kept_floor)  # keys below it weigh nothing at any candidate
        partial = tl.zeros([BLOCK, RADIX], tl.float32)  # summed across lanes once, after the chunk
        row_ptr, block_keys, first, end, logit, wanted = _chunk_start(
            Logits, stride_row, BlockKey, row, chunk, n_blocks, n_cols, least, BLOCK, BLOCKS_PER_CHUNK)
        for block in range(first, first + BLOCKS_PER_CHUNK):
            # the next block's read is in flight while this one is summed
            logit_next, wanted_next = _read_block(row_ptr, block_keys, block + 1, end, n_cols, least, BLOCK)
            if wanted:
                x, key, valid = _scaled(logit, block, n_cols, scale, BLOCK)
                kept = valid & (key >= kept_floor)
                weight = tl.where(kept, tl.exp(x - m), 0.0) if MASS else kept.to(tl.float32)
                partial += tl.where(key[:, None] >= candidates[None, :], weight[:, None], 0.0)
            logit, wanted = logit_next, wanted_next
        d = tl.arange(0, RADIX)
        tl.store(Partials + ((row * 2 + step % 2) * n_chunks + chunk) * RADIX + d, tl.sum(partial, axis=0))


@triton.jit(do_not_specialize=["step"])
def _gumbel_max_kernel(Logits, stride_row, n_cols, InvTemperature, TopP, Key0, Key1, Steps, BlockKey,
                       ChunkMax, Partials, State, Goal, BestValue, BestIndex, n_blocks, n_chunks, step,
                       BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                       DIGIT_BITS: tl.constexpr):
    """Per (row, chunk): the lowest index of the largest `x + g` over kept tokens (`x` alone: greedy rows)."""
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    row, chunk = tl.program_id(0), tl.program_id(1)
    scale = tl.load(InvTemperature + row)
    sampled = scale != 0.0
    scale = tl.where(sampled, scale, 1.0)
    row_key = tl.full((), 0, tl.uint32)
    if sampled:
        if tl.load(TopP + row) < 1.0:  # top-p's last digit
            reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, RADIX)
            floor = _extend(State, row, step - 1, reached, tl.load(Goal + row), DIGIT_BITS)
        else:
            floor = tl.load(State + row * _STATE_SLOTS + _KEPT_FLOOR).to(tl.uint32)
        key0 = tl.load(Key0 + row).to(tl.uint32)
        key1 = tl.load(Key1 + row).to(tl.uint32)
        row_key = _mix32(_mix32(key0 ^ tl.load(Steps + row).to(tl.uint32)) ^ key1)
    else:  # greedy: the columns holding the largest logit
        floor = _order_key(_row_max(ChunkMax, row, n_chunks, CHUNKS))
    if chunk == 0:
        tl.store(State + row * _STATE_SLOTS + _FLOOR, floor.to(tl.int64))
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    row_ptr, block_keys, first, end, logit, wanted = _chunk_start(
        Logits, stride_row, BlockKey, row, chunk, n_blocks, n_cols, floor, BLOCK, BLOCKS_PER_CHUNK)
    for block in range(first, first + BLOCKS_PER_CHUNK):
        logit_next, wanted_next = _read_block(row_ptr, block_keys, block + 1, end, n_cols, floor, BLOCK)
        if wanted:
            x, key, valid = _scaled(logit, block, n_cols, scale, BLOCK)
            score = x
            if sampled:
                score = x + _gumbel(row_key, block * BLOCK + tl.arange(0, BLOCK))
            score = tl.where(valid & (key >= floor), score, float("-inf"))
            value, index = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            better = value > best
            best = tl.where(better, value, best)
            best_index = tl.where(better, block * BLOCK + index, best_index)
        logit, wanted = logit_next, wanted_next
    tl.store(BestValue + row * n_chunks + chunk, best)
    tl.store(BestIndex + row * n_chunks + chunk, best_index)


@triton.jit
def _pick_kernel(InvTemperature, Steps, BestValue, BestIndex, Out, n_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    values = tl.load(BestValue + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    _, which = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Out + row, tl.load(BestIndex + row * n_chunks + which).to(tl.int64))
    if tl.load(InvTemperature + row) != 0.0:
        tl.store(Steps + row, tl.load(Steps + row) + 1)


def sample_rows(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed_keys: torch.Tensor,
    steps: torch.Tensor,
    *,
    top_k_rows: bool = True,
    top_p_rows: bool = True,
    digit_bits: int = 4,
    block: int = 64,
    chunk: int = 2048,
    num_warps: int = 1,
    with_floors: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next token `[B]` int64 of each row of `logits` `[B, vocab]`; advances sampled rows' `steps`.

    Per row: `inv_temperature` (0: greedy), `top_k` (>= vocab: off), `top_p` (1: off) `[B]`,
    `seed_keys` `[2, B]` and `steps` `[B]` int64 (see `scheduling.sampling`). `top_k_rows=False` says no
    sampled row uses top-k, `top_p_rows=False` that none uses top-p: that search's digit launches are left
    out (the tokens are the same). `3 + 64 / digit_bits` launches with both (`digit_bits` 2, 4 or 8; 4: 19
    launches, 16 candidates a digit), 11 with top-p alone, 4 with neither; each runs a program per
    `chunk` columns of each row (rounded to a multiple of `block`, the columns a program reads at once).
    The defaults (the fastest in `bench/sampling_bench.py`'s sweep on the H200): one warp a program,
    16,128 programs a launch at 256 rows of 128,256 columns; the searches' launches are latency-bound, so
    many small programs beat fewer wide ones.
    `with_floors` also returns `[B]` int64: the order key of each row's least kept `x` (greedy: its
    maximum).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    state = torch.empty(rows, _STATE_SLOTS.value, dtype=torch.int64, device=logits.device)
    if not rows:
        return (out, state[:, _FLOOR.value]) if with_floors else out
    if digit_bits not in (2, 4, 8):
        raise ValueError(f"digit_bits must be 2, 4 or 8, got {digit_bits}")
    block = min(block, triton.next_power_of_2(vocab))
    n_blocks = triton.cdiv(vocab, block)
    blocks_per_chunk = triton.next_power_of_2(min(max(1, chunk // block), n_blocks))  # a tl.arange size
    n_chunks = triton.cdiv(n_blocks, blocks_per_chunk)
    levels, radix = 32 // digit_bits, 1 << digit_bits

    def scratch(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=logits.device)

    block_key, chunk_max = scratch(rows, n_blocks, dtype=torch.int32), scratch(rows, n_chunks)
    partials, goal = scratch(rows, 2, n_chunks, radix), scratch(rows)
    best_value, best_index = scratch(rows, n_chunks), scratch(rows, n_chunks, dtype=torch.int32)
    grid = (rows, n_chunks)
    sizes = dict(BLOCK=block, BLOCKS_PER_CHUNK=blocks_per_chunk)
    searches = dict(sizes, CHUNKS=triton.next_power_of_2(n_chunks), DIGIT_BITS=digit_bits)
    warps = min(num_warps, max(1, block // 64))
    row_args = (logits, logits.stride(0), vocab, inv_temperature)
    _block_max_kernel[grid](*row_args, block_key, chunk_max, n_blocks, n_chunks, **sizes, num_warps=warps,
                            enable_fp_fusion=FP_FUSION)
    # Top-p's first launch (step `levels`) always runs: it records top-k's floor, which Gumbel-max reads.
    top_k_steps = range(levels) if top_k_rows else ()
    top_p_steps = range(levels + 1, 2 * levels) if top_p_rows else ()
    for step in (*top_k_steps, levels, *top_p_steps):
        _digit_kernel[grid](*row_args, top_k, top_p, block_key, chunk_max, partials, state, goal, n_blocks,
                            n_chunks, step, MASS=step >= levels, **searches, num_warps=warps,
                            enable_fp_fusion=FP_FUSION)
    _gumbel_max_kernel[grid](
        *row_args, top_p, seed_keys[0], seed_keys[1], steps, block_key, chunk_max, partials, state, goal,
        best_value, best_index, n_blocks, n_chunks, 2 * levels, **searches, num_warps=warps,
        enable_fp_fusion=False,  # x * scale + g rounded twice, as torch rounds it
    )
    _pick_kernel[(rows,)](inv_temperature, steps, best_value, best_index, out, n_chunks,
                          CHUNKS=triton.next_power_of_2(n_chunks), enable_fp_fusion=FP_FUSION)
    return (out, state[:, _FLOOR.value]) if with_floors else out
