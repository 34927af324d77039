"""The architecture matrix: tiny random models of many transformers families, each exact or refused.

`check_architecture(name)` builds a 2-layer, hidden-64 fp32 model of one family (most hybrid families:
their `hf_radix.hybrid_layers.tiny_configs`, hidden 32, 2-4 layers) and either finds it
refused with `UnsupportedModelError` when its engine is created, or checks, against plain transformers:
runner greedy tokens (shared prefix, a duplicate, a strict prefix), left-padded `generate` tokens and every
step's logits, and log-likelihoods. `python tests/model_matrix.py` regenerates docs/architectures.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams, UnsupportedModelError  # noqa: E402
from hf_radix.hybrid_layers import tiny_configs, tiny_hybrid_vlm  # noqa: E402

VOCAB = 384
PAD = 0
LOGIT_TOL = 2e-5
LOGPROB_TOL = 5e-5
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
_IDS = dict(pad_token_id=PAD, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
_GPT = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
_WINDOWED = dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"])


def _base(*drop: str, **kw: Any) -> dict[str, Any]:
    return {**{k: v for k, v in _BASE.items() if k not in drop}, **kw}


def _hybrid(family: str) -> tuple[str, dict[str, Any]]:
    """A hybrid family's tiny config of `hf_radix.hybrid_layers.tiny_configs` (hidden 32, 2-4 layers)."""
    cls_name, _, kwargs = tiny_configs()[family]
    return cls_name, {**kwargs, "vocab_size": VOCAB}


#: name -> (config class, its arguments besides the token ids)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama": ("LlamaConfig", _base(head_dim=16)),
    "Qwen2": ("Qwen2Config", _base(use_sliding_window=True, sliding_window=12, max_window_layers=1,
                                   layer_types=["full_attention", "sliding_attention"])),
    "Qwen3": ("Qwen3Config", _base(head_dim=16)),
    "Mistral": ("MistralConfig", _base(head_dim=16, sliding_window=12)),
    "Gemma2": ("Gemma2Config", _base(head_dim=16, sliding_window=12, attn_logit_softcapping=20.0,
                                     final_logit_softcapping=15.0, query_pre_attn_scalar=16)),
    "Gemma3Text": ("Gemma3TextConfig", _base(head_dim=16, query_pre_attn_scalar=16, **_WINDOWED)),
    "Phi3": ("Phi3Config", _base()),
    "Phi": ("PhiConfig", _base()),
    "GPT2": ("GPT2Config", dict(_GPT)),
    "GPTNeoX": ("GPTNeoXConfig", _base("num_key_value_heads")),
    "GPTJ": ("GPTJConfig", dict(_GPT, rotary_dim=8)),
    "OPT": ("OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=64)),
    "Olmo2": ("Olmo2Config", _base()),
    "Mixtral": ("MixtralConfig", _base(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2Moe": ("Qwen2MoeConfig", _base(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32)),
    "Qwen3Moe": ("Qwen3MoeConfig", _base(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32)),
    "Cohere": ("CohereConfig", _base()),
    "Starcoder2": ("Starcoder2Config", _base(sliding_window=12)),
    "Granite": ("GraniteConfig", _base()),
    "SmolLM3": ("SmolLM3Config", _base()),
    "Glm4": ("Glm4Config", _base(head_dim=16)),
    "Exaone4": ("Exaone4Config", _base(head_dim=16, **_WINDOWED)),
    "GptOss": ("GptOssConfig", _base(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                     **_WINDOWED)),
    "DeepseekV3": ("DeepseekV3Config", _base(num_key_value_heads=4, moe_intermediate_size=32,
                                             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=1, topk_group=1,
                                             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=8)),
    "Dbrx": ("DbrxConfig", dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=1024,
                                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})),
    "Bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    "Falcon": ("FalconConfig", _base("num_key_value_heads", "intermediate_size")),
    "GPTNeo": ("GPTNeoConfig", dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], window_size=12,
                                    max_position_embeddings=1024)),
    "Mpt": ("MptConfig", dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=1024)),
    "Mamba": ("MambaConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8)),
    "Jamba": ("JambaConfig", _base(num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                   mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False)),
    "Qwen3Next": ("Qwen3NextConfig", _base(head_dim=16, num_experts=2, num_experts_per_tok=1,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           layer_types=["linear_attention", "full_attention"])),
    "FalconH1": ("FalconH1Config", _base(head_dim=16, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
                                         mamba_d_ssm=64)),
    "Qwen3_5": _hybrid("qwen3_5"),
    "Qwen3_5Moe": _hybrid("qwen3_5_moe"),
    "Qwen3_5VL": ("Qwen3_5Config", {}),  # built by tiny_hybrid_vlm: a vision tower, text prompts only
    "NemotronH": _hybrid("nemotron_h"),
    "GraniteMoeHybrid": _hybrid("granitemoehybrid"),
    "Bamba": _hybrid("bamba"),
    "Lfm2": _hybrid("lfm2"),
    "Lfm2Moe": _hybrid("lfm2_moe"),
    "MiniMax": _hybrid("minimax"),
    "RecurrentGemma": _hybrid("recurrent_gemma"),
    "Mamba2": _hybrid("mamba2"),
    "Llava": ("LlavaConfig", {}),  # built by _llava_config: a vision tower in front of a tiny Llama
}


def _llava_config() -> transformers.PretrainedConfig:
    text = transformers.LlamaConfig(**_base(head_dim=16), **_IDS)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=16)
    return transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=3)


def tiny_matrix_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight fp32 causal LM of the family `name` in eval mode."""
    cls_name, kwargs = ARCHITECTURES[name]
    torch.manual_seed(seed)
    if name == "Llava":
        return transformers.LlavaForConditionalGeneration(_llava_config()).float().eval()
    if name == "Qwen3_5VL":  # placeholder ids past VOCAB: the prompts are text
        return tiny_hybrid_vlm("qwen3_5", seed, vocab_size=VOCAB + 4, **_IDS)
    config = getattr(transformers, cls_name)(**kwargs, **_IDS)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _prompts(gen: torch.Generator) -> list[list[int]]:
    """Two prompts behind a shared 40-token prefix, a duplicate of one, and a strict prefix of it."""
    shared = torch.randint(2, VOCAB, (40,), generator=gen).tolist()
    a = shared + torch.randint(2, VOCAB, (7,), generator=gen).tolist()
    b = shared + torch.randint(2, VOCAB, (13,), generator=gen).tolist()
    return [a, b, list(a), a[:30]]


def _hf_greedy(model, ids: list[int], new: int) -> list[int]:
    ids_t = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=new,
                             do_sample=False, pad_token_id=PAD, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _hf_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    logp = logits[len(context) - 1 : -1].log_softmax(-1).cpu()
    return float(logp.gather(-1, torch.tensor(continuation)[:, None]).sum())


def check_architecture(name: str, page_size: int = 1, new_tokens: int = 4, attn_backend: str = "torch",
                       device: str = "cpu", logit_tol: float = LOGIT_TOL,
                       logprob_tol: float = LOGPROB_TOL) -> dict[str, Any]:
    """{"status": "exact" | "refused", "reason", errors...}; AssertionError if supported but not exact."""
    model = tiny_matrix_model(name).to(device)
    try:
        hf_radix.configure(model, max_total_tokens=1024, page_size=page_size, attn_backend=attn_backend)
    except UnsupportedModelError as exc:
        return {"status": "refused", "reason": exc.reason, "model_class": exc.model_class}
    gen = torch.Generator().manual_seed(1)
    prompts = _prompts(gen)
    want = [_hf_greedy(model, p, new_tokens) for p in prompts]

    runner = RadixBatchRunner(model, attn_backend=attn_backend)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    got = [o.token_ids for o in outs]
    assert got == want, f"{name}: runner greedy {got} != transformers {want}"
    runner.check_integrity()

    ids, mask = (t.to(device) for t in _left_pad(prompts[:2] + prompts[3:]))
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                  eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kwargs)
    out = model.generate(ids, cache_implementation="radix", **kwargs)
    assert torch.equal(out.sequences, ref.sequences), f"{name}: generate tokens differ"
    logit_err = max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores))
    assert logit_err <= logit_tol, f"{name}: generate step logits differ by {logit_err}"
    runner.check_integrity()

    pairs = [(prompts[0][:20], prompts[0][20:]), (prompts[1][:41], prompts[1][41:]), (prompts[3][:5], [7, 9])]
    scores = runner.loglikelihood(pairs)
    lp_err = max(abs(s - _hf_logprob(model, c, x)) for (s, _), (c, x) in zip(scores, pairs))
    assert lp_err <= logprob_tol, f"{name}: log-likelihoods differ by {lp_err}"
    runner.check_integrity()
    return {"status": "exact", "logit_err": logit_err, "logprob_err": lp_err,
            "model_class": type(model).__name__}


def architecture_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table of the matrix results."""
    lines = [
        "# Supported and refused architectures",
        "",
        "Generated by `python tests/model_matrix.py` (transformers "
        f"{transformers.__version__}) from the CI matrix in `tests/test_architectures.py`: tiny random "
        "fp32 models of each family (2 layers, hidden 64; most hybrid families 2-4 layers, hidden 32). "
        "*Exact*: "
        "runner greedy tokens, `generate` tokens and every step's logits, and log-likelihoods equal plain "
        "transformers (shared prefixes, duplicates, strict prefixes). *Refused*: "
        "`hf_radix.UnsupportedModelError` when the engine is created, before any forward, for the reason "
        "given. The check reads the installed transformers: a family whose layers bypass the interfaces "
        "hf_radix plugs into in another release is refused there (GPT-J and every hybrid family in "
        "transformers 5.17, Falcon before 5.25; an ALiBi Falcon is refused in every release). Hybrid "
        "families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Nemotron-H, "
        "GraniteMoeHybrid, Falcon-H1, Bamba, LFM2, LFM2-MoE: attention plus state layers, docs/hybrid.md) "
        "run the runner and radix `generate` with the prefix cache and state snapshots on the tree. "
        "Qwen3_5VL is `Qwen3_5ForConditionalGeneration`, as Qwen3.5 checkpoints load: "
        "text prompts run exactly; image and video inputs and their placeholder tokens are refused.",
        "",
        "| family | model class | hf_radix | reason |",
        "| --- | --- | --- | --- |",
    ]
    for name, res in results.items():
        reason = res.get("reason", "").replace("|", "\\|")
        lines.append(f"| {name} | `{res.get('model_class', '-')}` | {res['status']} | {reason} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO / "docs" / "architectures.md"))
    args = parser.parse_args()
    results = {}
    for i, name in enumerate(ARCHITECTURES):
        results[name] = check_architecture(name, page_size=16 if i % 2 else 1)
        print(name, results[name], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(architecture_table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
