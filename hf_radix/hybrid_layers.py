"""Hybrid and state-space model families: tiny test configs and the per-layer state each layer keeps.

A *state layer* is a layer whose cache is a fixed-size running state (a convolution window and/or a
recurrent state) rather than per-token K/V. transformers 5.24 stores it in a
``LinearAttentionLayer`` of the ``DynamicCache`` (``cache.update_conv_state`` /
``cache.update_recurrent_state``); MiniMax keeps its own ``MiniMaxCache.linear_cache`` and
RecurrentGemma keeps the state on its modules. :func:`state_specs` reads the state shapes from the
model's modules, so that a :class:`hf_radix.memory.state_pool.StatePool` can be allocated before the
first forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Cache

__all__ = [
    "FAMILIES",
    "NO_PREFIX_REUSE",
    "REFUSED_FAMILIES",
    "StateKindSpec",
    "StateLayerSpec",
    "hub_kernels_in_state_layers",
    "probe_state_specs",
    "refusal_reason",
    "state_specs",
    "tiny_hybrid_model",
    "tiny_hybrid_vlm",
]


@dataclass(frozen=True)
class StateKindSpec:
    """One state tensor of one layer, per request: its shape (without batch) and dtype."""

    kind: str  # "conv" or "recurrent"
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateLayerSpec:
    """The states one state layer keeps per request."""

    layer_idx: int
    kinds: tuple[StateKindSpec, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one request's state for this layer."""
        total = 0
        for k in self.kinds:
            n = 1
            for d in k.shape:
                n *= d
            total += n * torch.empty((), dtype=k.dtype).element_size()
        return total


#: Families the prototype supports: ``model_type`` -> the mixer attribute name on the decoder layer.
FAMILIES = {
    "qwen3_5_text": "linear_attn",
    "qwen3_5_moe_text": "linear_attn",
    "qwen3_next": "linear_attn",
    "nemotron_h": "mixer",
    "granitemoehybrid": "mamba",
    "falcon_h1": "mamba",
    "bamba": "mamba",
    "jamba": "mamba",
    "lfm2": "conv",
    "lfm2_moe": "conv",
    "mamba": "mixer",
    "mamba2": "mixer",
    "falcon_mamba": "mixer",
}

#: Families refused, with the reason (see docs/hybrid.md for the measurements behind them).
REFUSED_FAMILIES = {
    "minimax": (
        "MiniMax lightning attention keeps its state in MiniMaxCache.linear_cache (not the Cache state "
        "API) and computes a multi-token chunk after a cached state with a different (per-token) "
        "recurrence than the blocked prefill"
    ),
    "recurrent_gemma": (
        "RecurrentGemma keeps its RG-LRU and convolution state on its modules, not in the Cache, and "
        "a multi-token forward after a cached state drops the convolution context"
    ),
}


_MAMBA1 = (
    "transformers' torch Mamba1 selective scan cannot start from a cached state (a multi-token forward "
    "after a prefix restarts the scan from zero), so prefix hits and chunked prefill would be wrong; "
    "only single-token decode continues exactly"
)
#: Families whose states have a shape (so :func:`state_specs` works) but cannot continue a cached
#: state with a multi-token forward: prefix caching must refuse them with this reason.
NO_PREFIX_REUSE = {"mamba": _MAMBA1, "falcon_mamba": _MAMBA1, "jamba": _MAMBA1}


def refusal_reason(model_type: str) -> str | None:
    """Why hybrid prefix caching refuses this ``model_type`` (None: supported or not a state family)."""
    return REFUSED_FAMILIES.get(model_type) or NO_PREFIX_REUSE.get(model_type)


def _layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("layers", "blocks"):
        if hasattr(base, name):
            return getattr(base, name)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def _conv_channels(conv: nn.Conv1d) -> tuple[int, int]:
    return conv.in_channels, conv.kernel_size[0]


def _mixer(layer: nn.Module, attr: str) -> nn.Module | None:
    mixer = getattr(layer, attr, None)
    if mixer is None:
        return None
    return mixer if hasattr(mixer, "conv1d") or hasattr(mixer, "conv") else None


def cache_state_api() -> bool:
    """Whether this transformers' state layers read and write their states through the `Cache` methods
    (`get_conv_state`, `update_recurrent_state`, ...) that hf_radix implements; older versions (5.17)
    reach into their cache's layers instead."""
    return hasattr(Cache, "get_conv_state")


def state_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """The state-keeping mixer module of each state layer of ``model``, by layer index."""
    mtype = model.config.get_text_config(decoder=True).model_type
    if mtype not in FAMILIES:
        raise ValueError(f"{mtype!r} is not a known hybrid or state-space family")
    mixers = {idx: _mixer(layer, FAMILIES[mtype]) for idx, layer in enumerate(_layers(model))}
    return {idx: mixer for idx, mixer in mixers.items() if mixer is not None}


def hub_kernels_in_state_layers(model: nn.Module) -> list[str]:
    """What the ``kernels`` hub replaced (``kernelize`` / ``use_kernels=True``, transformers >= 5.25) in the
    code that handles ``model``'s states: a whole state mixer (``Qwen3_5GatedDeltaNet``) or a function its
    mixer hands the cache to (``causal_conv1d_forward``, ``mamba2_scan_forward``). Such a kernel may keep
    the states itself instead of calling the ``Cache`` state methods; kernels that only compute (a
    convolution, a scan given its state) are not listed."""
    found = []
    for mixer in state_mixers(model).values():
        if _hub_replaced(mixer):
            found.append(type(mixer).__name__)
        for name, func in vars(mixer).get("_kernel_funcs", {}).items():
            if _hub_replaced(func) and "cache" in inspect.signature(type(func).forward).parameters:
                found.append(name)
    return sorted(set(found))


def _hub_replaced(module: nn.Module) -> bool:
    """Whether ``kernelize`` gave ``module`` (of a hub-replaceable class) a forward of its own; an accelerate
    hook's forward is not one."""
    hub = hasattr(type(module), "kernel_layer_name")
    return hub and "forward" in vars(module) and not hasattr(module, "_hf_hook")


def state_specs(model: nn.Module, dtype: torch.dtype | None = None) -> list[StateLayerSpec]:
    """The state layers of ``model`` and the shape of each state, read from the modules.

    ``dtype`` is the dtype of the activations (the model's dtype by default): conv windows are kept
    at it, recurrent states in float32. Shapes follow what the layers pass to
    ``Cache.update_conv_state`` (``[channels, kernel]``: the window of the last ``kernel`` inputs,
    including the current one) and ``Cache.update_recurrent_state``. Raises ``ValueError`` for refused
    or unknown families.
    """
    config = model.config.get_text_config(decoder=True)
    mtype = config.model_type
    if mtype in REFUSED_FAMILIES:
        raise ValueError(REFUSED_FAMILIES[mtype])
    if mtype not in FAMILIES:
        raise ValueError(f"{mtype!r} is not a known hybrid or state-space family")
    attr = FAMILIES[mtype]
    dtype = dtype or next(model.parameters()).dtype
    specs = []
    for idx, layer in enumerate(_layers(model)):
        mixer = _mixer(layer, attr)
        if mixer is None:
            continue
        kinds = _mixer_kinds(mtype, mixer, dtype)
        specs.append(StateLayerSpec(idx, kinds))
    return specs


def _mixer_kinds(mtype: str, mixer: nn.Module, dtype: torch.dtype) -> tuple[StateKindSpec, ...]:
    if mtype == "lfm2" or mtype == "lfm2_moe":
        # LFM2 caches the gated input Bx of its short convolution: [hidden, L_cache].
        ch, k = _conv_channels(mixer.conv)
        return (StateKindSpec("conv", (ch, k), dtype),)
    ch, k = _conv_channels(mixer.conv1d)
    conv = StateKindSpec("conv", (ch, k), dtype)
    if mtype.startswith("qwen3"):
        # Gated DeltaNet: one [k_dim, v_dim] matrix per value head.
        shape = (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    elif mtype in ("mamba", "falcon_mamba", "jamba"):
        # Mamba1 selective scan: [intermediate, d_state].
        shape = (mixer.intermediate_size, mixer.ssm_state_size)
    else:
        # Mamba2 SSD: [heads, head_dim, d_state].
        shape = (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
    # Every family's torch path computes and caches the recurrent state in float32 (measured on bf16 models).
    return conv, StateKindSpec("recurrent", shape, torch.float32)


# ------------------------------------------------------------------------------------- tiny configs

# initializer_range 0.05 (instead of 0.02) so that the states visibly change the logits.
_COMMON = dict(vocab_size=96, initializer_range=0.05, hidden_size=32, intermediate_size=48,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4, head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)


def tiny_configs() -> dict[str, tuple[str, str, dict]]:
    """``name -> (config class, causal-LM class, config kwargs)`` for tiny fp32 test models."""
    four = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    return {
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**_COMMON, **_GDN, "num_hidden_layers": 4,
                    "layer_types": four}),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**_COMMON, **_GDN, **_MOE,
                        "num_hidden_layers": 4, "layer_types": four}),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_COMMON, **_GDN, **_MOE,
                       "num_hidden_layers": 4, "layer_types": four, "decoder_sparse_step": 1}),
        "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
            **_COMMON, "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention"],
            "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 8,
            "conv_kernel": 4, "expand": 2, "chunk_size": 8, "head_dim": 16}),
        "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
            **_COMMON, **_MAMBA2, "num_hidden_layers": 3, "num_local_experts": 0,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
        "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {
            **_COMMON, **_MAMBA2, "num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 64}),
        "bamba": ("BambaConfig", "BambaForCausalLM", {
            **_COMMON, **_MAMBA2, "num_hidden_layers": 3, "attn_layer_indices": [1]}),
        "jamba": ("JambaConfig", "JambaForCausalLM", {
            **_COMMON, "num_hidden_layers": 3, "attn_layer_period": 2, "attn_layer_offset": 1,
            "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8,
            "mamba_d_conv": 4, "mamba_expand": 2, "use_mamba_kernels": False}),
        "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {
            **_COMMON, "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
            "block_multiple_of": 16}),
        "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {
            **_COMMON, "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_dense_layers": 1}),
        "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", {
            **_COMMON, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
            "num_local_experts": 2, "num_experts_per_tok": 1, "block_size": 4, "head_dim": 16}),
        "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {
            **_COMMON, "num_hidden_layers": 3, "lru_width": 32, "attention_window_size": 64,
            "conv1d_width": 4, "logits_soft_cap": 30.0}),
        "mamba": ("MambaConfig", "MambaForCausalLM", {
            "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "conv_kernel": 4,
            "expand": 2, "use_mambapy": False}),
        "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {
            "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16,
            "n_groups": 1, "state_size": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 8}),
        "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {
            "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "conv_kernel": 4,
            "expand": 2}),
    }


def tiny_hybrid_model(name: str, seed: int = 0) -> nn.Module:
    """A tiny fp32 random-weight model of family ``name`` (see :func:`tiny_configs`), in eval mode."""
    import transformers

    cfg_cls, model_cls, kwargs = tiny_configs()[name]
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    return model


def tiny_hybrid_vlm(name: str = "qwen3_5", seed: int = 0, **text_kwargs) -> nn.Module:
    """A tiny fp32 ``Qwen3_5ForConditionalGeneration`` (``name`` "qwen3_5") or its MoE twin
    ("qwen3_5_moe"): a one-block vision tower in front of the text model of :func:`tiny_hybrid_model`
    (``text_kwargs`` override its config). The last four token ids are the image, video, vision-start and
    vision-end placeholders."""
    import transformers

    prefix = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[name]
    text_cls, _, kwargs = tiny_configs()[name]
    kwargs = {**kwargs, **text_kwargs}
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=kwargs["hidden_size"], num_position_embeddings=16)
    vocab = kwargs["vocab_size"]
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    config = getattr(transformers, f"{prefix}Config")(
        text_config=getattr(transformers, text_cls)(**kwargs).to_dict(), vision_config=vision.to_dict(),
        **{key: vocab - 4 + i for i, key in enumerate(tokens)})
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()


def probe_state_specs(model: nn.Module) -> list[StateLayerSpec]:
    """The state specs as transformers' own ``DynamicCache`` stores them after a 2-token forward.

    A cross-check of :func:`state_specs` (which needs no forward): same layers, shapes and dtypes.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, position_ids=torch.arange(2, device=device)[None])
    specs = []
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        kinds = tuple(
            StateKindSpec(kind, tuple(t.shape[1:]), t.dtype)
            for kind, t in (("conv", layer.conv_states[0]), ("recurrent", layer.recurrent_states[0]))
            if t is not None
        )
        if kinds:
            specs.append(StateLayerSpec(idx, kinds))
    return specs
