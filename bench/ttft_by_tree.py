"""Time to first token of one source tree's hf_radix (radix calls only), to compare commits on one host.

Each tree is a `git archive COMMIT hf_radix bench` unpacked into a directory; run one process per tree, one
after another in one device command, twice over (processes of the same code differ by up to ~1.3 ms):

    python bench/ttft_by_tree.py TREE LABEL OUTDIR [--profile] [GRAPH_MAX_BATCH]

Writes OUTDIR/LABEL.json: medians of 30 time-to-first-token calls and 12 four-token calls (generate_bench's
model and prompts, after its warm-up and priming). --profile also prints cProfile and torch.profiler tables.
"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

tree = Path(sys.argv[1]).resolve()
label, outdir = sys.argv[2], Path(sys.argv[3])
sys.path[:0] = [str(tree), str(tree / "bench")]
import torch  # noqa: E402
from common import build_llama  # noqa: E402

import hf_radix  # noqa: E402

assert Path(hf_radix.__file__).resolve().is_relative_to(tree), hf_radix.__file__
dev = torch.device("cuda")
torch.manual_seed(0)
model = build_llama(False, dev, torch.bfloat16)
numbers = [a for a in sys.argv[4:] if a.isdigit()]
engine = hf_radix.configure(model, mem_fraction=0.5, cuda_graph_max_batch=int(numbers[0]) if numbers else 256)
vocab = model.config.vocab_size
gen = torch.Generator().manual_seed(1)
prefix = torch.randint(2, vocab, (4096,), generator=gen).tolist()
other = torch.randint(2, vocab, (4096,), generator=gen).tolist()
firsts = torch.randperm(vocab - 2, generator=gen)[:80] + 2
qs = [[int(f), *torch.randint(2, vocab, (63,), generator=gen).tolist()] for f in firsts]


def call(ids, new):
    with torch.inference_mode():
        ids = torch.tensor([ids], device=dev)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              cache_implementation="radix")


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


t0 = time.perf_counter()
for q in qs[:2]:
    for new in (1, 4, 3):
        timed(lambda q=q, new=new: call(other + q, new))
warm = time.perf_counter() - t0
timed(lambda: call(prefix + qs[2], 1))
ttft = [timed(lambda q=q: call(prefix + q, 1)) for q in qs[3:33]]
call4 = [timed(lambda q=q: call(prefix + q, 4)) for q in qs[33:45]]
res = dict(label=label, warm_s=warm, ttft_ms=statistics.median(ttft) * 1e3,
           call4_ms=statistics.median(call4) * 1e3, ttft_raw=[round(x * 1e3, 2) for x in ttft],
           replays=engine.model_runner.extend_graphs.replays)
print(json.dumps(res))
outdir.mkdir(parents=True, exist_ok=True)
(outdir / f"{label}.json").write_text(json.dumps(res, indent=1))
if "--profile" in sys.argv:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for q in qs[45:55]:
        call(prefix + q, 1)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print("\n".join(s.getvalue().splitlines()[:50]))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats("hf_radix|generation", 40)
    print("\n".join(s.getvalue().splitlines()[:60]))
    with torch.profiler.profile() as p:
        for q in qs[55:58]:
            call(prefix + q, 1)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
