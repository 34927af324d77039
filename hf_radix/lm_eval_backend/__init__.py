"""lm-evaluation-harness backend "hf-radix": lm-eval's `hf` backend semantics on a RadixBatchRunner.

    import hf_radix.lm_eval_backend  # registers "hf-radix"
    lm_eval.simple_evaluate(model="hf-radix", model_args={"pretrained": "meta-llama/Llama-3.1-8B"},
                            tasks=["mmlu"], num_fewshot=5)

From the shell: `hf-radix-lm-eval --model_args pretrained=... --tasks ...` (lm-eval's own CLI with the model
registered and `--model hf-radix` the default), or `python -m hf_radix.lm_eval_backend` with the same
arguments. See docs/lm_eval.md.
"""

from .cli import main
from .model import HFRadixLM

__all__ = ["HFRadixLM", "main"]
