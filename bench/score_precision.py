"""Where bf16 scoring drift comes from: log-likelihoods against one unpadded HF forward per pair.

Llama-3.1-8B shape, random bf16 weights, (context, choice) pairs from `score_bench.py` (a shared few-shot
prefix + question, then a choice). Each system's |log-likelihood - reference| over the pairs:

* HF batched (lm-eval's way: right-padded batches of 16);
* hf_radix with the Triton attention backend and with the torch one (gather + SDPA), each with the
  default and with 256-token prefill chunks, all pairs in one run (prefix shared) and pairs alone.

If the torch backend drifts as much as the Triton one, the drift is bf16 rounding of other shapes (packed
tokens, kept logits), not the attention kernel.

    python bench/score_precision.py --json bench/results/score_precision_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_llama  # noqa: E402
from score_bench import hf_loglikelihood, make_workload, reference_loglikelihood  # noqa: E402

from hf_radix import RadixBatchRunner  # noqa: E402


def _drift(values: list[float], reference: np.ndarray) -> dict[str, float]:
    diff = np.abs(np.asarray(values) - reference[: len(values)])
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--alone", type=int, default=8, help="pairs also scored one at a time, cold cache")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cuda"
    model = build_llama(False, device)
    pairs = make_workload(args.questions, 4, 1500, 100, (5, 20), model.config.vocab_size, 0)
    reference = np.array(reference_loglikelihood(model, pairs, device))
    hf_batched = hf_loglikelihood(model, pairs, 16, device)
    result: dict = {"pairs": len(pairs), "hf_batched": _drift(hf_batched, reference)}
    for backend in ("triton", "torch"):
        for chunk in (8192, 256):
            runner = RadixBatchRunner(model, max_total_tokens=100_000, attn_backend=backend,
                                      chunked_prefill_size=chunk)
            runner.reset_cache()
            shared = [lp for lp, _ in runner.loglikelihood(pairs, progress=False)]
            alone = []
            for pair in pairs[: args.alone]:
                runner.reset_cache()
                alone.append(runner.loglikelihood([pair], progress=False)[0][0])
            runner.check_integrity()
            result[f"hf_radix_{backend}_chunk{chunk}"] = {
                "shared": _drift(shared, reference), "alone": _drift(alone, reference)
            }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
