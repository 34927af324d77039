"""lm-evaluation-harness backend "hf-radix": every request goes through one RadixBatchRunner.

Tokenization follows lm-eval's own "hf" backend (context/continuation split of the whole encoded string,
trailing context spaces moved to the continuation, left truncation to `max_length`, BOS/EOS prefix for
empty contexts and rolling windows), so per-sample log-likelihoods agree with it; the difference is that
shared few-shot prefixes and contexts are computed once.

    import hf_radix.lm_eval_backend  # registers "hf-radix"
    lm_eval.simple_evaluate(model="hf-radix", model_args={"pretrained": "meta-llama/Llama-3.1-8B"},
                            tasks=["mmlu"], num_fewshot=5)

From the shell: `python -m hf_radix.lm_eval_backend --model hf-radix --model_args pretrained=... --tasks ...`.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, resolve_max_length
from transformers.utils import logging

from .evaluation import loglikelihood_rolling
from .sampling import SamplingParams
from .scheduler import RadixBatchRunner

logger = logging.get_logger(__name__)

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")
_IGNORED_KEYS = ("do_sample", "until", "max_gen_toks")


def _dtype(value: str | torch.dtype | None) -> str | torch.dtype:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value or "auto"
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r}; use auto, bfloat16, float16 or float32")
    return dtype


@register_model("hf-radix")
class HFRadixLM(TemplateLM):
    """lm-eval model backed by a RadixBatchRunner (radix prefix reuse, continuous batching).

    `pretrained` is a hub id or local path (loaded with AutoModelForCausalLM / AutoTokenizer) or an
    already-built causal LM; `tokenizer` likewise (default: the one of `pretrained`). The remaining
    options go to the runner. `batch_size`/`max_batch_size` are accepted for CLI compatibility and
    ignored: the runner batches by tokens (`chunked_prefill_size`, `max_running_requests`).
    """

    def __init__(
        self,
        pretrained: str | transformers.PreTrainedModel,
        tokenizer: str | transformers.PreTrainedTokenizerBase | None = None,
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        page_size: int = 1,
        max_total_tokens: int | None = None,
        mem_fraction: float = 0.85,
        chunked_prefill_size: int = 8192,
        max_running_requests: int = 256,
        schedule_policy: str = "lpm",
        attn_backend: str = "auto",
        cuda_graph: bool = True,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
    ):
        super().__init__()
        if isinstance(pretrained, str):
            # lm-eval's CLI passes device="cuda" by default; like its "hf" backend, fall back to the CPU
            if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else "cpu"
            model = transformers.AutoModelForCausalLM.from_pretrained(
                pretrained, dtype=_dtype(dtype), revision=revision, trust_remote_code=trust_remote_code
            )
            model = model.to(device)
        else:
            model = pretrained
            if device is not None and torch.device(device).type != model.device.type:
                logger.warning("hf-radix: ignoring device=%s for a model already on %s", device, model.device)
        model.eval()
        if tokenizer is None:
            source = pretrained if isinstance(pretrained, str) else model.config.name_or_path
            if not source:
                raise ValueError("pass `tokenizer` along with a model object that has no name_or_path")
            tokenizer = source
        if isinstance(tokenizer, str):
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                tokenizer, revision=revision, trust_remote_code=trust_remote_code
            )
        self.tokenizer = tokenizer
        self.runner = RadixBatchRunner(
            model, tokenizer, page_size=page_size, max_total_tokens=max_total_tokens,
            mem_fraction=mem_fraction, max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size, schedule_policy=schedule_policy,
            attn_backend=attn_backend, cuda_graph=cuda_graph,
        )
        self._device = model.device
        self._max_length = max_length or resolve_max_length(model.config, tokenizer)
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id

    # -- tokens --------------------------------------------------------------------------------------
    @property
    def model(self) -> transformers.PreTrainedModel:
        return self.runner.model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Token that an empty context (and the first rolling window) is conditioned on: BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the "hf" backend: the tokenizer's default special tokens unless told (or BOS is there)."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            bos = self.tokenizer.decode(self.prefix_token_id)
            if bos and string.startswith(bos):
                add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **options)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- requests ------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Scores `(key | None, context_ids, continuation_ids)` triples in one runner call."""
        pairs = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}"
                )
            whole = (context + continuation)[-(self.max_length + 1):]  # the model sees at most max_length
            pairs.append((whole[:len(whole) - len(continuation)], continuation))
        results = self.runner.loglikelihood(pairs, progress=False if disable_tqdm else None)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        strings = [req.args[0] for req in requests]
        totals = loglikelihood_rolling(
            self.runner, [self.tok_encode(s) for s in strings], False if disable_tqdm else None,
            prefix_token_id=self.prefix_token_id, max_length=self.max_length,
        )
        for string, total in zip(strings, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            prompts.append(self.tok_encode(context))
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            params.append(self._sampling_params(kwargs, handle_stop_sequences(kwargs["until"], eos=eos)))
        for ids, p in zip(prompts, params):
            room = self.max_length - p.max_new_tokens
            if room <= 0:
                raise ValueError(
                    f"max_gen_toks ({p.max_new_tokens}) must be below max_length ({self.max_length})"
                )
            del ids[:-room]  # keep the last `room` tokens, like the "hf" backend's left truncation
        outputs = self.runner.run(prompts, params, progress=False if disable_tqdm else None)
        texts = []
        for req, out in zip(requests, outputs):
            if out.finish_reason == "error":
                raise ValueError(f"hf-radix generation failed: {out.error}")
            texts.append(out.text)
            self.cache_hook.add_partial("generate_until", req.args, out.text)
        return texts

    @staticmethod
    def _sampling_params(kwargs: dict[str, Any], until: list[str]) -> SamplingParams:
        unknown = sorted(set(kwargs) - set(_SAMPLING_KEYS) - set(_IGNORED_KEYS))
        if unknown:
            logger.warning("hf-radix: ignoring generation kwargs %s", unknown)
        options = {k: kwargs[k] for k in _SAMPLING_KEYS if kwargs.get(k) is not None}
        if not kwargs.get("do_sample"):
            options["temperature"] = 0.0
        stop = [s for s in until if s]
        return SamplingParams(max_new_tokens=int(kwargs["max_gen_toks"]), stop=stop, **options)


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
