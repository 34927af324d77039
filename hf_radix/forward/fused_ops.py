"""Llama-style RMSNorm and rotary embedding as single Triton kernels: in captured graphs and eager forwards.

A captured graph keeps the kernels it recorded and nothing of the Python that launched them. So while a
graph is captured, or an eager radix forward runs on CUDA (`RadixEngine.run_model`), the model's RMSNorm
modules and its modelling module's `apply_rotary_pos_emb` are swapped for one-kernel versions, and
restored right after: replays and eager radix forwards run the fused kernels (exact to fp32 rounding, a
fraction of the launches), and the model and its modelling module stay as they were outside. The swapped
versions run the fused kernels only in the swapping thread's context: another thread's forward meanwhile
runs the originals.

Only code that is exactly Llama's (same bytecode) is swapped; Mistral, Qwen2/3, Granite, SmolLM3 and
others share it. The rest (Gemma's `1 + weight` norm, say) keep their own, as do calls with shapes or
dtypes the kernels do not take.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import CodeType, FunctionType, ModuleType

import torch
from transformers.models.llama import modeling_llama
from transformers.utils import logging

from ..kernels import triton_runs_on

logger = logging.get_logger(__name__)

_fusing: ContextVar[bool] = ContextVar("hf_radix_fusing", default=False)  # this context is capturing


def _function(fn: object) -> FunctionType | None:
    """`fn` if it is a function, the function a kernels-hub wrapper calls, else None.

    With the `kernels` package installed, transformers >= 5.25 turns the functions it marks
    `@use_kernel_forward_from_hub` (`apply_rotary_pos_emb`) into instances of an `nn.Module` class whose
    `forward` calls the original function, a free variable `func` of that `forward`.
    """
    if isinstance(fn, FunctionType):
        return fn
    forward = getattr(type(fn), "forward", None)
    code: CodeType | None = getattr(forward, "__code__", None)
    if not hasattr(type(fn), "kernel_layer_name") or code is None or "func" not in code.co_freevars:
        return None
    inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return inner if isinstance(inner, FunctionType) else None


def _same_code(fn: object, reference: object) -> bool:
    """Whether `fn` is a function (or wraps one: `_function`) with exactly `reference`'s bytecode, names and
    constants (docs aside)."""
    fn, reference = _function(fn), _function(reference)
    if fn is None or reference is None:
        return False
    code, ref = fn.__code__, reference.__code__

    def consts(c: CodeType) -> tuple:
        return tuple(x for x in c.co_consts if not isinstance(x, str))

    return (
        code.co_code == ref.co_code
        and code.co_names == ref.co_names
        and code.co_varnames == ref.co_varnames
        and code.co_argcount == ref.co_argcount
        and consts(code) == consts(ref)
    )


def _norm_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from ..kernels.triton_norm_rope import rms_norm

    original = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if (
            not _fusing.get()
            or not triton_runs_on(hidden_states)
            or hidden_states.stride(-1) != 1
            or hidden_states.shape[-1] != module.weight.shape[-1]
        ):
            return original(hidden_states)
        return rms_norm(hidden_states, module.weight, module.variance_epsilon)

    return forward


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not triton_runs_on(q):
        return False
    if (q.dim(), k.dim(), cos.dim()) != (4, 4, 3) or cos.shape != sin.shape or cos.stride() != sin.stride():
        return False
    batch, _, seq_len, dim = q.shape
    return (
        len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1
        and k.shape[0] == batch
        and k.shape[2:] == q.shape[2:]
        and cos.shape[1:] == (seq_len, dim)
        and cos.shape[0] in (1, batch)
        and dim >= 2
        and dim & (dim - 1) == 0
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
    )


def _rope_function(original: Callable) -> Callable:
    from ..kernels.triton_norm_rope import rotary_embedding

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _fusing.get() or unsqueeze_dim != 1 or not _rope_fits(q, k, cos, sin):
            return original(q, k, cos, sin, unsqueeze_dim)
        return rotary_embedding(q, k, cos, sin)

    return apply_rotary_pos_emb


def _llama_rope_namespaces(model: torch.nn.Module) -> list[ModuleType]:
    """The modelling modules of `model`'s classes whose rotary embedding is Llama's."""
    names = {type(m).__module__ for m in model.modules()}
    spaces = [sys.modules[name] for name in sorted(names) if name in sys.modules]
    return [
        space for space in spaces
        if _same_code(getattr(space, "apply_rotary_pos_emb", None), modeling_llama.apply_rotary_pos_emb)
        and _same_code(getattr(space, "rotate_half", None), modeling_llama.rotate_half)
    ]


@contextlib.contextmanager
def fused_norm_and_rope(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, Llama-style norms and rotary embeddings of `model` run as single Triton kernels.

    Yields how many norm modules and modelling functions were swapped.
    """
    undo: list[Callable[[], None]] = []
    token = _fusing.set(True)
    try:
        for module in model.modules():
            # an instance-level forward (an accelerate hook, say) is left alone
            if "forward" not in vars(module) and _same_code(
                type(module).forward, modeling_llama.LlamaRMSNorm.forward
            ):
                module.forward = _norm_forward(module)
                undo.append(lambda m=module: vars(m).pop("forward", None))
        for space in _llama_rope_namespaces(model):
            original = space.apply_rotary_pos_emb
            space.apply_rotary_pos_emb = _rope_function(original)
            undo.append(lambda s=space, f=original: setattr(s, "apply_rotary_pos_emb", f))
        logger.debug("fused norm/rope kernels swapped in: %d", len(undo))
        yield len(undo)
    finally:
        for restore in reversed(undo):
            restore()
        _fusing.reset(token)
