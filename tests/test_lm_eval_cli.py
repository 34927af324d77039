"""The `hf-radix-lm-eval` console command: lm-eval's CLI with the model registered, on a local task."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # lm-eval's CLI indexes all of its own tasks first (~15 s)
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[eval])")

from hf_radix.tiny import tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _console_scripts() -> dict[str, str]:
    """`console_scripts` of setup.py: command name -> "module:function"."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            entries = ast.literal_eval(node.value)["console_scripts"]
            return dict(entry.replace(" ", "").split("=", 1) for entry in entries)
    raise AssertionError("setup.py declares no entry_points")


def test_console_command_runs_a_local_task(tmp_path):
    target = _console_scripts()["hf-radix-lm-eval"]
    module, function = target.split(":")
    checkpoint = tmp_path / "model"
    tiny_model("llama", seed=1).save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    installed = Path(sys.executable).with_name("hf-radix-lm-eval")  # `pip install -e .` (CI) makes it
    # else what the installed script does: import the entry point and call it with the command line
    command = [str(installed)] if installed.exists() else [
        sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
    args = ["--model_args", f"pretrained={checkpoint},dtype=float32,max_length=128",
            "--tasks", "hf_radix_tiny_mc", "--include_path", str(ROOT / "tests" / "data"),
            "--limit", "3", "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "served from the prefix cache" in done.stderr  # the one-line reuse summary
    assert "batch_size" not in done.stderr  # no note about a batch size nobody set
    assert done.stderr.count("KV pool") == 1 and "(32,768 tokens" in done.stderr  # one line, the right size
    (result,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(result.read_text())
    assert results["config"]["model"] == "hf-radix"  # --model defaults to hf-radix
    assert results["results"]["hf_radix_tiny_mc"]["acc,none"] >= 0
    assert results["config"]["hf_radix_reuse"]["cached_tokens"] > 0
