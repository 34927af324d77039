"""The demo's own lines: the summary against plain generate and the engine's statistics, readable."""

from __future__ import annotations

from conftest import fresh_model

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.demo import RunReport, describe_stats, summary


def test_summary_says_how_much_less_time_and_how_many_fewer_tokens():
    base = RunReport("plain", 1.0, 10_000, 9_000, 0)
    cold = RunReport("cold", 0.25, 1_000, 9_000, 8_000)
    warm = RunReport("warm", 0.1, 100, 9_000, 8_900)
    line = summary(base, cold, warm)
    assert "\n" not in line
    assert "75% less CPU time" in line and "9,000 fewer tokens computed (1,000 vs 10,000)" in line
    assert "90% less CPU time, 9,900 fewer tokens computed" in line


def test_engine_statistics_print_as_labelled_lines():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=512)
    runner.run([list(range(5, 30))] * 2, SamplingParams(max_new_tokens=3, ignore_eos=True))
    stats = hf_radix.cache_stats(model)
    lines = describe_stats(stats)
    assert len(lines) == 3  # every entry of an engine without a host tier has its place
    text = "\n".join(lines)
    assert f"prompt tokens: {stats['prompt_tokens']:,}" in text and "{" not in text
    assert f"tokens generated: 6 in {stats['wall_time']:.2f} s" in text and stats["wall_time"] > 0
    assert describe_stats({**stats, "host_tier_tokens": 1024})[-1] == "  host_tier_tokens: 1,024"
