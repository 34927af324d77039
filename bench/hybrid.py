"""Hybrid models: a Qwen3.5-shaped model (random bf16 weights; 24 Gated DeltaNet layers and 8 attention
layers, hidden 4096, ~9B parameters with its 248K vocabulary) through hf_radix vs plain transformers, in
one process.

Parts (each one key of the JSON; a part that fails is recorded and the others still run):
- `kernels`: which implementations transformers picked for the state layers (flash-linear-attention's
  Triton kernels when `fla` is importable, causal-conv1d's when installed, else its torch paths), and one
  forward's time: a 2,048-token prefill and a 32-row decode step.
- `gsp`: gsp-8x32 as in `bench/gsp.py` (8 system prompts of 2,048 tokens x 32 questions of 256 tokens,
  64 new tokens, greedy) through `RadixBatchRunner.run` vs HF `generate`; `speedup` is the issue's key.
- `score`: 5-shot multiple-choice scoring as in `bench/score_bench.py` (a 1,500-token shared prefix) through
  `runner.loglikelihood` vs lm-eval-style batched HF forwards.
- `chat`: 5 turns of 16 conversations through radix `generate` (left-padded batches; each turn's prompt is
  the whole history) vs plain `generate` on the same prompts.
Each part reports hit rates and the state pool's memory (slots, bytes, snapshots held at the end).

    python bench/hybrid.py --json bench/results/hybrid_h200.json
    python bench/hybrid.py --tiny
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import parser_for, say, timed, write_result  # noqa: E402
from gsp import make_prompts, run_hf  # noqa: E402
from score_bench import hf_loglikelihood, make_workload  # noqa: E402

import hf_radix  # noqa: E402
from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402
from hf_radix.engine import get_engine  # noqa: E402
from hf_radix.hybrid_layers import tiny_hybrid_model  # noqa: E402

FULL = dict(
    gsp=(8, 32, 2048, 256, 64), hf_batch=128, score_batch=16,
    score=dict(questions=128, choices=4, prefix_len=1500, question_len=100, choice_len=(5, 20)),
    chat=dict(conversations=16, turns=5, system_len=1024, user_len=128, answer_len=64),
)
TINY = dict(
    gsp=(2, 4, 48, 8, 4), hf_batch=4, score_batch=8,
    score=dict(questions=8, choices=4, prefix_len=60, question_len=12, choice_len=(2, 5)),
    chat=dict(conversations=3, turns=3, system_len=20, user_len=6, answer_len=4),
)
RUNNER_OPTIONS = dict(
    page_size=16, max_total_tokens=400_000, chunked_prefill_size=8192, max_running_requests=256
)


def build_model(tiny: bool, device: str, layers: int | None) -> torch.nn.Module:
    """A tiny fp32 Qwen3.5 (CPU self-check) or the Qwen3.5 text model at its default (9B) shape in bf16."""
    if tiny:
        model = tiny_hybrid_model("qwen3_5")
    else:
        config = transformers.Qwen3_5TextConfig(**({"num_hidden_layers": layers} if layers else {}))
        with torch.device(device):
            model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def state_memory(model) -> dict:
    """The state pool's size and the snapshots the radix tree holds now."""
    engine = get_engine(model)
    pool, slots = engine.state_pool, engine.manager.state_slots
    return {
        "state_slots": pool.num_slots, "bytes_per_slot": pool.bytes_per_slot, "state_pool_bytes": pool.nbytes,
        "snapshots": len(slots.tree.snapshot_slots()),
        "snapshot_bytes": len(slots.tree.snapshot_slots()) * pool.bytes_per_slot,
        "kv_pool_tokens": engine.manager.num_pages * engine.page_size,
    }


def resolved(function) -> str:
    """The implementation behind one of transformers' kernel-or-fallback functions (the one its wrapper
    calls: a package's kernel, or the torch function itself)."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    target = cells["implementation"].cell_contents if "implementation" in cells else function
    return f"{target.__module__}.{target.__qualname__}"


def kernels_part(model, device: str, tiny: bool) -> dict:
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    paths = {
        name: resolved(getattr(module, name))
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update")
        if hasattr(module, name)
    }
    result = {
        "fla_installed": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
        "resolved": paths,
    }
    prefill_len, rows = (64, 4) if tiny else (2048, 32)
    ids = torch.randint(10, model.config.vocab_size, (1, prefill_len), device=device)
    with torch.inference_mode():
        result["prefill_2048_first_s"] = timed(lambda: model(input_ids=ids), device)[0]
        result["prefill_2048_s"] = min(timed(lambda: model(input_ids=ids), device)[0] for _ in range(3))
        batch = torch.randint(10, model.config.vocab_size, (rows, 256 if not tiny else 8), device=device)
        out = model(input_ids=batch, use_cache=True)
        step = torch.randint(10, model.config.vocab_size, (rows, 1), device=device)
        cache = out.past_key_values
        first_s, _ = timed(lambda: model(input_ids=step, cache=cache), device)  # compiles its kernels
        result["decode_step_32_rows_first_s"] = first_s
        result["decode_step_32_rows_s"] = min(timed(lambda: model(input_ids=step, cache=cache), device)[0]
                                              for _ in range(3))
    return result


def gsp_part(model, runner: RadixBatchRunner, shape: dict, device: str) -> dict:
    groups, per_group, system_len, question_len, new_tokens = shape["gsp"]
    vocab = model.config.vocab_size
    prompts = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True)
    warm = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True, seed=2)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    runner.reset_cache()
    first_s, _ = timed(lambda: runner.run(warm, params, progress=False), device)
    runner.reset_cache()
    radix_s, outs = timed(lambda: runner.run(prompts, params, progress=False), device)
    runner.check_integrity()
    memory = state_memory(model)
    hf_s, hf_outs = run_hf(model, prompts, new_tokens, shape["hf_batch"], device)
    agree = statistics.mean(
        sum(a == b for a, b in zip(o.token_ids, h)) / new_tokens for o, h in zip(outs, hf_outs)
    )
    return {
        "workload": f"gsp-{groups}x{per_group}", "system_len": system_len, "question_len": question_len,
        "new_tokens": new_tokens, "radix_s": radix_s, "radix_first_run_s": first_s, "hf_generate_s": hf_s,
        "hf_batch": shape["hf_batch"], "speedup": hf_s / radix_s,
        "hit_rate": sum(o.cached_tokens for o in outs) / sum(map(len, prompts)),
        "greedy_token_agreement": agree, **memory,
    }


def score_part(model, runner: RadixBatchRunner, shape: dict, device: str) -> dict:
    vocab = model.config.vocab_size
    pairs = make_workload(**shape["score"], vocab=vocab, seed=0)
    runner.reset_cache()
    # The first run compiles and autotunes: flash-linear-attention tunes some kernels per batch size, so
    # the steady run repeats the workload (on an empty cache) to meet the same row counts.
    first_s, _ = timed(lambda: runner.loglikelihood(pairs, progress=False), device)
    runner.reset_cache()
    before = hf_radix.cache_stats(model)
    radix_s, radix = timed(lambda: runner.loglikelihood(pairs, progress=False), device)
    after = hf_radix.cache_stats(model)
    runner.check_integrity()
    memory = state_memory(model)
    hf_s, hf = timed(lambda: hf_loglikelihood(model, pairs, shape["score_batch"], device), device)
    ours, theirs = np.array([lp for lp, _ in radix]), np.array(hf)
    q = shape["score"]["choices"]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return {
        "workload": {**shape["score"], "pairs": len(pairs)}, "radix_s": radix_s, "radix_first_run_s": first_s,
        "hf_s": hf_s, "hf_batch": shape["score_batch"], "speedup": hf_s / radix_s,
        "hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt else 0.0,
        "forward_calls": after["forward_calls"] - before["forward_calls"],
        "max_abs_diff": float(np.abs(ours - theirs).max()),
        "same_choice": float((ours.reshape(-1, q).argmax(1) == theirs.reshape(-1, q).argmax(1)).mean()),
        **memory,
    }


def left_padded(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def chat_part(model, shape: dict, device: str) -> dict:
    """Each turn: radix `generate` on the histories (left-padded), then plain `generate` on the same input;
    the next turn appends radix's answer and a new user message."""
    spec = shape["chat"]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(10, vocab, spec["system_len"]).tolist()
    def user() -> list[int]:
        return rng.integers(10, vocab, spec["user_len"]).tolist()

    histories = [system + user() for _ in range(spec["conversations"])]
    kwargs = dict(max_new_tokens=spec["answer_len"], min_new_tokens=spec["answer_len"], do_sample=False,
                  pad_token_id=0)
    hf_radix.reset_cache(model)
    turns = []
    with torch.inference_mode():
        for turn in range(spec["turns"]):
            ids, mask = left_padded(histories, device)
            before = hf_radix.cache_stats(model)
            radix_s, radix_out = timed(lambda: model.generate(
                ids, attention_mask=mask, cache_implementation="radix", **kwargs), device)  # noqa: B023
            after = hf_radix.cache_stats(model)
            hf_s, hf_out = timed(lambda: model.generate(ids, attention_mask=mask, **kwargs), device)  # noqa: B023
            answers = radix_out[:, ids.shape[1]:].tolist()
            agree = float((radix_out[:, ids.shape[1]:] == hf_out[:, ids.shape[1]:]).float().mean())
            prompt = after["prompt_tokens"] - before["prompt_tokens"]
            turns.append({
                "turn": turn + 1, "prompt_tokens": sum(map(len, histories)), "radix_s": radix_s, "hf_s": hf_s,
                "speedup": hf_s / radix_s, "token_agreement": agree,
                "hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt else 0.0,
            })
            say(f"chat turn {turn + 1}: {turns[-1]}")
            histories = [h + a + user() for h, a in zip(histories, answers)]
    later = turns[1:]
    return {
        "workload": spec, "turns": turns,
        "later_turns_speedup": sum(t["hf_s"] for t in later) / sum(t["radix_s"] for t in later),
        "later_turns_hit_rate": statistics.mean(t["hit_rate"] for t in later),
        "first_turn_over_later": turns[0]["radix_s"] / statistics.mean(t["radix_s"] for t in later),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = parser_for(__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 Qwen3.5 on the CPU: a self-check")
    parser.add_argument("--parts", default="kernels,gsp,score,chat")
    parser.add_argument("--layers", type=int, help="a shallower model of the same width")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = TINY if args.tiny else FULL
    model = build_model(args.tiny, device, args.layers)
    options = {**RUNNER_OPTIONS, "page_size": args.page_size}
    if args.tiny:
        options["max_total_tokens"] = 4096
    setup_s, runner = timed(lambda: RadixBatchRunner(model, **options), device)
    result: dict = {
        "model": "tiny Qwen3.5 fp32" if args.tiny else "Qwen3.5 text model, default (9B) shape, random bf16",
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "page_size": args.page_size,
        "setup_s": setup_s, **state_memory(model),
    }
    parts = {"kernels": lambda: kernels_part(model, device, args.tiny),
             "gsp": lambda: gsp_part(model, runner, shape, device),
             "score": lambda: score_part(model, runner, shape, device),
             "chat": lambda: chat_part(model, shape, device)}
    for name in args.parts.split(","):
        say(f"== {name}")
        try:
            result[name] = parts[name]()
        except Exception as error:  # a failed part is recorded; the others still run
            traceback.print_exc()
            result[name] = {"error": f"{type(error).__name__}: {error}"}
        write_result(result, args.json, echo=False)
        say(f"{name}: {result[name]}")
    return result


if __name__ == "__main__":
    main()
