"""Built-in demo: a tiny random-weight model, a shared system prompt, and the three ways to use hf_radix.

Run with `python -m hf_radix.demo` (no downloads).
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.tiny import ARCHITECTURES, tiny_model, tiny_tokenizer

SYSTEM = (
    "You are a helpful assistant. Answer briefly and precisely. Few-shot benchmarks repeat the same "
    "examples before every question. Question: what is the capital of France? Answer: Paris. "
)
QUESTIONS = [f"Question: how many legs does a spider have, case {i}? Answer:" for i in range(32)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    tokenizer = tiny_tokenizer()
    model = tiny_model(args.arch)
    runner = RadixBatchRunner(model, tokenizer, page_size=args.page_size, max_total_tokens=16384)
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    start = time.perf_counter()
    outs = runner.run(prompts, params, progress=True)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    runner.run(prompts, params, progress=False)
    warm = time.perf_counter() - start
    runner.check_integrity()
    print(f"runner: {len(prompts)} prompts sharing a {len(tokenizer(SYSTEM).input_ids)}-token system prompt")
    print(f"  first run {cold:.2f}s, repeated run {warm:.2f}s; {runner.stats}")
    print(f"  prompt 0 -> {outs[0].text!r} ({outs[0].finish_reason}, {outs[0].cached_tokens} cached tokens)")

    batch = tokenizer(prompts[:4], return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False, cache_implementation="radix")
    print(f"generate(cache_implementation='radix'): {out.shape[0]} rows; stats {hf_radix.cache_stats(model)}")

    scores = runner.loglikelihood([(SYSTEM + QUESTIONS[0], c) for c in (" Paris.", " eight.", " ten.")])
    print("loglikelihood of three answers:", [round(s, 3) for s, _ in scores])
    runner.check_integrity()


if __name__ == "__main__":
    main()
