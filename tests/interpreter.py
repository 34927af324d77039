"""Triton checks on the CPU: a test module's checks run in ONE subprocess under ``TRITON_INTERPRET=1``.

The variable is read when ``@triton.jit`` decorates, so it must be set before triton is imported; a
subprocess keeps it away from the other test modules. The subprocess runs every check and prints one
JSON report; each pytest test then asserts on its own entry. A module's scaffolding::

    test_triton_interpreter = interpreter_test(__file__, CHECKS)

    if __name__ == "__main__" and "--interp" in sys.argv:
        report_checks(CHECKS)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
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


def interpreter_test(test_file: str, names: Iterable[str]) -> Callable[[str], None]:
    """A test with one case per check name: the first case runs `test_file`'s interpreter subprocess
    (`interpreter_report`), each case asserts on its own entry; a failed subprocess fails every case."""
    reports: dict[str, dict[str, Any] | AssertionError] = {}

    @pytest.mark.parametrize("name", list(names))
    def test(name: str) -> None:
        if test_file not in reports:
            try:
                reports[test_file] = interpreter_report(test_file)
            except AssertionError as exc:
                reports[test_file] = exc
        report = reports[test_file]
        if isinstance(report, AssertionError):
            raise report
        assert_check_passed(report, name)

    return test
