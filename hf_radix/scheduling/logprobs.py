"""Log-probabilities of target tokens, computed in row chunks: no full fp32 `[N, vocab]` copies.

Scoring needs, per scored position, `log_softmax(logits)[target]` and whether the target is the argmax.
Taking all the rows at once, upcasting them and running `log_softmax` holds two fp32 `[N, vocab]`
tensors (8 GB for 8,192 rows of a 128K vocabulary). Here rows go in chunks of a bounded fp32 working
set; each row's arithmetic is the same row-wise `log_softmax`, so the values are those of the whole copy.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 256 << 20  # fp32 working set of one chunk of rows


def target_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None,
    fixed_shape: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each `i`: `log_softmax(logits[rows[i]].float())[targets[i]]` and whether it is the argmax.

    `rows` and `targets` are int64 `[N]` on the logits' device; returns fp32 `[N]` and bool `[N]`.
    `fixed_shape` (deterministic mode): every chunk has the same row count (the last one padded with copies
    of a row), so the same kernels, launched alike, compute every row whatever N is.
    """
    vocab = logits.shape[-1]
    step = chunk_rows or max(1, CHUNK_BYTES // (4 * vocab))
    logprobs = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    greedy = torch.empty(rows.shape[0], dtype=torch.bool, device=logits.device)
    for start in range(0, rows.shape[0], step):
        end = min(start + step, rows.shape[0])
        index, target = rows[start:end], targets[start:end, None]
        if fixed_shape and end - start < step:
            index = torch.cat([index, index[:1].expand(step - (end - start))])
            target = torch.cat([target, target[:1].expand(step - (end - start), 1)])
        x = logits.index_select(0, index).float()
        greedy[start:end] = (x.argmax(dim=-1, keepdim=True) == target)[: end - start, 0]
        logprobs[start:end] = x.log_softmax(dim=-1).gather(-1, target)[: end - start, 0]
    return logprobs, greedy
