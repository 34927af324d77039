"""Tiny random-weight models and a local tokenizer: demos and tests run with no downloads."""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")

_CORPUS = """
The radix tree records mappings; the KV pool stores data. A prompt prefix computed once is reused by
every later request that shares it. Few-shot benchmarks repeat the same examples before every question,
and batch generation repeats the same system prompt before every user message. Question: what is the
capital of France? Answer: Paris. Question: how many legs does a spider have? Answer: eight.
You are a helpful assistant. Answer briefly and precisely. The quick brown fox jumps over the lazy dog.
0 1 2 3 4 5 6 7 8 9 ten eleven twelve. Choose A, B, C or D.
"""


def tiny_tokenizer(vocab_size: int = 384) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a built-in paragraph (any string encodes)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def tiny_config(arch: str = "llama", vocab_size: int = 384, **overrides) -> transformers.PretrainedConfig:
    """A 2-layer config of a real architecture (GQA; sliding windows and soft-caps where the family has)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(
            **common,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        )
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, head_dim=16, sliding_window=12)
    elif arch == "gemma2":
        config = transformers.Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=12,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random-weight causal LM of `arch` in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    return model.eval()
