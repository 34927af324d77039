"""Beyond one GPU on a 2-GPU host: data parallel with cache-aware routing, and tensor parallel vs device_map.

Parts (each one command, each merging its results into the same JSON file):

* ``dp`` (torchrun, 2 processes): gsp-16x32 (16 groups x 32 prompts, system 2,048 + question 256 tokens,
  64 new tokens, greedy, EOS ignored; Llama-3.1-8B shape, random bf16) on one GPU (rank 0 alone) and over
  both GPUs with `DataParallelRunner`; key ``dp_scaling`` = one-GPU time / two-GPU time, and the routed
  hit rate next to the one-GPU hit rate.
* ``tp`` (torchrun, 2 processes): gsp-8x32 on a Llama-3.1-70B-shape model (random bf16 weights, which do not
  fit one H200 with a useful pool) loaded with transformers' ``tp_plan="auto"``, run by `RadixBatchRunner`.
* ``hf`` (one process, both GPUs): the same gsp-8x32 with plain HF ``generate`` on that model loaded with
  ``device_map="auto"``; completes ``tp_vs_device_map``.

Random weights come from a stub checkpoint (config + one tensor): transformers initializes the missing
weights where they are placed (each TP shard on its rank, each device_map layer on its GPU), so nothing of
70B size touches the disk. ``--tiny`` runs every part CPU-sized with gloo (a self-check).

    torchrun --nproc-per-node 2 bench/multi_gpu.py --part dp --json bench/results/multi_gpu_h200x2.json
    torchrun --nproc-per-node 2 bench/multi_gpu.py --part tp --json bench/results/multi_gpu_h200x2.json
    python3 bench/multi_gpu.py --part hf --json bench/results/multi_gpu_h200x2.json
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA_8B, build_llama, git_commit, parser_for, timed  # noqa: E402
from gsp import make_prompts, run_hf  # noqa: E402

from hf_radix import RadixBatchRunner, SamplingParams  # noqa: E402
from hf_radix.integrations.data_parallel import DataParallelRunner  # noqa: E402
from hf_radix.integrations.distributed import all_gather_json  # noqa: E402
from hf_radix.tiny import tiny_config  # noqa: E402

LLAMA_70B = {  # Llama-3.1-70B: the 8B shape's vocabulary, rope and heads of 128, wider and deeper
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def setup(tiny: bool) -> tuple[torch.device, object]:
    """Joins the torchrun group; returns this rank's device and a gloo group for waiting off the GPU."""
    cuda = torch.cuda.is_available() and not tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=1))
    waiting = dist.new_group(backend="gloo", timeout=timedelta(hours=1))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, waiting


def timed_run(runner, prompts, new_tokens: int, device: torch.device) -> tuple[float, list]:
    runner.reset_cache()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return timed(lambda: runner.run(prompts, params, progress=False), device)


def hit_rate(outs, prompts) -> float:
    return sum(o.cached_tokens for o in outs) / sum(len(p) for p in prompts)


def part_dp(args) -> dict:
    device, waiting = setup(args.tiny)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tiny:
        groups, per_group, system_len, question_len, new_tokens, pool = 4, 4, 48, 8, 4, 4096
    else:
        groups, per_group, system_len, question_len, new_tokens, pool = 16, 32, 2048, 256, 64, 400_000
    torch.manual_seed(0)
    model = build_llama(args.tiny, device)
    vocab = model.config.vocab_size
    prompts = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True)
    warm = make_prompts(groups, per_group, system_len, question_len, vocab, shared=True, seed=2)
    options = dict(max_total_tokens=pool, chunked_prefill_size=8192)
    checksum = float(model.get_input_embeddings().weight.detach().float().sum())

    single = None
    if rank == 0:  # one GPU alone: the baseline (the other rank waits on the host)
        runner = RadixBatchRunner(model, **options)
        first_s, _ = timed_run(runner, warm, new_tokens, device)
        single_s, single_outs = timed_run(runner, prompts, new_tokens, device)
        runner.check_integrity()
        single = {"first_run_s": first_s, "radix_s": single_s, "hit_rate": hit_rate(single_outs, prompts)}
        del runner
    dist.barrier(group=waiting)

    dp = DataParallelRunner(model, **options)
    timed_run(dp, warm, new_tokens, device)
    dist.barrier(group=waiting)
    dp_s, dp_outs = timed_run(dp, prompts, new_tokens, device)
    dp.check_integrity()
    dp_s = max(all_gather_json(dp_s))
    checksums = all_gather_json(checksum)
    if rank != 0:
        return {}
    routes = dp.last_routes
    replicas = []
    for r in range(world):
        mine = [i for i, x in enumerate(routes) if x == r]
        replicas.append({
            "prompts": len(mine),
            "groups": len({i // per_group for i in mine}),
            "hit_rate": hit_rate([dp_outs[i] for i in mine], [prompts[i] for i in mine]) if mine else 0.0,
        })
    split_groups = sum(len({routes[g * per_group + j] for j in range(per_group)}) > 1 for g in range(groups))
    agreement = statistics.mean(
        sum(a == b for a, b in zip(o.token_ids, s.token_ids)) / new_tokens
        for o, s in zip(dp_outs, single_outs)
    )
    return {
        "dp": {
            "workload": f"gsp-{groups}x{per_group}",
            "dp_size": world,
            "system_len": system_len,
            "question_len": question_len,
            "new_tokens": new_tokens,
            "pool_tokens_per_replica": pool,
            "single_gpu": single,
            "dp_radix_s": dp_s,
            "dp_scaling": single["radix_s"] / dp_s,
            "dp_hit_rate": hit_rate(dp_outs, prompts),
            "hit_rate_equal": abs(hit_rate(dp_outs, prompts) - single["hit_rate"]) < 1e-9,
            "groups_split_over_replicas": split_groups,
            "replicas": replicas,
            "replica_weights_identical": len(set(checksums)) == 1,
            "greedy_token_agreement_vs_single_gpu": agreement,
            "errors": sum(o.error is not None for o in dp_outs),
        }
    }


def stub_checkpoint(path: Path, tiny: bool) -> Path:
    """Config plus one tensor: transformers initializes every other weight where it is placed."""
    config = tiny_config("llama", eos_token_id=None) if tiny else transformers.LlamaConfig(**LLAMA_70B)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    norm = torch.ones(config.hidden_size, dtype=torch.bfloat16)
    save_file({"model.norm.weight": norm}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def gsp_8x32(tiny: bool, vocab: int) -> tuple[list, int]:
    if tiny:
        return make_prompts(2, 4, 48, 8, vocab, shared=True), 4
    return make_prompts(8, 32, 2048, 256, vocab, shared=True), 64


def _prepare(model) -> None:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.eval()


def part_tp(args) -> dict:
    device, waiting = setup(args.tiny)
    rank = dist.get_rank()
    if rank == 0:
        stub_checkpoint(args.stub_dir, args.tiny)
    dist.barrier(group=waiting)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    load_s, model = timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        args.stub_dir, tp_plan="auto", dtype=dtype), sync=False)
    _prepare(model)
    prompts, new_tokens = gsp_8x32(args.tiny, model.config.vocab_size)
    pool = 4096 if args.tiny else 200_000
    runner = RadixBatchRunner(model, max_total_tokens=pool, chunked_prefill_size=8192)
    system_len, question_len = (16, 4) if args.tiny else (256, 32)
    warm = make_prompts(2, 4, system_len, question_len, model.config.vocab_size, shared=True, seed=2)
    first_s, _ = timed_run(runner, warm, 4, device)
    radix_s, outs = timed_run(runner, prompts, new_tokens, device)
    runner.check_integrity()
    tokens = all_gather_json([o.token_ids for o in outs])
    radix_s = max(all_gather_json(radix_s))
    if rank != 0:
        return {}
    return {
        "tp": {
            "workload": f"gsp-{'2x4' if args.tiny else '8x32'}",
            "model": "tiny llama" if args.tiny else "Llama-3.1-70B shape, random bf16",
            "tp_size": dist.get_world_size(),
            "load_s": load_s,
            "warmup_s": first_s,
            "radix_s": radix_s,
            "hit_rate": hit_rate(outs, prompts),
            "kv_heads_per_rank": runner.engine.pool.shape.num_kv_heads,
            "pool_tokens_per_rank": runner.engine.manager.num_pages * runner.engine.page_size,
            "output_tok_s": len(prompts) * new_tokens / radix_s,
            "tokens_identical_on_all_ranks": all(t == tokens[0] for t in tokens),
            "errors": sum(o.error is not None for o in outs),
        }
    }


def part_hf(args) -> dict:
    """Plain HF generate on the device_map="auto" model over every visible GPU, one process; then
    hf_radix on that same model (its pool placed per layer on each layer's GPU)."""
    tiny = args.tiny or not torch.cuda.is_available()
    stub_checkpoint(args.stub_dir, tiny)
    budget = {int(k) if str(k).isdigit() else k: v for k, v in args.max_memory.items()}
    placement = dict(device_map="cpu") if tiny else dict(device_map="auto", max_memory=budget)
    load_s, model = timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        args.stub_dir, dtype=torch.float32 if tiny else torch.bfloat16, **placement
    ), sync=False)
    _prepare(model)
    device = torch.device("cpu" if tiny else "cuda")
    prompts, new_tokens = gsp_8x32(tiny, model.config.vocab_size)
    run_hf(model, prompts[:2], 2, 2, device.type)  # warm-up
    hf_s, hf_outs = run_hf(model, prompts, new_tokens, args.hf_batch, device.type)
    result = {
        "devices": sorted({str(d) for d in getattr(model, "hf_device_map", {"": device}).values()}),
        "load_s": load_s,
        "hf_batch": args.hf_batch,
        "hf_generate_s": hf_s,
        "output_tok_s": len(prompts) * new_tokens / hf_s,
    }
    if tiny or torch.cuda.device_count() > 1:
        if not tiny:
            torch.cuda.empty_cache()  # HF's KV caches, before the pool is sized
        runner = RadixBatchRunner(model, max_total_tokens=4096 if tiny else 200_000)
        radix_s, outs = timed_run(runner, prompts, new_tokens, device)
        runner.check_integrity()
        result["radix_on_device_map"] = {
            "pool": type(runner.engine.pool).__name__,
            "radix_s": radix_s,
            "speedup_vs_hf_generate": hf_s / radix_s,
            "hit_rate": hit_rate(outs, prompts),
            "greedy_token_agreement": statistics.mean(
                sum(a == b for a, b in zip(o.token_ids, h)) / new_tokens for o, h in zip(outs, hf_outs)
            ),
        }
    return {"hf_device_map": result}


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--part", choices=("dp", "tp", "hf"), required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU-sized self-check (gloo)")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument(
        "--max-memory", type=json.loads, default={0: "75GiB", 1: "75GiB"},
        help="device_map='auto' budget per GPU (JSON), leaving room for KV caches",
    )
    parser.add_argument("--stub-dir", type=Path, default=Path("/tmp/hf_radix_llama70b_stub"))
    args = parser.parse_args()
    if args.tiny:
        args.stub_dir = args.stub_dir.with_name(args.stub_dir.name + "_tiny")
    results = {"dp": part_dp, "tp": part_tp, "hf": part_hf}[args.part](args)
    launcher = "torchrun --nproc-per-node 2 " if args.part != "hf" else "python3 "
    if results:
        command = launcher + "bench/multi_gpu.py " + " ".join(sys.argv[1:])
        print(json.dumps(results, indent=1))
        if args.json:
            merged = json.loads(args.json.read_text()) if args.json.exists() else {}
            merged.update(results)
            merged.setdefault("commands", {})[args.part] = command
            merged["git_commit"] = git_commit()
            merged["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            merged["transformers"], merged["torch"] = transformers.__version__, torch.__version__
            if "tp" in merged and "hf_device_map" in merged:
                hf_s, tp_s = merged["hf_device_map"]["hf_generate_s"], merged["tp"]["radix_s"]
                merged["tp_vs_device_map"] = hf_s / tp_s
            args.json.write_text(json.dumps(merged, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
