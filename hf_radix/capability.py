"""Which models hf_radix runs exactly: the check made when an engine is created, and a run-time guard.

A model runs only if every attention layer goes through transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS``, which is where the "radix" attention plugs in) and passes it only arguments
the radix attention implements. Everything else is refused with :class:`UnsupportedModelError` before the
first forward: attention computed by the model itself (Bloom, GPT-Neo, MPT; Falcon before 5.25), an ALiBi
position bias (Falcon's `alibi`), recurrent and hybrid models other than the hybrid families hf_radix runs
with a state pool (`_check_hybrid`, docs/hybrid.md: the others are refused with their reason), multimodal
models (two different images behind the same placeholder tokens would share K/V; the Qwen3.5
vision-language wrappers run text prompts only, `vlm_text`), encoder-decoders. At run time every radix
forward counts the calls of the radix attention and raises the same error if a layer bypassed it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import transformers
from transformers.utils import logging

from .errors import UnsupportedModelError
from .hybrid_layers import FAMILIES, cache_state_api, hub_kernels_in_state_layers, refusal_reason
from .memory.kv_pool import KVShape
from .vlm_text import placeholder_refusal, text_only, text_stack

logger = logging.get_logger(__name__)

__all__ = ["ModelSupport", "UnsupportedModelError", "check_model", "check_inputs", "count_attention_call"]

#: Keywords an attention layer may pass to the attention function (besides module, q, k, v, mask).
HANDLED_ATTENTION_ARGS = frozenset(
    {"attention_mask", "dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal",
     "position_ids"}
)
#: Arguments that change what attention computes and that the radix attention does not implement.
REFUSED_ATTENTION_KWARGS = (
    "position_bias", "indices", "block_indices", "sinks", "cu_seq_lens_q", "cu_seq_lens_k",
)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: Layer types of the hybrid families hf_radix runs besides attention: state layers, and layers with
#: neither K/V nor state (Nemotron-H's MLP / MoE blocks).
HYBRID_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "mamba", "mlp", "moe"})
#: Hybrid families with a state layout hf_radix handles that are not wired into the engine yet.
HYBRID_NOT_YET = {
    "mamba2": (
        "a pure Mamba2 model has no attention layer; hf_radix's engine needs at least one (pure "
        "state-space models are not wired yet)"
    ),
}
MULTIMODAL_INPUTS = (
    "pixel_values", "pixel_values_videos", "image_embeds", "video_embeds", "input_features",
    "input_values", "audio_values", "input_audio_embeds", "image_grid_thw", "video_grid_thw",
    "mm_encoder_outputs",
)
#: Sub-configs that describe parts of one text decoder (MPT's and DBRX's attention and FFN options).
TEXT_SUB_CONFIGS = ("text_config", "decoder", "attn_config", "ffn_config")
#: Words naming another modality in a sub-config key (vision_config, audio_encoder, vq_config, ...).
MODALITY_WORDS = (
    "vision", "visual", "image", "video", "audio", "speech", "acoustic", "vq", "vocoder", "codec",
)
MULTIMODAL_CONFIG_KEYS = (
    "vision_config", "audio_config", "video_config", "speech_config", "vision_tower", "audio_encoder",
    "image_token_id", "image_token_index", "video_token_id", "audio_token_id", "audio_token_index",
)
# Cache calls and state names of state-space and linear-attention layers (5.25: some hand the cache to a
# convolution or scan function instead).
RECURRENT_MARKERS = (
    "update_conv_state", "update_recurrent_state", "conv_states", "ssm_states", "cache_params",
    "recurrent_states", "set_linear_cache", "causal_conv1d_forward", "mamba_scan_forward",
    "mamba2_scan_forward",
)


@dataclass(frozen=True)
class ModelSupport:
    """What the check found: the attention layers and the K/V geometry the pool stores per token."""

    model_class: str
    attention_layers: int
    kv_shape: KVShape
    kv_layer_ids: tuple[int, ...]  # the decoder layer (``layer_idx``) of each K/V layer of the pool, in order

    def kv_layer_index(self) -> list[int]:
        """The pool's K/V layer of each decoder layer (-1: a hybrid model's state layer has none)."""
        index = [-1] * (self.kv_layer_ids[-1] + 1)
        for kv_layer, layer_idx in enumerate(self.kv_layer_ids):
            index[layer_idx] = kv_layer
        return index


# ---------------------------------------------------------------------------------------- source reading


@functools.cache
def _forward_source(cls: type) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
    except (OSError, TypeError):
        return None


@functools.cache
def _attention_call_keywords(cls: type) -> tuple[str, ...] | None:
    """Keywords of the attention-interface call in ``cls.forward``; None when it makes no such call.

    The interface is found as a name bound to an expression reading ``ALL_ATTENTION_FUNCTIONS``
    (``attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)``); ``**kwargs`` is passed through.
    """
    source = _forward_source(cls)
    if source is None or "ALL_ATTENTION_FUNCTIONS" not in source:
        return None
    tree = ast.parse(source)
    names = {"attention_interface"}
    for node in ast.walk(tree):
        reads_interface = isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        if reads_interface and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    keywords: list[str] = []
    found = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            found = True
            keywords += [kw.arg for kw in node.keywords if kw.arg is not None]
    return tuple(keywords) if found else None


def _is_torch_class(cls: type) -> bool:
    return cls.__module__.startswith("torch.")


# ---------------------------------------------------------------------------------------- the check


def check_model(model: torch.nn.Module) -> ModelSupport:
    """Raises UnsupportedModelError unless hf_radix can run ``model`` exactly; returns what it found."""
    name = type(model).__name__

    def refuse(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(name, reason)

    if getattr(model.config, "is_encoder_decoder", False):
        raise refuse("it is an encoder-decoder model; hf_radix supports decoder-only causal LMs")
    if not text_only(model):  # a text-only wrapper (vlm_text): its image inputs are refused per call
        _check_multimodal(model, refuse)
    hybrid = _check_hybrid(model, refuse)
    if not hybrid:
        _check_recurrent(model, refuse)
    if getattr(model.config.get_text_config(decoder=True), "alibi", False):
        # Falcon: its 5.25 layers call the attention interface with the bias added to the mask
        raise refuse("it adds an ALiBi position bias to the attention mask, which radix attention ignores")
    attention = _attention_layers(model, refuse, hybrid)
    ids = tuple(sorted(m.layer_idx for m in attention))
    shape = replace(_kv_shape(attention[0], model.config), num_layers=len(ids))
    return ModelSupport(name, len(attention), shape, ids)


def hybrid_model_type(model: torch.nn.Module) -> str | None:
    """The ``model_type`` of a hybrid / state-space family (``hybrid_layers.FAMILIES``), else None."""
    mtype = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    return mtype if mtype in FAMILIES or refusal_reason(mtype or "") else None


def _check_hybrid(model: torch.nn.Module, refuse) -> bool:
    """True for a hybrid family hf_radix runs (state layers in a ``StatePool``); refuses the others with
    the specific reason (docs/hybrid.md)."""
    mtype = hybrid_model_type(model)
    if mtype is None:
        return False
    reason = refusal_reason(mtype) or HYBRID_NOT_YET.get(mtype)
    if reason is not None:
        raise refuse(reason)
    if not cache_state_api():
        raise refuse(
            f"this transformers ({transformers.__version__}) has its state layers bypass the Cache methods "
            "hf_radix's state pool implements (get_conv_state, update_recurrent_state, ...); hybrid models "
            "need a transformers that has them (5.24 does)"
        )
    hub = hub_kernels_in_state_layers(model)
    if hub:
        raise refuse(
            f"its state layers run hub kernels ({', '.join(hub)}: kernelize / use_kernels) that may keep the "
            "states outside the Cache methods hf_radix's state pool implements; load it without use_kernels"
        )
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES | HYBRID_LAYER_TYPES})
    if other:
        raise refuse(f"it has {', '.join(other)} layers, which hf_radix's hybrid support does not know")
    return True


def _check_recurrent(model: torch.nn.Module, refuse) -> None:
    """Refuses state-space / linear-attention layers (whole models or hybrids), other layer types."""
    for cls in dict.fromkeys(type(m) for m in model.modules() if not _is_torch_class(type(m))):
        source = _forward_source(cls) or ""
        marker = next((m for m in RECURRENT_MARKERS if m in source), None)
        if marker is not None:
            raise refuse(
                f"{cls.__name__} keeps a recurrent (state-space / linear-attention) state ({marker}); a "
                "running state cannot be shared through a prefix cache"
            )
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        raise refuse(f"it has {', '.join(other)} layers; hf_radix runs full and sliding-window attention")


def _attention_layers(model: torch.nn.Module, refuse, hybrid: bool = False) -> list[torch.nn.Module]:
    """The attention modules, one per decoder layer (one per attention layer of a hybrid model, numbered by
    their decoder layer), each calling the interface with handled arguments."""
    stack = text_stack(model)  # a text-only wrapper's vision tower never runs radix
    attention = [m for m in stack.modules() if _attention_call_keywords(type(m)) is not None]
    ids = {id(m) for m in attention}
    for module in stack.modules():
        cls = type(module)
        wraps_attention = any(id(m) in ids for m in module.modules())  # DbrxNormAttentionNorm
        if "Attention" in cls.__name__ and hasattr(module, "layer_idx") and not wraps_attention:
            raise refuse(
                f"{cls.__name__} computes attention itself, not through transformers' attention interface"
            )
    for cls in dict.fromkeys(type(m) for m in attention):
        unknown = sorted(set(_attention_call_keywords(cls)) - HANDLED_ATTENTION_ARGS)
        if unknown:
            raise refuse(
                f"{cls.__name__} passes {', '.join(unknown)} to the attention function, which the radix "
                "attention does not implement"
            )
    for module in attention:
        if getattr(module, "is_causal", True) is False:
            raise refuse(f"{type(module).__name__} is not causal")
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if not attention:
        raise refuse(_no_interface_reason(model))
    indices = sorted(getattr(m, "layer_idx", -1) for m in attention)
    if hybrid:  # the pool keeps K/V for the attention layers alone
        beyond = layers is not None and indices[-1] >= layers
        if len(set(indices)) != len(indices) or indices[0] < 0 or beyond:
            raise refuse("its attention layers are not numbered by distinct decoder layers (layer_idx)")
        return attention
    if layers is not None and len(attention) != layers:
        raise refuse(f"{len(attention)} of its {layers} layers are attention layers (a hybrid model)")
    if indices != list(range(len(attention))):
        raise refuse("its attention layers are not numbered 0..N-1 (layer_idx)")
    return attention


def _no_interface_reason(model: torch.nn.Module) -> str:
    """Why a model none of whose modules calls the attention interface is refused: its attention modules
    (the innermost ones, e.g. GPTNeoSelfAttention inside GPTNeoAttention) compute attention themselves."""
    def is_attention(module: torch.nn.Module) -> bool:
        return "Attention" in type(module).__name__ and not _is_torch_class(type(module))

    inner = [
        type(m).__name__ for m in model.modules()
        if is_attention(m) and not any(is_attention(c) for c in m.modules() if c is not m)
    ]
    if not inner:
        return "none of its layers calls transformers' attention interface"
    names = list(dict.fromkeys(inner))
    verb = "computes" if len(names) == 1 else "compute"
    return f"{', '.join(names)} {verb} attention itself, not through transformers' attention interface"


def _check_multimodal(model: torch.nn.Module, refuse) -> None:
    config = model.config
    keys = [k for k in MULTIMODAL_CONFIG_KEYS if getattr(config, k, None) is not None]
    sub = [k for k in getattr(config, "sub_configs", {}) if k not in TEXT_SUB_CONFIGS]
    modal = [k for k in sub if any(word in k for word in MODALITY_WORDS)]
    if keys or modal:
        raise refuse(
            f"it is multimodal ({', '.join(keys or modal)}); two different images behind the same "
            "placeholder tokens would share K/V in a prefix cache"
        )
    if sub:
        raise refuse(f"it is made of several models ({', '.join(sub)}); hf_radix runs one decoder stack")
    params = inspect.signature(model.forward).parameters
    inputs = [p for p in MULTIMODAL_INPUTS if p in params]
    if inputs:
        raise refuse(f"it takes multimodal inputs ({', '.join(inputs)}), which a token cache cannot key")


def _kv_shape(attention: torch.nn.Module, config) -> KVShape:
    """Per-token pool geometry; MLA layers (``expand_kv``) cache one latent "head": the compressed K/V
    (``kv_lora_rank`` wide) as K and the shared rotary key (``qk_rope_head_dim``) as V."""
    text = config.get_text_config(decoder=True)
    if hasattr(attention, "expand_kv"):
        rank, rope = attention.kv_lora_rank, attention.qk_rope_head_dim
        return KVShape(text.num_hidden_layers, 1, rank, rope, latent=True)
    return KVShape.from_config(config)


def check_inputs(model: torch.nn.Module, kwargs: dict) -> None:
    """Refuses multimodal inputs and image / video placeholder tokens given to a radix call
    (UnsupportedModelError) and an empty prompt (ValueError; plain transformers fails inside the first
    forward, on a reshape of 0 elements)."""
    given = [k for k in MULTIMODAL_INPUTS if kwargs.get(k) is not None]
    if given:
        raise UnsupportedModelError(
            type(model).__name__,
            f"multimodal inputs ({', '.join(given)}) cannot be keyed by a token prefix cache; drop "
            "cache_implementation='radix' to run them with plain generate",
        )
    ids = kwargs.get("input_ids", kwargs.get("inputs"))
    reason = placeholder_refusal(model, ids) if isinstance(ids, torch.Tensor) else None
    if reason is not None:
        raise UnsupportedModelError(type(model).__name__, reason)
    for name in ("inputs_embeds", "input_ids", "inputs"):
        prompt = kwargs.get(name)
        if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 and prompt.shape[1] == 0:
            raise ValueError(
                f"generate got an empty prompt ({name} of shape {tuple(prompt.shape)}): every row needs at "
                "least one token; start it with the BOS token (tokenizer.bos_token_id), or pass no input_ids "
                "to generate from the model's bos_token_id"
            )


# ---------------------------------------------------------------------------------------- run-time guard

_calls: ContextVar[list[int] | None] = ContextVar("hf_radix_attention_calls", default=None)
_GUARD_ATTR = "_hf_radix_attention_guard"


def count_attention_call() -> None:
    """Called by the radix attention once per layer call."""
    counter = _calls.get()
    if counter is not None:
        counter[0] += 1


def install_attention_guard(model: torch.nn.Module, support: ModelSupport, cache_type: type) -> None:
    """Hooks the decoder stack so that every forward carrying a `cache_type` (the radix cache) checks that
    each of its attention layers called the radix attention exactly once (idempotent)."""
    stack = model.base_model
    previous = getattr(stack, _GUARD_ATTR, None)
    if previous is not None:
        for handle in previous:
            handle.remove()

    def carries_radix(args: tuple, kwargs: dict) -> bool:
        return any(isinstance(v, cache_type) for v in (*args, *kwargs.values()))

    def before(module, args, kwargs):
        _calls.set([0] if carries_radix(args, kwargs) else None)

    def after(module, args, kwargs, output):
        counter = _calls.get()
        if counter is None:
            return
        _calls.set(None)
        if counter[0] != support.attention_layers:
            raise UnsupportedModelError(
                support.model_class,
                f"{support.attention_layers} attention layers, but the radix attention ran {counter[0]} "
                "times in one forward: a layer bypassed transformers' attention interface",
            )

    handles = (
        stack.register_forward_pre_hook(before, with_kwargs=True),
        stack.register_forward_hook(after, with_kwargs=True),
    )
    setattr(stack, _GUARD_ATTR, handles)
