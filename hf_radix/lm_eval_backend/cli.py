"""`hf-radix-lm-eval`: lm-eval's own command line with the "hf-radix" model registered (and the default)."""

from __future__ import annotations

import logging
import os
import sys

import torch


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str] | None = None) -> None:
    """Runs lm-eval's CLI on `argv` (default: the process arguments) with `--model hf-radix` the default.

    lm-eval 0.4.13 reads no plugin entry points, so its own `lm_eval --model hf-radix` cannot find the model;
    this command imports it first. Without `--device`, CUDA is used when there is one, else the CPU (lm-eval
    would pass cuda:0, which hf-radix refuses on a machine without CUDA). hf-radix's notes, the prefix-reuse
    summary among them, are logged at INFO on stderr.
    """
    from lm_eval.__main__ import cli_evaluate

    from . import model  # noqa: F401  (registers "hf-radix")

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("ls", "validate", "-h", "--help"):
        start = 1 if args[:1] == ["run"] else 0
        if not _has(args, "--model"):
            args[start:start] = ["--model", "hf-radix"]
        if not _has(args, "--device"):
            args[start:start] = ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    _show_info_notes()
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


def _show_info_notes() -> None:
    """hf-radix's INFO notes shown (by transformers' handler) unless TRANSFORMERS_VERBOSITY is set."""
    if not os.environ.get("TRANSFORMERS_VERBOSITY"):
        logging.getLogger("hf_radix").setLevel(logging.INFO)
