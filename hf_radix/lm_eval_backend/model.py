"""The "hf-radix" lm-eval model: lm-eval's `hf` backend semantics, every request through one RadixBatchRunner.

Tokenization follows `hf` (context/continuation split of the whole encoded string, trailing context spaces
moved to the continuation, left truncation to `max_length`, BOS/EOS prefix for empty contexts and rolling
windows, `add_bos_token` given to the tokenizer), so per-sample log-likelihoods and greedy generations
agree with it; shared few-shot prefixes and contexts are computed once.
"""

from __future__ import annotations

from typing import Any

import jinja2
import torch
import transformers
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm.auto import tqdm
from transformers.utils import logging

from ..integrations.evaluation import loglikelihood_rolling
from ..options import EngineOptions
from ..runner import RadixBatchRunner
from . import generate, model_args
from .model_info import ReuseCounter, model_info

logger = logging.get_logger(__name__)

# model_args of hf-radix itself beyond the `hf` ones in the signature: the scheduler's, and every engine
# option (`EngineOptions` fields, docs/options.md; `cuda_graph` and `warm_up` as RadixBatchRunner takes them)
RUNNER_ARGS = ["chunked_prefill_size", "max_running_requests", "schedule_policy", "max_gen_toks"]
HF_ARGS = [
    "pretrained",
    "tokenizer",
    "backend",
    "revision",
    "subfolder",
    "dtype",
    "device",
    "trust_remote_code",
    "max_length",
    "add_bos_token",
    "prefix_token_id",
    "softmax_dtype",
    "truncation",
    "use_fast_tokenizer",
    "peft",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
    "batch_size",
    "max_batch_size",
]


@register_model("hf-radix")
class HFRadixLM(TemplateLM):
    """lm-eval model backed by a RadixBatchRunner (radix prefix reuse, continuous batching).

    Takes `hf`'s model_args (see docs/lm_eval.md for which are no-ops and which are refused), the runner's
    (`chunked_prefill_size`, `max_running_requests`, `schedule_policy`) and every engine option
    (`EngineOptions`, docs/options.md; strings converted to its types; left out: the engine as configured).
    `pretrained` is a hub id or path, or a causal LM object; `tokenizer` likewise (default: the one of
    `pretrained`).
    """

    def __init__(
        self,
        pretrained: str | transformers.PreTrainedModel,
        tokenizer: str | transformers.PreTrainedTokenizerBase | None = None,
        backend: str = "default",
        revision: str | None = "main",
        subfolder: str = "",
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        trust_remote_code: bool = False,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        softmax_dtype: str | torch.dtype | None = None,
        truncation: bool = False,
        use_fast_tokenizer: bool = True,
        peft: str | None = None,
        think_end_token: str | int | None = None,
        enable_thinking: bool | None = None,
        chat_template_args: dict[str, Any] | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        chunked_prefill_size: int = 8192,
        max_running_requests: int = 256,
        schedule_policy: str = "lpm",
        **kwargs,
    ):
        super().__init__()
        engine_options = model_args.engine_options(kwargs)  # taken out of kwargs
        model_args.check_unknown(kwargs, HF_ARGS + RUNNER_ARGS + list(EngineOptions.names()))
        if backend not in ("default", "causal"):
            raise ValueError(
                f"hf-radix: backend={backend!r}: only decoder-only (causal) models are supported"
            )
        if model_args.batch_size_set(batch_size, max_batch_size):
            logger.info_once(f"hf-radix: {model_args.BATCH_NOTE}")
        if enable_thinking and think_end_token is None:
            raise ValueError("hf-radix: enable_thinking=True needs think_end_token (as lm-eval's hf backend)")
        model, tokenizer, self._num_parameters = model_args.load(
            pretrained,
            tokenizer,
            dtype=dtype,
            device=device,
            peft=peft,
            use_fast=use_fast_tokenizer,
            add_bos_token=add_bos_token,
            revision=revision,
            subfolder=subfolder,
            trust_remote_code=trust_remote_code,
        )
        model.eval()
        self.tokenizer = tokenizer
        self._max_length = max_length or resolve_max_length(model.config, tokenizer)
        model_args.check_positions(model, self._max_length)
        self.runner = RadixBatchRunner(
            model,
            tokenizer,
            max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size,
            schedule_policy=schedule_policy,
            **engine_options,
        )
        engine = self.runner.engine
        # like hf, a max_length above max_position_embeddings runs (check_positions allowed it)
        engine.max_context = max(engine.max_context, self._max_length)
        self._pool_tokens = engine.manager.num_pages * engine.page_size
        if self._max_length > self._pool_tokens:
            raise ValueError(
                f"hf-radix: max_length={self._max_length} does not fit the KV pool "
                f"({self._pool_tokens} tokens); "
                "raise max_total_tokens or mem_fraction, or lower max_length"
            )
        self._max_rows = max_running_requests
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.truncation = truncation
        self.think_end_token = int(think_end_token) if str(think_end_token).isdigit() else think_end_token
        self.enable_thinking = enable_thinking
        self.chat_template_args = {**(chat_template_args or {})}
        if enable_thinking is not None:
            self.chat_template_args["enable_thinking"] = enable_thinking
        self.pretrained = pretrained
        self.revision = revision
        self.peft = peft
        model_args.note_softmax_dtype(model_args.parse_dtype(softmax_dtype, "softmax_dtype"), model.dtype)
        self.reuse = ReuseCounter(self.runner.engine)

    # -- tokens --------------------------------------------------------------------------------------
    @property
    def model(self) -> transformers.PreTrainedModel:
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.model.device

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
        """As `hf`: `add_special_tokens` if given, else `add_bos_token`, never when BOS is already there."""
        options = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        return self.tokenizer.encode(string, **options)

    def _encode_prompt(self, context: str) -> list[int]:
        """A generation prompt as `hf` encodes it (its batch encoder checks the BOS string, not prefix)."""
        options = {}
        if has_bos_prefix(context, self.tokenizer.bos_token):
            options["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        return self.tokenizer(context, truncation=self.truncation, **options)["input_ids"]

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The tokenizer's template; if it rejects the system role, the history without it (as `hf`)."""

        def render(history):
            return self.tokenizer.apply_chat_template(
                history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.chat_template_args,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            if not any(message["role"] == "system" for message in chat_history):
                raise
            logger.warning_once(
                "hf-radix: the chat template failed; retrying without the system message "
                "(as lm-eval's hf backend)"
            )
            return render([message for message in chat_history if message["role"] != "system"])

    # -- requests ------------------------------------------------------------------------------------
    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.enable_thinking:
            raise ValueError("hf-radix: enable_thinking=True is for generative tasks only (as lm-eval's hf)")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Scores `(key | None, context_ids, continuation_ids)` triples in one runner call."""
        pairs, truncated = [], []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"hf-radix: a continuation of {len(continuation)} tokens cannot be scored with "
                    f"max_length={self.max_length} (it needs 1..max_length tokens)"
                )
            whole = context + continuation
            if len(whole) > self.max_length + 1:
                truncated.append(len(whole) - self.max_length - 1)
                whole = whole[-(self.max_length + 1) :]  # the model sees at most max_length tokens, as in hf
            pairs.append((whole[: len(whole) - len(continuation)], continuation))
        if truncated:
            logger.warning(
                "hf-radix: %d of %d requests: context + continuation exceed max_length (%d); truncated from "
                "the left (up to %d tokens dropped)",
                len(truncated),
                len(requests),
                self.max_length,
                max(truncated),
            )
        results = self.runner.loglikelihood(pairs, progress=not disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        strings = [req.args[0] for req in requests]
        totals = loglikelihood_rolling(
            self.runner,
            [self.tok_encode(s) for s in strings],
            not disable_tqdm,
            prefix_token_id=self.prefix_token_id,
            max_length=self.max_length,
        )
        for string, total in zip(strings, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        runner_rows, hf_groups, truncated = [], {}, []
        prompts, stops, plans, max_new = [], [], [], []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs["until"], eos=eos)
            room = self.max_length - kwargs["max_gen_toks"]
            if room <= 0:
                raise ValueError(
                    f"hf-radix: max_gen_toks ({kwargs['max_gen_toks']}) must be below max_length "
                    f"({self.max_length})"
                )
            ids = self._encode_prompt(context)
            if len(ids) > room:
                truncated.append(len(ids))
                ids = ids[-room:]  # keep the last `room` tokens: hf's left truncation
            plan = generate.plan(self.model, kwargs, until)
            prompts.append(ids)
            stops.append(until)
            max_new.append(kwargs["max_gen_toks"])
            plans.append(plan)
            if plan.params is not None:
                runner_rows.append(i)
            else:
                generate.warn_hf_path(plan.needs_hf)
                hf_groups.setdefault(generate.group_key(gen_kwargs), []).append(i)
        if truncated:
            logger.warning(
                "hf-radix: %d of %d prompts are longer than max_length - max_gen_toks; left truncation "
                "applied (longest %d tokens). Some content will be lost.",
                len(truncated),
                len(requests),
                max(truncated),
            )
        tokens: list[list[int]] = [[] for _ in requests]
        if runner_rows:
            outputs = self.runner.run(
                [prompts[i] for i in runner_rows],
                [plans[i].params for i in runner_rows],
                progress=not disable_tqdm,
            )
            for i, out in zip(runner_rows, outputs):
                if out.finish_reason == "error":
                    raise ValueError(f"hf-radix: generation failed: {out.error}")
                tokens[i] = out.token_ids
        if hf_groups:
            total = sum(map(len, hf_groups.values()))
            with tqdm(
                total=total, disable=disable_tqdm, desc="hf-radix generate (HF logits processors)"
            ) as bar:
                for rows in hf_groups.values():
                    first = rows[0]
                    got = generate.hf_generate(
                        self.model,
                        self.tokenizer,
                        [prompts[i] for i in rows],
                        plans[first].hf_kwargs,
                        stops[first],
                        max_new[first],
                        self._pool_tokens,
                        self.runner.engine.page_size,
                        self._max_rows,
                        bar.update,
                    )
                    for i, new in zip(rows, got):
                        tokens[i] = new
        texts = [self._text(t, until) for t, until in zip(tokens, stops)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _text(self, tokens: list[int], until: list[str]) -> str:
        """Decoded answer as `hf` post-processes it: thinking stripped, cut at the first stop string."""
        if isinstance(self.think_end_token, int) and self.think_end_token in tokens:
            tokens = tokens[len(tokens) - tokens[::-1].index(self.think_end_token) :]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        think = self.think_end_token if isinstance(self.think_end_token, str) else None
        return postprocess_generated_text(generation=text, stop=until, think_end_token=think)

    # -- reporting -----------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """`hf`'s model information plus this run's prefix reuse; logs the one-line reuse summary."""
        stats = self.reuse.since_start()
        logger.info("hf-radix: %s", self.reuse.summary(stats))
        info = model_info(self.model, self.pretrained, self.revision, self.peft, self._num_parameters)
        return {**info, "hf_radix_reuse": stats}
