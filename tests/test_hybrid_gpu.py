"""Hybrid models on the GPU: the Triton attention backend, transformers' GPU paths for the state layers
(flash-linear-attention's kernels where installed) and the state pool on the device give the same greedy
tokens and log-likelihoods as plain transformers on the same GPU, with prefix hits and decode steps
replayed from CUDA graphs, and scoring rows of other lengths padded into one forward (tiny fp32 models)."""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy, hf_logprob

from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.hybrid_layers import cache_state_api, tiny_hybrid_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cache_state_api(), reason="this transformers' state layers bypass the Cache API"),
]
NEW = 6


@pytest.mark.parametrize(("family", "page_size"), [("qwen3_5", 1), ("qwen3_5", 16), ("nemotron_h", 16),
                                                   ("lfm2", 16), ("falcon_h1", 4)])
def test_hybrid_runner_equals_transformers_on_gpu(family: str, page_size: int) -> None:
    model = tiny_hybrid_model(family).cuda()
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    shared = torch.randint(3, vocab, (37,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 12, 12, 30, 7)]
    runner = RadixBatchRunner(model, max_total_tokens=2048, page_size=page_size, attn_backend="triton")
    for call in range(2):  # the second call hits the first one's snapshots
        outs = runner.run(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, NEW) for p in prompts], call
        runner.check_integrity()
    assert runner.stats.cached_tokens > 0
    assert runner.model_runner.decode_graphs.replays > 0  # five rows: decode graphs of 8, three padding rows
    pairs = [(p[:-k], p[-k:]) for p, k in zip(prompts, (2, 4, 7, 3, 5))]  # shorter last chunks run padded
    for (logprob, _), (context, continuation) in zip(runner.loglikelihood(pairs), pairs):
        assert abs(logprob - hf_logprob(model, context, continuation)) <= 1e-3
    runner.check_integrity()
