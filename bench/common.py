"""Shared by the GPU benchmarks: the Llama-3.1-8B shape with random weights, built directly on the device."""

from __future__ import annotations

import torch
import transformers

from hf_radix.tiny import tiny_config

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def build_llama(
    tiny: bool, device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """A tiny fp32 Llama (CPU self-checks) or the Llama-3.1-8B shape in `dtype`, random weights, on `device`.

    EOS is unset: random weights would otherwise stop generations at arbitrary points.
    """
    config = tiny_config("llama", eos_token_id=None) if tiny else transformers.LlamaConfig(**LLAMA_8B)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()
