"""What the H200's own GEMMs allow: the Llama-3.1-8B shape's linear layers alone, timed in a CUDA graph.

Issue 12's decode-step goal (<= 7 ms at 256 rows, gsp-8x32) and its gsp-16x16 goal (>= 6x HF generate)
assume the step is K/V reads. This measures the rest: every q/k/v/o/gate/up/down projection of the 32
layers (the model's own nn.Linear modules, cuBLAS) and the LM head, on 256 decode rows and on one
8,192-token prefill chunk, and adds the attention's bytes at 4.3 TB/s. Norms, RoPE, activations and
sampling are left out, so the floors are lower bounds.

    python bench/decode_floor.py --json bench/results/decode_floor_h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import build_llama, parser_for, timer, write_result  # noqa: E402

PEAK_BYTES_S = 4.3e12  # the H200's HBM bandwidth, as the shared-prefix kernel goal counts it
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16


def linears_ms(model, rows: int, head_rows: int, replays: int = 20) -> tuple[float, float]:
    """Milliseconds of one pass of every linear layer on `rows` tokens (LM head on `head_rows`), and the
    TFLOP it computes."""
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
    flop = 0.0

    def body() -> None:
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj):
                proj(x)
            mlp.down_proj(h)
        model.lm_head(x[:head_rows])

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            tokens = head_rows if module is model.lm_head else rows
            flop += 2 * module.in_features * module.out_features * tokens
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for _ in range(3):
            graph.replay()
        with timer(events=True, sync=False) as t:
            for _ in range(replays):
                graph.replay()
    return t.ms / replays, flop / 1e12


def attention_floor_ms(prefix_tokens: int, suffix_tokens: int) -> float:
    """Milliseconds to read K/V of `prefix_tokens` (once per group) and `suffix_tokens` at peak bandwidth."""
    return 1e3 * (prefix_tokens + suffix_tokens) * KV_BYTES_PER_TOKEN / PEAK_BYTES_S


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--gsp", type=Path, default=Path(__file__).parent / "results" / "gsp_h200.json",
                        help="the measured gsp run to compare with")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_llama(False, "cuda")
    decode_ms, decode_tflop = linears_ms(model, 256, 256)
    chunk_ms, chunk_tflop = linears_ms(model, 8192, 16)
    gsp = json.loads(args.gsp.read_text())

    # gsp-8x32: 8 groups x 2,048-token prefix, 256 rows x (256-token question + on average 32 generated)
    attn_8x32 = attention_floor_ms(8 * 2048, 256 * (256 + 32))
    floor_8x32 = decode_ms + attn_8x32
    # gsp-16x16: 16 x 1,024 prefix tokens + 256 x 512 question tokens prefilled in 8,192-token chunks, then
    # 128 decode steps over 16 x 1,024 prefix and 256 x (512 + on average 64) suffix tokens
    prefill_tokens = 16 * 1024 + 256 * 512
    attn_16x16 = attention_floor_ms(16 * 1024, 256 * (512 + 64))
    floor_16x16_s = (prefill_tokens / 8192 * chunk_ms + 128 * (decode_ms + attn_16x16)) / 1e3
    g16 = gsp.get("groups16", {})
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "decode_256_rows": {
            "linears_ms": decode_ms,
            "linears_tflop_s": decode_tflop / decode_ms * 1e3,
            "attention_bytes_floor_ms": attn_8x32,
            "step_floor_ms": floor_8x32,
            "measured_step_gpu_ms": gsp["shared"]["decode_step_gpu_ms"],
            "goal_ms": 7.0,
        },
        "prefill_chunk_8192": {"linears_ms": chunk_ms, "linears_tflop_s": chunk_tflop / chunk_ms * 1e3},
        "gsp_16x16": {
            "floor_s": floor_16x16_s,
            "hf_generate_s": g16.get("hf_generate_s"),
            "floor_speedup": g16["hf_generate_s"] / floor_16x16_s if g16 else None,
            "measured_radix_s": g16.get("radix_s"),
            "measured_speedup": g16.get("speedup"),
            "goal_speedup": 6.0,
        },
        "left_out": "norms, RoPE, activations, residual adds, sampling and prefill attention (lower bounds)",
    }
    write_result(result, args.json)


if __name__ == "__main__":
    main()
