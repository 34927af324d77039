"""Triton checks on the CPU: a test module's checks run in ONE subprocess under ``TRITON_INTERPRET=1``.

The variable is read when ``@triton.jit`` decorates, so it must be set before triton is imported; a
subprocess keeps it away from the other test modules. The subprocess runs every check and prints one
JSON report; each pytest test then asserts on its own entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
_MARK = "@@REPORT@@"


def report_checks(checks: dict[str, Callable[[], dict[str, Any]]]) -> None:
    """Runs each check (in the subprocess) and prints the report; a check that raises is reported so."""
    torch.set_num_threads(1)
    report = {}
    for name, check in checks.items():
        try:
            report[name] = check()
        except Exception:  # noqa: BLE001 - reported to the parent test
            report[name] = {"ok": False, "error": traceback.format_exc()}
    print(_MARK + json.dumps(report))


def interpreter_report(test_file: str) -> dict[str, Any]:
    """Runs `python test_file --interp` under the Triton interpreter and returns its report."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), "--interp"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(REPO_ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise AssertionError(
        f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )


def assert_check_passed(report: dict[str, Any], name: str) -> None:
    res = report[name]
    assert "error" not in res, res.get("error")
    assert res["ok"], res
