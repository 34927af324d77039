"""lm-eval's `hf` model_args as hf-radix takes them: loaded alike, accepted as no-ops, or refused up front.

`hf` forwards unknown model_args to `from_pretrained`; hf-radix refuses them with the list of what it takes,
so a typo or an option that would change the numbers never passes silently.
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers.utils import logging

from ..options import EngineOptions

logger = logging.get_logger(__name__)

# hf's model_args that hf-radix does not take yet, and why.
REFUSED = {
    **dict.fromkeys(
        ("parallelize", "device_map", "tp_plan", "max_memory_per_gpu", "max_cpu_memory"),
        "hf-radix runs on one device for now (multi-GPU placement is a later issue); drop it, or use "
        "--model hf",
    ),
    "delta": "delta weights are not supported; merge them into a checkpoint first, or use --model hf",
    "autogptq": "AutoGPTQ models are not supported; use --model hf",
    "gptqmodel": "GPTQModel models are not supported; use --model hf",
    "gguf_file": "GGUF checkpoints are not supported; convert to a transformers checkpoint or use --model hf",
    "mixed_precision_dtype": "autocast is not supported; load the model in the dtype to run (dtype=...)",
}

# Accepted for compatibility with hf; they change nothing here.
NO_OP = {
    "attn_implementation": "hf-radix answers every lm-eval request with its own 'radix' attention",
    "logits_cache": "contexts shared between requests are always computed once (the radix tree)",
    "offload_folder": "nothing is offloaded (it only serves parallelize)",
}

BATCH_NOTE = (
    "batch_size/max_batch_size are not needed: hf-radix schedules requests by tokens "
    "(chunked_prefill_size, max_running_requests), so they are ignored"
)
# Set by the command line (cli.main) when it got no --batch_size / --max_batch_size: lm-eval's CLI then
# passes its own default, batch_size=1, which the user never set.
batch_size_is_cli_default = False


def batch_size_set(batch_size, max_batch_size) -> bool:
    """Whether the user set batch_size or max_batch_size (lm-eval's CLI default of 1 is not the user's)."""
    if max_batch_size is not None:
        return True
    return batch_size is not None and not (batch_size_is_cli_default and str(batch_size) == "1")


def engine_options(kwargs: dict) -> dict:
    """Takes the engine options (`EngineOptions` fields) out of `kwargs`, each in its field's type (a
    command-line string such as '16', 'false' or 'none' converted); unset (None) ones are left out."""
    names = [name for name in EngineOptions.names() if name in kwargs]
    options = {name: EngineOptions.convert(name, kwargs.pop(name)) for name in names}
    return {name: value for name, value in options.items() if value is not None}


def check_unknown(kwargs: dict, supported: list[str]) -> None:
    """Raises for hf model_args hf-radix refuses (when set), or ones neither backend knows; notes no-ops."""
    for name in sorted(kwargs):
        if name in REFUSED and kwargs[name] not in (None, False, ""):
            raise ValueError(f"hf-radix: model_args {name}={kwargs[name]!r}: {REFUSED[name]}")
    unknown = sorted(set(kwargs) - set(NO_OP) - set(REFUSED))
    if unknown:
        raise TypeError(
            f"hf-radix: unknown model_args {unknown}; supported: {', '.join(sorted(supported + list(NO_OP)))}"
        )
    for name in set(kwargs) & set(NO_OP):
        logger.info("hf-radix: %s=%r has no effect: %s", name, kwargs[name], NO_OP[name])


def parse_dtype(value: str | torch.dtype | None, name: str = "dtype") -> str | torch.dtype:
    """`auto`, a torch dtype or its name (`bfloat16`, `float32`, ...)."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value or "auto"
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown {name} {value!r}; use auto, bfloat16, float16 or float32")
    return dtype


def resolve_device(device: str | None) -> torch.device:
    """The device asked for, never another: unset means CUDA when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"hf-radix: unknown device {device!r}") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"hf-radix: device={device!r} was asked for, but CUDA is not available here; "
                "pass device=cpu (or leave device unset)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"hf-radix: device={device!r}, but only {torch.cuda.device_count()} GPUs are visible"
            )
    return resolved


def check_model_device(model: torch.nn.Module, device: str | None) -> None:
    """A model object stays where it is; a different `device` is an error, not a silent move or a no-op."""
    if device is not None and torch.device(device).type != model.device.type:
        raise ValueError(
            f"hf-radix: the model object is on {model.device} but device={device!r} was passed; move the "
            "model yourself (model.to(...)) or leave device unset"
        )


def load(
    pretrained: str | torch.nn.Module,
    tokenizer,
    *,
    dtype,
    device: str | None,
    peft: str | None,
    use_fast: bool,
    add_bos_token: bool | None,
    revision: str | None,
    subfolder: str,
    trust_remote_code: bool,
) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase, int | None]:
    """The model and tokenizer as `hf` loads them (tokenizer first), and the parameter count `hf` reports.

    `pretrained` and `tokenizer` are hub ids, local directories or objects. A PEFT adapter (`peft`: hub id
    or local directory) is loaded onto a `pretrained` loaded here, as `hf` does, then merged; the count is
    that of the model with its adapter layers (what `hf` records), else None (count the model).
    """
    hub = {"revision": revision, "subfolder": subfolder, "trust_remote_code": trust_remote_code}
    if isinstance(tokenizer, str) or tokenizer is None:
        source = tokenizer or (pretrained if isinstance(pretrained, str) else pretrained.name_or_path)
        if not source:
            raise ValueError("hf-radix: pass `tokenizer` along with a model object that has no name_or_path")
        tokenizer = load_tokenizer(source, use_fast=use_fast, add_bos_token=add_bos_token, **hub)
    else:
        tokenizer = apply_add_bos_token(tokenizer, add_bos_token)
    if not isinstance(pretrained, str):
        if peft:  # hf would ignore it here (it applies peft only to models it loads)
            raise ValueError(
                "hf-radix: peft needs `pretrained` as a hub id or local directory (lm-eval's hf backend "
                "ignores peft on a model object); load the adapter yourself, or pass the model by path"
            )
        check_model_device(pretrained, device)
        return pretrained, tokenizer, None
    options = {"revision": revision, "trust_remote_code": trust_remote_code}
    if subfolder:
        options["subfolder"] = subfolder
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=parse_dtype(dtype), **options)
    count = None
    if peft:
        model, count = merge_peft(model, peft, revision, tokenizer)
    return model.to(resolve_device(device)), tokenizer, count


def merge_peft(model: torch.nn.Module, adapter: str, revision: str | None, tokenizer) -> tuple:
    """Loads a PEFT adapter as `hf` does and merges it into the weights (the radix path runs plain models).

    Returns the merged model and the parameter count `hf` reports for the unmerged one (adapter included).
    """
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError(f"hf-radix: peft={adapter!r} needs the peft package (pip install peft)") from error
    vocab = model.config.get_text_config(decoder=True).vocab_size
    if vocab != len(tokenizer):  # adapters that added tokens, as hf handles them
        model.resize_token_embeddings(len(tokenizer))
    with_adapter = PeftModel.from_pretrained(model, adapter, revision=revision)
    count = with_adapter.num_parameters()
    logger.warning_once(
        "hf-radix: the PEFT adapter is merged into the weights; in half precision the merged weights round "
        "differently from hf's unmerged adapter layers (expect bf16-sized differences, not more)"
    )
    return with_adapter.merge_and_unload(), count


def load_tokenizer(
    source: str,
    *,
    revision: str | None,
    subfolder: str,
    trust_remote_code: bool,
    use_fast: bool,
    add_bos_token: bool | None,
) -> transformers.PreTrainedTokenizerBase:
    """AutoTokenizer with hf's options: `add_bos_token` goes to the tokenizer, which adds BOS (or not)."""
    options = {"revision": revision, "trust_remote_code": trust_remote_code, "use_fast": use_fast}
    if subfolder:
        options["subfolder"] = subfolder
    if add_bos_token is not None:
        options["add_bos_token"] = add_bos_token
    return transformers.AutoTokenizer.from_pretrained(source, **options)


def _adds_bos(tokenizer) -> bool:
    return tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]


def apply_add_bos_token(tokenizer, add_bos_token: bool | None):
    """A tokenizer object that adds BOS as `add_bos_token` says (a copy when it has to change).

    hf passes `add_bos_token` only to tokenizers it loads itself; an object it is given keeps adding BOS
    or not as before. hf-radix applies it to objects too, and says so.
    """
    if add_bos_token is None or tokenizer.bos_token_id is None or _adds_bos(tokenizer) == add_bos_token:
        return tokenizer
    changed = copy.deepcopy(tokenizer)
    changed.add_bos_token = add_bos_token
    if _adds_bos(changed) != add_bos_token:
        raise ValueError(
            f"hf-radix: add_bos_token={add_bos_token} cannot be applied to this {type(tokenizer).__name__} "
            "object; pass the tokenizer by name or path instead"
        )
    logger.warning_once(
        f"hf-radix: add_bos_token={add_bos_token} applied to (a copy of) the tokenizer object; lm-eval's hf "
        "backend applies it only to tokenizers it loads by name"
    )
    return changed


def note_softmax_dtype(softmax_dtype, model_dtype: torch.dtype) -> None:
    """Says how `softmax_dtype` compares with hf-radix's float32 log-softmax (never applied otherwise)."""
    if softmax_dtype == "auto":
        if model_dtype != torch.float32:
            logger.info_once(
                f"hf-radix: log-softmax runs in float32 (lm-eval's hf backend uses the model's {model_dtype} "
                "unless softmax_dtype=float32 is passed; hf-radix matches that setting)"
            )
    elif softmax_dtype != torch.float32:
        logger.warning_once(
            f"hf-radix: softmax_dtype={softmax_dtype} is not applied; log-softmax always runs in float32"
        )


def _rope_types(config) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] or [params]
    return {p.get("rope_type", "default") for p in nested if p}


STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})  # rotary angles depend on the position only


def check_positions(model: torch.nn.Module, max_length: int) -> None:
    """Refuses `max_length` above max_position_embeddings unless it runs as hf runs it (static rotary angles).

    Learned position tables end at max_position_embeddings; rotary variants that rescale with the sequence
    length (dynamic, longrope) would see a packed batch's length, not each request's.
    """
    text = model.config.get_text_config(decoder=True)
    limit = getattr(text, "max_position_embeddings", None)
    if limit is None or max_length <= limit:
        return
    types = _rope_types(text)
    if not types or not types <= STATIC_ROPE:
        raise ValueError(
            f"hf-radix: max_length={max_length} is above the model's max_position_embeddings ({limit}) and "
            f"its position encoding ({sorted(types) or 'learned positions'}) cannot be run exactly past it; "
            f"pass max_length <= {limit}"
        )
    logger.warning(
        "hf-radix: max_length=%d is above the model's max_position_embeddings (%d); like lm-eval's hf "
        "backend, positions up to %d are computed (the model was not trained on them)",
        max_length,
        limit,
        max_length,
    )
