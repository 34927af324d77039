"""Samples every row of a batch in a fixed number of Triton launches: greedy, temperature, top-k, top-p, seed.

Each row is cut into chunks of `chunk` columns (blocks of `block` columns each); every launch runs one
program per (row, chunk), which issues the loads of its whole chunk at once, so a launch has
`rows * chunks` programs:

1. `_block_max_kernel`: each block's and each chunk's largest logit (the row maximum `m` of
   `x = logit * inv_temperature` is the largest chunk maximum times the scale);
2. `_digit_kernel`, `32 / DIGIT_BITS` launches for top-k then as many for top-p (a search no row of the
   batch uses is not launched): the threshold is found digit by digit on the float's order-preserving
   32-bit key. Launch `s` sums, per chunk, the weights at or above each of its digit's
   `2**DIGIT_BITS` candidate keys (1 for top-k, where the target is `k`; `exp(x - m)` over the top-k
   tokens for top-p, where it is `top_p` of their mass) into a `[rows, 2, chunks, candidates]` scratch
   (by the launch's parity). Each program of launch `s + 1` sums its row's partials over the chunks in a
   fixed order, so every program of a row picks the same digit; the row's chunk 0 records the prefix for
   the launch after. Blocks whose maximum key is below the current candidate bucket hold no weight in it
   and are not read, and a chunk with none left to read computes nothing: past the first digits a search
   reads only the blocks holding the row's largest values;
3. `_gumbel_max_kernel`: per chunk, the lowest index of the largest `x + g` among the kept tokens
   (blocks whose maximum is below the threshold skipped), `g` a counter-based Gumbel variate of (the
   row's seed keys, its step, the token's index) computed in the kernel (`hf_radix.sampling` defines the
   same numbers in torch); greedy rows: the first column holding the row's maximum logit;
4. `_pick_kernel`: per row, the best of its chunks (the lowest chunk on ties); advances sampled rows' steps.

No atomics and no host syncs: the tokens are the same from call to call, and a row's token depends on
its own logits and parameters only (its partials are summed in the same order in any batch). The rule
is the one `hf_radix.sampling.sample_rows_torch` computes with a sort; the two agree exactly except
where a token sits within float rounding of the nucleus boundary (sums in another order) or two
perturbed scores are within an ulp (`log` of another library).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..sampling import SamplingRows

# Keep in step with hf_radix.sampling (mix32, column and row keys, uniform from the top 24 bits).
_MIX_0 = tl.constexpr(0x21F0AAAD)
_MIX_1 = tl.constexpr(0x735A2D97)
_COLUMN_SALT = tl.constexpr(0x27D4EB2F)
# State[row, :]: a search's prefix by launch parity (0, 1), the least key top-k keeps, the least key kept
_KEPT_FLOOR = tl.constexpr(2)
_FLOOR = tl.constexpr(3)
_STATE_SLOTS = tl.constexpr(4)


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
def _order_key(x):
    """uint32 keys ordered as the fp32 values `x` are (-0 and +0 share one)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    return tl.where(x == 0.0, sign, tl.where((bits & sign) != 0, ~bits, bits | sign))


@triton.jit
def _chunk_offsets(chunk, BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    """`[BLOCKS_PER_CHUNK]` block indices of a chunk and `[BLOCKS_PER_CHUNK, BLOCK]` its columns."""
    blocks = chunk * BLOCKS_PER_CHUNK + tl.arange(0, BLOCKS_PER_CHUNK)
    return blocks, blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]


@triton.jit
def _read_chunk(Logits, stride_row, n_cols, scale, BlockKey, n_blocks, end, least, row, chunk,
                BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    """A chunk's `x = logit * scale` and order keys `[BLOCKS_PER_CHUNK, BLOCK]`, which lanes were read, and
    whether any was: only blocks before block `end` whose largest key is at least `least` (the others move
    no memory). Every block's load is issued at once."""
    blocks, offs = _chunk_offsets(chunk, BLOCK, BLOCKS_PER_CHUNK)
    inside = blocks < end
    block_keys = tl.load(BlockKey + row * n_blocks + blocks, mask=inside, other=0).to(tl.uint32, bitcast=True)
    read = (inside & (block_keys >= least))[:, None] & (offs < n_cols)
    logit = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=read, other=float("-inf"))
    x = logit.to(tl.float32) * scale
    return x, _order_key(x), read, tl.max(tl.max(read.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def _row_max(ChunkMax, row, n_chunks, CHUNKS: tl.constexpr):
    """The row's largest `x`, from its chunk maxima."""
    c = tl.arange(0, CHUNKS)
    return tl.max(tl.load(ChunkMax + row * n_chunks + c, mask=c < n_chunks, other=float("-inf")), axis=0)


@triton.jit
def _total_mass(ChunkMax, ChunkMass, row, n_chunks, m, CHUNKS: tl.constexpr):
    """The row's `sum(exp(x - m))`, from each chunk's maximum and mass below it (chunks in order)."""
    c = tl.arange(0, CHUNKS)
    top = tl.load(ChunkMax + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    mass = tl.load(ChunkMass + row * n_chunks + c, mask=c < n_chunks, other=0.0)
    return tl.sum(tl.where(top > float("-inf"), mass * tl.exp(top - m), 0.0), axis=0)


@triton.jit
def _bound_digit(BlockKey, row, n_blocks, prefix, step_size, kept_floor, need, m, MASS: tl.constexpr,
                 BOUND_BLOCKS: tl.constexpr, RADIX: tl.constexpr):
    """The largest candidate whose weight is at least `need` counting the block maxima alone (-1: none),
    `BOUND_BLOCKS` of them at a time. Each block maximum is one of the tokens a launch sums, so the
    launch's own sum reaches the bound too."""
    candidates = prefix + step_size * tl.arange(0, RADIX).to(tl.uint32)
    bound = tl.zeros([RADIX], tl.float32)
    for first in range(0, n_blocks, BOUND_BLOCKS):
        b = first + tl.arange(0, BOUND_BLOCKS)
        keys = tl.load(BlockKey + row * n_blocks + b, mask=b < n_blocks, other=0).to(tl.uint32, bitcast=True)
        counted = (b < n_blocks) & (keys >= kept_floor)
        if MASS:
            sign = tl.full(keys.shape, 0x80000000, tl.uint32)
            value = tl.where(keys >= sign, keys ^ sign, ~keys).to(tl.float32, bitcast=True)  # the key undone
            weight = tl.where(counted, tl.exp(value - m), 0.0)
        else:
            weight = counted.to(tl.float32)
        bound += tl.sum(tl.where(keys[:, None] >= candidates[None, :], weight[:, None], 0.0), axis=0)
    return tl.sum((bound >= need).to(tl.int32), axis=0) - 1  # the bound falls with the candidate


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
def _top_k_floor(Partials, State, row, step, top_k, n_cols, n_chunks, CHUNKS: tl.constexpr,
                 DIGIT_BITS: tl.constexpr):
    """The least key top-k keeps (0: top-k off), launch `step` being the one after top-k's last digit."""
    floor = tl.full((), 0, tl.uint32)
    if top_k < n_cols:
        reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, 1 << DIGIT_BITS)
        floor = _extend(State, row, step - 1, reached, top_k.to(tl.float32), DIGIT_BITS)
    return floor


@triton.jit
def _block_max_kernel(Logits, stride_row, n_cols, InvTemperature, BlockKey, ChunkMax, ChunkMass, n_blocks,
                      n_chunks, BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr):
    """Each block's largest `x` as an order key, each chunk's largest `x` and its `sum(exp(x - max))`
    (greedy rows: of the logits)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    scale = tl.load(InvTemperature + row)
    scale = tl.where(scale != 0.0, scale, 1.0)
    blocks, offs = _chunk_offsets(chunk, BLOCK, BLOCKS_PER_CHUNK)
    logit = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=offs < n_cols, other=float("-inf"))
    x = logit.to(tl.float32) * scale
    maxima = tl.max(x, axis=1)
    tl.store(BlockKey + row * n_blocks + blocks, _order_key(maxima).to(tl.int32, bitcast=True),
             mask=blocks < n_blocks)
    top = tl.max(maxima, axis=0)
    mass = tl.sum(tl.sum(tl.where(x > float("-inf"), tl.exp(x - top), 0.0), axis=1), axis=0)
    tl.store(ChunkMax + row * n_chunks + chunk, top)
    tl.store(ChunkMass + row * n_chunks + chunk, mass)


@triton.jit(do_not_specialize=["step", "top_k_searched"])
def _digit_kernel(Logits, stride_row, n_cols, InvTemperature, TopK, TopP, BlockKey, ChunkMax, ChunkMass,
                  Partials, State, Goal, n_blocks, n_chunks, step, top_k_searched, MASS: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                  BOUND_BLOCKS: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """Launch `step` of the threshold searches: top-k's digits (MASS=False), then top-p's (MASS=True; when
    `top_k_searched` is 0, top-k's launches did not run and every row keeps all its tokens before top-p).

    Where the goal is known before the launch (top-k's `k`; top-p's share of the total mass, known from the
    chunk masses unless top-k keeps a subset), the block maxima bound the weight at each candidate from
    below: the launch reads only blocks at or above the largest candidate they already show reaching the
    goal (the sums there are the same as over all blocks: the others add zeros), and none where that
    candidate is the row maximum's (nothing lies above it: it is the digit)."""
    LEVELS: tl.constexpr = 32 // DIGIT_BITS
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    row, chunk = tl.program_id(0), tl.program_id(1)
    state = State + row * _STATE_SLOTS
    scale = tl.load(InvTemperature + row)
    top_k, top_p = tl.load(TopK + row), tl.load(TopP + row)
    level = step % LEVELS
    d = tl.arange(0, RADIX)
    kept_floor = tl.full((), 0, tl.uint32)  # the least key top-k keeps
    if MASS:
        if level == 0:  # top-k's last digit is decided here, once for every later launch
            if (scale != 0.0) & (top_k_searched != 0):
                kept_floor = _top_k_floor(Partials, State, row, step, top_k, n_cols, n_chunks, CHUNKS,
                                          DIGIT_BITS)
            if chunk == 0:
                tl.store(state + _KEPT_FLOOR, kept_floor.to(tl.int64))
        else:
            kept_floor = tl.load(state + _KEPT_FLOOR).to(tl.uint32)
        searching = (scale != 0.0) & (top_p < 1.0)
    else:
        searching = (scale != 0.0) & (top_k < n_cols)
    if searching:
        m = _row_max(ChunkMax, row, n_chunks, CHUNKS)
        prefix = tl.full((), 0, tl.uint32)
        goal = top_k.to(tl.float32)
        known_goal = True
        if MASS:
            if level == 0:  # right where every token is kept; top-k's subset: its mass is summed here
                goal = top_p * _total_mass(ChunkMax, ChunkMass, row, n_chunks, m, CHUNKS)
                known_goal = kept_floor == 0
                if chunk == 0:
                    tl.store(Goal + row, goal)
            else:
                goal = tl.load(Goal + row)
        if level > 0:
            reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, RADIX)
            if (level == 1) & (kept_floor != 0):  # top-p after top-k: candidate 0 of the first digit
                goal = top_p * tl.sum(tl.where(d == 0, reached, 0.0), axis=0)
                if chunk == 0:
                    tl.store(Goal + row, goal)
            prefix = _extend(State, row, step - 1, reached, goal, DIGIT_BITS)
        if chunk == 0:
            tl.store(state + step % 2, prefix.to(tl.int64))
        shift = (32 - DIGIT_BITS * (level + 1)).to(tl.uint32)
        step_size = tl.full((), 1, tl.uint32) << shift
        least = tl.maximum(prefix, kept_floor)  # keys below it weigh nothing at any candidate
        digit = tl.full((), -1, tl.int32)
        if known_goal:  # fp32 sums of other orders: the bound must clear the goal by a margin
            need = goal * (1.0 + 2.0**-10) if MASS else goal
            digit = _bound_digit(BlockKey, row, n_blocks, prefix, step_size, kept_floor, need, m, MASS,
                                 BOUND_BLOCKS, RADIX)
            if digit >= 0:
                least = tl.maximum(prefix + step_size * digit.to(tl.uint32), kept_floor)
        highest = tl.minimum((_order_key(m) - prefix) >> shift, RADIX - 1).to(tl.int32)  # m's candidate
        known = digit == highest
        x, key, read, anything = _read_chunk(Logits, stride_row, n_cols, scale, BlockKey, n_blocks,
                                             tl.where(known, 0, n_blocks), least, row, chunk, BLOCK,
                                             BLOCKS_PER_CHUNK)
        partial = Partials + ((row * 2 + step % 2) * n_chunks + chunk) * RADIX
        if anything:
            kept = read & (key >= kept_floor)
            weight = tl.where(kept, tl.exp(x - m), 0.0) if MASS else kept.to(tl.float32)
            candidate = prefix
            for i in tl.static_range(RADIX):
                if i > 0:  # (not past the last: it would wrap)
                    candidate += step_size
                tl.store(partial + i, tl.sum(tl.where(key >= candidate, weight, 0.0)))
        else:  # nothing read: no weight here, or the digit known (every candidate up to it reached)
            tl.store(partial + d, tl.where(known & (chunk == 0) & (d <= digit), float("inf"), 0.0))


@triton.jit(do_not_specialize=["step", "top_k_searched", "top_p_searched"])
def _gumbel_max_kernel(Logits, stride_row, n_cols, InvTemperature, TopK, TopP, Key0, Key1, Steps, BlockKey,
                       ChunkMax, Partials, State, Goal, BestValue, BestIndex, n_blocks, n_chunks, step,
                       top_k_searched, top_p_searched, BLOCK: tl.constexpr, BLOCKS_PER_CHUNK: tl.constexpr,
                       CHUNKS: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """Per (row, chunk): the lowest index of the largest `x + g` over kept tokens (`x` alone: greedy rows).
    Launch `step` follows the last search that ran (`top_p_searched`, `top_k_searched`: which did)."""
    RADIX: tl.constexpr = 1 << DIGIT_BITS
    row, chunk = tl.program_id(0), tl.program_id(1)
    scale = tl.load(InvTemperature + row)
    sampled = scale != 0.0
    scale = tl.where(sampled, scale, 1.0)
    row_key = tl.full((), 0, tl.uint32)
    if sampled:
        if top_p_searched != 0:
            if tl.load(TopP + row) < 1.0:  # top-p's last digit
                reached = _reached(Partials, row, (step - 1) % 2, n_chunks, CHUNKS, RADIX)
                floor = _extend(State, row, step - 1, reached, tl.load(Goal + row), DIGIT_BITS)
            else:
                floor = tl.load(State + row * _STATE_SLOTS + _KEPT_FLOOR).to(tl.uint32)
        elif top_k_searched != 0:  # top-k's last digit
            floor = _top_k_floor(Partials, State, row, step, tl.load(TopK + row), n_cols, n_chunks, CHUNKS,
                                 DIGIT_BITS)
        else:
            floor = tl.full((), 0, tl.uint32)
        key0 = tl.load(Key0 + row).to(tl.uint32)
        key1 = tl.load(Key1 + row).to(tl.uint32)
        row_key = _mix32(_mix32(key0 ^ tl.load(Steps + row).to(tl.uint32)) ^ key1)
    else:  # greedy: the columns holding the largest logit
        floor = _order_key(_row_max(ChunkMax, row, n_chunks, CHUNKS))
    if chunk == 0:
        tl.store(State + row * _STATE_SLOTS + _FLOOR, floor.to(tl.int64))
    x, key, read, anything = _read_chunk(Logits, stride_row, n_cols, scale, BlockKey, n_blocks, n_blocks,
                                         floor, row, chunk, BLOCK, BLOCKS_PER_CHUNK)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    if anything:
        _, offs = _chunk_offsets(chunk, BLOCK, BLOCKS_PER_CHUNK)
        score = x
        if sampled:
            score = x + _gumbel(row_key, offs)
        score = tl.where(read & (key >= floor), score, float("-inf"))
        # the lowest column on ties: the lowest lane of the lowest block
        values, lanes = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
        best, which = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        blocks = tl.arange(0, BLOCKS_PER_CHUNK)
        lane = tl.sum(tl.where(blocks == which, lanes, 0), axis=0)
        best_index = ((chunk * BLOCKS_PER_CHUNK + which) * BLOCK + lane).to(tl.int32)
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


def sample_rows(logits: torch.Tensor, rows: SamplingRows, **config: int) -> torch.Tensor:
    """Next token `[B]` int64 of each row of `logits` `[B, vocab]` under `rows`' parameters (see
    `hf_radix.sampling.SamplingRows`); advances sampled rows' steps. `config`: `sample_rows_and_floors`'."""
    return sample_rows_and_floors(logits, rows, **config)[0]


def sample_rows_and_floors(
    logits: torch.Tensor,
    rows: SamplingRows,
    *,
    digit_bits: int = 4,
    block: int = 256,
    chunk: int = 4096,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows`, and `[B]` int64: the order key of each row's least kept `x` (greedy: its maximum).

    `3 + 32 / digit_bits` launches per search a row of the batch may use (`rows.top_k_used`,
    `rows.top_p_used`): 19 with top-k and top-p at `digit_bits` 4 (16 candidates a digit; 2 or 8 also
    run), 11 with one of them, 3 with neither. Each launch runs a program per `chunk` columns of each row
    (a power of two, at least `block`); `block` columns share one maximum, the unit of skipping. The
    defaults (16 columns a thread): at most 78 registers on sm_90, 8,192 programs a launch at 256 rows of
    128,256 columns.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    state = torch.empty(batch, _STATE_SLOTS.value, dtype=torch.int64, device=logits.device)
    if not batch:
        return out, state[:, _FLOOR.value]
    if digit_bits not in (2, 4, 8):
        raise ValueError(f"digit_bits must be 2, 4 or 8, got {digit_bits}")
    if block & (block - 1) or chunk & (chunk - 1) or not 0 < block <= chunk:
        raise ValueError(f"block and chunk must be powers of two with block <= chunk, got {block}, {chunk}")
    block = min(block, triton.next_power_of_2(vocab))
    n_blocks = triton.cdiv(vocab, block)
    blocks_per_chunk = min(chunk // block, triton.next_power_of_2(n_blocks))
    n_chunks = triton.cdiv(n_blocks, blocks_per_chunk)
    levels, radix = 32 // digit_bits, 1 << digit_bits

    def scratch(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=logits.device)

    block_key, chunk_max = scratch(batch, n_blocks, dtype=torch.int32), scratch(batch, n_chunks)
    chunk_mass = scratch(batch, n_chunks)
    partials, goal = scratch(batch, 2, n_chunks, radix), scratch(batch)
    best_value, best_index = scratch(batch, n_chunks), scratch(batch, n_chunks, dtype=torch.int32)
    grid = (batch, n_chunks)
    sizes = dict(BLOCK=block, BLOCKS_PER_CHUNK=blocks_per_chunk)
    searches = dict(sizes, CHUNKS=triton.next_power_of_2(n_chunks), DIGIT_BITS=digit_bits)
    warps = min(num_warps, max(1, block * blocks_per_chunk // 256))
    bound_blocks = min(triton.next_power_of_2(n_blocks), 64 * warps)  # 32 values a thread at 16 candidates
    row_args = (logits, logits.stride(0), vocab, rows.inv_temperature)
    _block_max_kernel[grid](*row_args, block_key, chunk_max, chunk_mass, n_blocks, n_chunks, **sizes,
                            num_warps=warps)
    steps = [*range(levels)] if rows.top_k_used else []
    steps += [*range(levels, 2 * levels)] if rows.top_p_used else []
    for step in steps:
        _digit_kernel[grid](*row_args, rows.top_k, rows.top_p, block_key, chunk_max, chunk_mass, partials,
                            state, goal, n_blocks, n_chunks, step, int(rows.top_k_used), MASS=step >= levels,
                            BOUND_BLOCKS=bound_blocks, **searches, num_warps=warps)
    _gumbel_max_kernel[grid](
        *row_args, rows.top_k, rows.top_p, rows.seed_keys[0], rows.seed_keys[1], rows.steps, block_key,
        chunk_max, partials, state, goal, best_value, best_index, n_blocks, n_chunks, (steps or [-1])[-1] + 1,
        int(rows.top_k_used), int(rows.top_p_used), **searches, num_warps=warps,
        enable_fp_fusion=False,  # x * scale + g rounded twice, as torch rounds it
    )
    _pick_kernel[(batch,)](rows.inv_temperature, rows.steps, best_value, best_index, out, n_chunks,
                           CHUNKS=triton.next_power_of_2(n_chunks))
    return out, state[:, _FLOOR.value]
