"""bf16 scoring error of each system against a float32 reference, per (context, choice) pair.

The reference is the same random weights in float32 (TF32 off), one unpadded forward per pair, log-softmax
in float32. Against it, with the weights in bf16:

* `hf_bs1`: one unpadded bf16 forward per pair, float32 log-softmax (this script's yardstick before; it
  shares HF's own bf16 rounding, so HF's batches look closer to it than anything that rounds differently);
* `hf_padded16`: lm-eval's `hf` way, right-padded batches of 16, log-softmax in bf16 (its default,
  `softmax_dtype=None`) and in float32 (`softmax_dtype=float32`);
* `hf_bs1_eager`: HF's eager attention (float32 softmax): how much of the error is the attention kernel;
* `hf_bs1_kept`: `logits_to_keep` with the continuation positions only, as hf_radix asks for logits;
* hf_radix with the Triton and the torch attention backends, default and 256-token prefill chunks, all
  pairs in one run (prefix shared) and pairs alone (cold cache).

Each entry holds the mean and max |log-likelihood - reference| ("vs_fp32") and the same against `hf_bs1`.
Llama-3.1-8B shape on the GPU; `--tiny` runs a 4-layer, hidden-256 Llama with a 32k vocabulary on the CPU
(torch backend only).

    python bench/score_precision.py --json bench/results/score_precision_h200.json
    python bench/score_precision.py --tiny
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import LLAMA_8B, build_llama, parser_for, write_result  # noqa: E402
from score_bench import Pair, make_workload, padded_batches  # noqa: E402

from hf_radix import RadixBatchRunner  # noqa: E402

TINY = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=32000)


def unpadded(model, pairs: list[Pair], attention: str = "sdpa", kept: bool = False) -> np.ndarray:
    """One forward per pair; the continuation's log-probs from a float32 log-softmax."""
    model.config._attn_implementation = attention
    device = model.device
    out = []
    with torch.inference_mode():
        for context, choice in pairs:
            ids = torch.tensor([(context + choice)[:-1]], device=device)
            if kept:
                keep = torch.arange(len(context) - 1, ids.shape[1], device=device)
                logits = model(input_ids=ids, logits_to_keep=keep).logits[0]
            else:
                logits = model(input_ids=ids).logits[0, len(context) - 1:]
            logp = logits.float().log_softmax(-1)
            out.append(logp[torch.arange(len(choice)), torch.tensor(choice, device=device)].sum().item())
    model.config._attn_implementation = "sdpa"
    return np.array(out)


def padded(model, pairs: list[Pair], batch_size: int, softmax_dtype: torch.dtype | None) -> np.ndarray:
    """lm-eval's hf: longest first, right-padded batches, `log_softmax(dtype=softmax_dtype)`, gather."""
    device = model.device
    out = np.zeros(len(pairs))
    with torch.inference_mode():
        for rows, ids in padded_batches(pairs, batch_size):
            logits = model(input_ids=ids.to(device)).logits
            logp = torch.nn.functional.log_softmax(logits, -1, dtype=softmax_dtype)
            for r, i in enumerate(rows):
                context, choice = pairs[i]
                picked = logp[r, len(context) - 1:len(context) - 1 + len(choice)]
                out[i] = picked.gather(-1, torch.tensor(choice, device=device)[:, None]).float().sum().item()
    return out


def radix(model, pairs: list[Pair], backend: str, chunk: int, alone: int) -> tuple[np.ndarray, np.ndarray]:
    runner = RadixBatchRunner(model, max_total_tokens=100_000, attn_backend=backend,
                              chunked_prefill_size=chunk)
    runner.reset_cache()
    shared = np.array([lp for lp, _ in runner.loglikelihood(pairs, progress=False)])
    cold = []
    for pair in pairs[:alone]:
        runner.reset_cache()
        cold.append(runner.loglikelihood([pair], progress=False)[0][0])
    runner.check_integrity()
    return shared, np.array(cold)


def drift(values: np.ndarray, reference: np.ndarray, hf_bs1: np.ndarray) -> dict[str, float]:
    n = len(values)
    to_ref, to_hf = np.abs(values - reference[:n]), np.abs(values - hf_bs1[:n])
    return {"vs_fp32_mean": float(to_ref.mean()), "vs_fp32_max": float(to_ref.max()),
            "vs_hf_bs1_mean": float(to_hf.mean()), "vs_hf_bs1_max": float(to_hf.max())}


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--tiny", action="store_true", help="4-layer hidden-256 Llama on the CPU")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--question-len", type=int, default=100)
    parser.add_argument("--alone", type=int, default=8, help="pairs also scored one at a time, cold cache")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference that is float32
    torch.backends.cudnn.allow_tf32 = False
    if args.tiny:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**TINY)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        backends = ("torch",)
    else:
        model = build_llama(False, "cuda")
        backends = ("triton", "torch")
    pairs = make_workload(args.questions, 4, args.prefix_len, args.question_len, (5, 20),
                          model.config.vocab_size, 0)
    fp32 = copy.deepcopy(model).float()
    reference = unpadded(fp32, pairs)
    del fp32
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf_bs1 = unpadded(model, pairs)
    systems = {
        "hf_bs1": hf_bs1,
        "hf_padded16_softmax_bf16": padded(model, pairs, 16, None),
        "hf_padded16_softmax_fp32": padded(model, pairs, 16, torch.float32),
        "hf_bs1_eager": unpadded(model, pairs, attention="eager"),
        "hf_bs1_kept": unpadded(model, pairs, kept=True),
    }
    for backend in backends:
        for chunk in (8192, 256):
            shared, alone = radix(model, pairs, backend, chunk, args.alone)
            systems[f"hf_radix_{backend}_chunk{chunk}_shared"] = shared
            systems[f"hf_radix_{backend}_chunk{chunk}_alone"] = alone
    result = {
        "model": "tiny Llama (4 layers, hidden 256, 32k vocab), bf16, CPU" if args.tiny
        else "Llama-3.1-8B shape, random bf16 weights",
        "device": "cpu" if args.tiny else torch.cuda.get_device_name(),
        "pairs": len(pairs), "reference": "same weights in float32, unpadded, TF32 off",
        "torch": torch.__version__, "transformers": transformers.__version__,
        **{name: drift(values, reference, hf_bs1) for name, values in systems.items()},
    }
    write_result(result, args.json)


if __name__ == "__main__":
    main()
