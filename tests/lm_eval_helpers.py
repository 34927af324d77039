"""Runs lm-eval on the local tasks in tests/data (no downloads), for the lm-eval backend tests."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import lm_eval
from lm_eval.tasks import TaskManager

DATA = Path(__file__).with_name("data")


def evaluate(model_name: str, model_args: dict, tasks: list[str], **options) -> dict:
    """`simple_evaluate` with samples logged, no bootstrap and no environment report (a `pip list`)."""
    with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
        return lm_eval.simple_evaluate(
            model=model_name, model_args=model_args, tasks=tasks, log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(DATA), include_defaults=False), verbosity="ERROR",
            **options,
        )
