"""Tensor parallel (transformers' tp_plan) over 2 gloo processes: each rank's pool holds its own KV heads."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import hf_greedy, hf_logits, random_ids
from rank_processes import run_ranks

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.tiny import tiny_model

NEW = 5


def _workload():
    gen = torch.Generator().manual_seed(11)
    shared = random_ids(gen, 24)
    prompts = [shared + random_ids(gen, n) for n in (2, 6, 9)] + [random_ids(gen, 7)]
    pair = (shared, random_ids(gen, 5))
    return prompts, pair


def _tp_rank(rank: int, device: torch.device, model_dir: str) -> dict:
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    prompts, pair = _workload()
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=512 + 64 * rank, page_size=2)
    greedy = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    torch.manual_seed(rank)  # the ranks' generators now differ: only rank 0's samples may count
    sampled = runner.run(prompts, SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True))
    [(logprob, _)] = runner.loglikelihood([pair])
    runner.check_integrity()
    return {
        "greedy": [o.token_ids for o in greedy],
        "sampled": [o.token_ids for o in sampled],
        "logprob": logprob,
        "kv_heads": runner.engine.pool.shape.num_kv_heads,
        "pool_tokens": runner.engine.manager.num_pages * runner.engine.page_size,
        "cached": runner.stats.cached_tokens,
    }


def test_tensor_parallel_matches_one_process(tmp_path):
    check_tensor_parallel(tmp_path, "gloo")


def check_tensor_parallel(tmp_path, backend: str) -> None:
    """TP=2 (gloo on CPU, NCCL on 2 GPUs) against plain HF on the unsharded model."""
    reference = tiny_model("llama")
    reference.save_pretrained(tmp_path / "model")
    ranks = run_ranks(tmp_path, backend, _tp_rank, str(tmp_path / "model"))
    prompts, (context, continuation) = _workload()
    logp = hf_logits(reference, context + continuation).log_softmax(-1)
    expected = sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(continuation))
    for result in ranks:
        assert result["greedy"] == [hf_greedy(reference, p, NEW) for p in prompts]
        assert result["logprob"] == pytest.approx(expected, abs=1e-4)
        assert result["kv_heads"] == reference.config.num_key_value_heads // 2  # this rank's shard only
        assert result["pool_tokens"] == 512  # the smallest rank's pool, so the schedules stay in lockstep
        assert result["cached"] > 0
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # rank 0's tokens, on every rank
    assert ranks[0]["cached"] == ranks[1]["cached"]
