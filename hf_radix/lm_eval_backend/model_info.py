"""What the results JSON records about the model (as lm-eval's `hf` does) and this run's prefix reuse."""

from __future__ import annotations

import os

import torch
from transformers.utils import logging

from ..engine import RadixEngine

logger = logging.get_logger(__name__)

REUSE_FIELDS = ("prompt_tokens", "cached_tokens", "computed_tokens", "generated_tokens", "forward_calls")


class ReuseCounter:
    """Prefix-reuse counters of an engine since this counter was made."""

    def __init__(self, engine: RadixEngine):
        self.engine = engine
        self.start = self._now()

    def _now(self) -> dict[str, int]:
        stats = self.engine.stats
        return {name: getattr(stats, name) for name in REUSE_FIELDS}

    def since_start(self) -> dict:
        """Prompt tokens, those served from the cache, hit rate, tokens computed, ... since the start."""
        now = self._now()
        stats: dict = {name: now[name] - self.start[name] for name in REUSE_FIELDS}
        prompt = stats["prompt_tokens"]
        stats["hit_rate"] = stats["cached_tokens"] / prompt if prompt else 0.0
        return stats

    @staticmethod
    def summary(stats: dict) -> str:
        return (
            f"{stats['cached_tokens']:,} of {stats['prompt_tokens']:,} prompt tokens "
            f"({stats['hit_rate']:.1%}) served from the prefix cache; {stats['computed_tokens']:,} tokens "
            f"computed in {stats['forward_calls']:,} forwards"
        )


def _hub_sha(name, revision: str | None) -> str:
    """The commit of a hub repository ("" for model objects, local paths, or when the hub is unreachable)."""
    if not isinstance(name, str) or os.path.isdir(name):
        return ""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id=name, revision=revision).sha or ""
    except Exception as error:  # offline, private, not a hub id: the field stays empty, as in hf
        logger.debug("no hub commit for %s@%s: %s", name, revision, error)
        return ""


def model_info(
    model: torch.nn.Module,
    pretrained,
    revision: str | None,
    peft: str | None,
    num_parameters: int | None = None,
) -> dict:
    """The fields of lm-eval's `hf` `get_model_info`: parameters, dtype, revision, hub commits.

    `num_parameters` overrides the model's count: with a merged PEFT adapter, `hf`'s count of the unmerged
    model (its adapter layers included).
    """
    info = {
        "model_num_parameters": model.num_parameters() if num_parameters is None else num_parameters,
        "model_dtype": model.dtype,
        "model_revision": revision,
        "model_sha": _hub_sha(pretrained, revision),
    }
    if peft:
        info["peft_sha"] = _hub_sha(peft, revision)
    return info
