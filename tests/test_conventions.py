"""transformers conventions: logging through transformers' verbosity."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import transformers
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import hf_radix


def _modules_with_logger():
    names = [m.name for m in pkgutil.walk_packages(hf_radix.__path__, "hf_radix.")]
    modules = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (lm-eval, triton) is not installed
            continue
        if hasattr(module, "logger"):
            modules.append(module)
    return modules


@pytest.fixture
def restore_verbosity():
    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


def test_transformers_verbosity_controls_every_hf_radix_logger(restore_verbosity):
    modules = _modules_with_logger()
    assert {"hf_radix.engine", "hf_radix.scheduler", "hf_radix.kv_pool"} <= {m.__name__ for m in modules}
    root = logging.get_logger()  # transformers' root logger: its handler prints hf_radix's messages too
    for module in modules:
        assert module.logger.name == module.__name__
        transformers.logging.set_verbosity_error()
        with CaptureLogger(root) as quiet:
            module.logger.warning("silenced")
        transformers.logging.set_verbosity_info()
        with CaptureLogger(root) as loud:
            module.logger.info("shown")
        assert quiet.out == "" and loud.out == "shown\n", module.__name__
