"""Vision-language wrappers hf_radix runs on text prompts only (Qwen3.5 as its checkpoints load).

`Qwen3_5ForConditionalGeneration` (and its MoE twin) put a vision tower in front of the hybrid Qwen3.5
text model. For a prompt of text tokens the tower does not run and the text model computes what
`Qwen3_5ForCausalLM` computes: hf_radix passes 2-D position ids, which the text model spreads over its
three multimodal-rope sections (all equal for text, as plain transformers has them). Images and videos
are not keyed into the prefix cache: their inputs and placeholder tokens are refused.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["TEXT_ONLY_WRAPPERS", "placeholder_refusal", "placeholder_token_ids", "text_only", "text_stack"]

#: ``config.model_type`` of the wrappers whose text prompts hf_radix runs exactly (tested against plain
#: transformers in tests/test_hybrid_vlm.py).
TEXT_ONLY_WRAPPERS = frozenset({"qwen3_5", "qwen3_5_moe"})
#: Config keys holding the token ids that stand for an image or a video in a prompt.
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id")


def text_only(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language wrapper hf_radix runs on text prompts (its text model)."""
    return getattr(model.config, "model_type", None) in TEXT_ONLY_WRAPPERS and hasattr(model, "get_decoder")


def text_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the layers hf_radix runs: a text-only wrapper's text decoder, else ``model``."""
    return model.get_decoder() if text_only(model) else model


def placeholder_token_ids(model: torch.nn.Module) -> dict[str, int]:
    """The placeholder token ids of a text-only wrapper by config key (``{}`` for other models)."""
    if not text_only(model):
        return {}
    config = model.config
    return {key: value for key in PLACEHOLDER_KEYS if isinstance(value := getattr(config, key, None), int)}


def placeholder_refusal(model: torch.nn.Module, ids: np.ndarray | torch.Tensor) -> str | None:
    """Why a prompt of ``ids`` is refused (it holds image / video placeholder tokens), else None."""
    placeholders = placeholder_token_ids(model)
    if not placeholders:
        return None
    values = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    found = [f"{key} {value}" for key, value in placeholders.items() if np.any(values == value)]
    if not found:
        return None
    return (
        f"the prompt holds image or video placeholder tokens ({', '.join(found)}); hf_radix runs "
        f"{type(model).__name__} on text prompts only (images and videos are not keyed into its prefix "
        "cache): remove them, or run prompts with images or videos through plain transformers"
    )
