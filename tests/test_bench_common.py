"""bench/common.py's timing helper and result files: what every benchmark times and writes through."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import common  # noqa: E402


def test_timer_times_its_block():
    with common.timer() as t:
        time.sleep(0.02)
    assert 0.015 < t.seconds < 1.0
    assert t.ms == pytest.approx(t.seconds * 1e3) and t.us == pytest.approx(t.seconds * 1e6)


def test_timer_on_a_failing_block_still_records():
    t = common.timer(sync=False)
    with pytest.raises(ValueError), t:
        raise ValueError
    assert t.seconds >= 0


def test_timer_with_another_clock():
    with common.timer(sync=False, clock=time.thread_time) as t:
        time.sleep(0.05)  # sleeping costs no CPU time
    assert t.seconds < 0.04


def test_measure_reports_the_first_call_beside_the_steady_ones():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.03 if len(calls) == 1 else 0.001)
        return len(calls)

    timing = common.measure(fn, warmup=1, repeats=3)
    assert len(calls) == 4 and timing.value == 4
    assert len(timing.steady_s) == 3 and timing.first_s > max(timing.steady_s)
    assert timing.summary()["median_s"] == timing.median_s
    with pytest.raises(ValueError):
        common.measure(fn, repeats=0)


def test_timed_returns_seconds_and_value():
    seconds, value = common.timed(lambda: 7, sync=False)
    assert value == 7 and seconds >= 0


def test_timing_wrapper_records_every_call():
    spent = []
    wrapped = common.timing_wrapper(lambda x: 2 * x, spent.append)
    assert wrapped(3) == 6 and len(spent) == 1


def test_write_result_records_command_and_commit(tmp_path):
    path = tmp_path / "out" / "r.json"
    common.write_result({"x": 1}, path, echo=False)
    data = json.loads(path.read_text())
    assert data["x"] == 1 and data["command"].startswith("python") and data["git_commit"]


def test_options():
    parser = common.int_options(common.parser_for("doc"), pool_tokens=5)
    args = parser.parse_args(["--pool-tokens", "9", "--json", "a.json"])
    assert args.pool_tokens == 9 and args.json == Path("a.json")
    args = common.generate_parser("doc").parse_args(["--tiny", "--cpu"])
    args.prefix = None
    threads = torch.get_num_threads()
    try:
        assert common.generate_device(args, {"prefix": 100}, {"prefix": 10}).type == "cpu"
    finally:
        torch.set_num_threads(threads)  # generate_device caps the CPU threads; other tests keep theirs
    assert args.prefix == 10 and args.max_total_tokens == 8192
