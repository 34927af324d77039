"""`hf-radix-lm-eval`: lm-eval's own command line with the "hf-radix" model registered (and the default)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from ..options import EngineOptions

HELP = """\
hf-radix-lm-eval (or: python -m hf_radix.lm_eval_backend): lm-eval's own command line with the hf-radix
model registered and `--model hf-radix` the default; every lm-eval option works as in `lm-eval run`.

  hf-radix-lm-eval --model_args pretrained=meta-llama/Llama-3.1-8B,dtype=bfloat16 \\
      --tasks mmlu --num_fewshot 5 --output_path results/
  python -m hf_radix.lm_eval_backend --model_args pretrained=<dir or hub id>,page_size=16 --tasks hellaswag

--model_args takes hf's model_args and hf-radix's own: chunked_prefill_size, max_running_requests,
schedule_policy, max_gen_toks, and the engine options (docs/options.md): {engine_options}.
--batch_size is not needed (requests are scheduled by tokens). Without --device: CUDA when there is one,
else the CPU. Plain `lm_eval --model hf-radix` does not work: lm-eval reads no plugins, so nothing
registers the model. More: docs/lm_eval.md in the hf_radix repository.

lm-eval's own help follows.
""".format(engine_options=", ".join(EngineOptions.names()))

_BATCH_FLAGS = ("--batch_size", "-b", "--max_batch_size")


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def main(argv: list[str] | None = None) -> None:
    """Runs lm-eval's CLI on `argv` (default: the process arguments) with `--model hf-radix` the default.

    lm-eval 0.4.13 reads no plugin entry points, so its own `lm_eval --model hf-radix` cannot find the model;
    this command imports it first. Without `--device`, CUDA is used when there is one, else the CPU (lm-eval
    would pass cuda:0, which hf-radix refuses on a machine without CUDA). hf-radix's notes, the prefix-reuse
    summary among them, are logged at INFO on stderr.
    """
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    if "-h" in args or "--help" in args:
        print(HELP, flush=True)  # first: lm-eval's help takes seconds to import

    from lm_eval.__main__ import cli_evaluate

    from . import model, model_args  # noqa: F401  (importing model registers "hf-radix")

    # lm-eval passes batch_size=1 when none was given: no note that an unset batch size is ignored
    model_args.batch_size_is_cli_default = not any(_has(args, flag) for flag in _BATCH_FLAGS)
    if args[0] not in ("ls", "validate", "-h", "--help"):
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
