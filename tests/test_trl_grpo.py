"""TRL's GRPOTrainer with `cache_implementation="radix"` trains exactly as without it.

GRPO generates its rollouts with `model.generate` between optimizer steps, in training mode, on the
weights being trained: every step after the first must see the K/V of the weights as they are now, not
the prefixes cached before the last step. Same seeds, same rollouts, same final weights.

TRL 1.16 (no vLLM) calls `generate(input_ids, attention_mask, generation_config=...)` under `no_grad` with
the model in train() mode, one row per sample (each prompt repeated `num_generations` times, no
`num_return_sequences`), sampling with `GRPOConfig`'s temperature/top_p/top_k and `cache_implementation`.
Its default optimizer is fused AdamW, whose steps do not bump the parameters' version counters.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed")
datasets = pytest.importorskip("datasets", reason="datasets is not installed")

import hf_radix  # noqa: E402
from hf_radix.tiny import tiny_model, tiny_tokenizer  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. "
PROMPTS = [
    SYSTEM + "Question: what is the capital of France? Answer:",
    SYSTEM + "Question: how many legs does a spider have? Answer:",
    SYSTEM + "Choose A, B, C or D.",
    SYSTEM + "The quick brown fox",
    SYSTEM + "0 1 2 3 4 5 6",
    SYSTEM + "Question: ten eleven? Answer:",
]
STEPS = 3


def _train(tmp_path, cache_implementation: str | None) -> tuple[torch.nn.Module, list[list[list[int]]]]:
    """Trains a fresh tiny Llama for STEPS GRPO steps; returns it and the completion ids of every step."""
    rollouts: list[list[list[int]]] = []

    def reward(completions, completion_ids, **kwargs) -> list[float]:
        rollouts.append([list(ids) for ids in completion_ids])
        return [float(sum(t % 3 == 0 for t in ids)) for ids in completion_ids]  # varies within a group

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / (cache_implementation or "plain")),
        per_device_train_batch_size=4,
        num_generations=2,  # two prompts a step, each sampled twice (TRL repeats the prompt rows)
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=1e-2,
        temperature=0.5,  # at 1.0 a random tiny model samples near-uniformly: stale K/V rarely shows
        cache_implementation=cache_implementation,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    torch.manual_seed(0)
    trainer = trl.GRPOTrainer(
        model=tiny_model("llama", seed=5),
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    return trainer.model, rollouts


def test_radix_grpo_matches_plain_generate(tmp_path):
    plain, want = _train(tmp_path, None)
    radix, got = _train(tmp_path, "radix")

    assert len(want) == STEPS and all(len(step) == 4 for step in want)
    stats = hf_radix.cache_stats(radix)
    assert stats["requests"] > 0  # the rollouts ran through the prefix cache
    assert stats["cached_tokens"] > 0  # and reused prefixes (each prompt is sampled twice a step)
    for step, (ours, theirs) in enumerate(zip(got, want)):
        assert ours == theirs, f"rollouts differ at step {step}"
    assert len(got) == len(want)

    initial = tiny_model("llama", seed=5).state_dict()
    trained = dict(plain.named_parameters())
    assert any(not torch.equal(p, initial[name]) for name, p in trained.items())  # the steps changed weights
    for name, param in radix.named_parameters():
        assert torch.equal(param, trained[name]), f"{name} differs after training"
