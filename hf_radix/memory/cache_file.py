"""The prefix-cache file format: constants, tensor digests, the model fingerprint, and streaming tensors
into and out of a safetensors file (the header written first, then each tensor as it is gathered)."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import torch

from ..model_state import CONFIG_IGNORED

__all__ = ["FORMAT", "FORMAT_VERSION", "CacheFileError", "model_fingerprint", "tensor_digest"]

FORMAT = "hf_radix.prefix_cache"
FORMAT_VERSION = 1
TREE_TENSORS = ("tree.parent", "tree.length", "tree.last_access", "tree.tokens")
DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_CHUNK = 1 << 26


class CacheFileError(ValueError):
    """A cache file that cannot be loaded into this engine: another model or layout, or a damaged file."""


# ---------------------------------------------------------------------------------------------- digests
def tensor_digest(t: torch.Tensor) -> str:
    """Order-sensitive 64-bit checksum of a tensor's bytes, in exact integer arithmetic on its device."""
    if t.numel() == 0:
        return f"{0:016x}"
    acc = torch.zeros((), dtype=torch.int64, device=t.device)
    words = t.detach().contiguous().view(-1).view(_INT_VIEW[t.element_size()])
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start : start + _DIGEST_CHUNK].to(torch.int64)
        weight = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=t.device) * 2 + 1
        acc += ((chunk + 0x9E3779B9) * weight).sum()  # wraps mod 2**64; any one-word change shows
    return f"{int(acc) & (2**64 - 1):016x}"


def model_fingerprint(model: torch.nn.Module, skip: set[int] = frozenset()) -> dict[str, str]:
    """A digest of the config entries that shape K/V and a cheap digest of ~4K sampled values per weight
    (parameters whose id is in `skip` left out: adapters that the saved prefixes did not run)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in CONFIG_IGNORED and k[:1] != "_"}
    config_digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    names, sums = [], []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in skip:
                continue
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].contiguous()
            words = sample.view(_INT_VIEW[sample.element_size()]).to(torch.int64)
            weight = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=words.device)
            names.append(f"{name}:{tuple(param.shape)}:{param.dtype}")
            sums.append(((words + 0x9E3779B9) * weight).sum())
    values = torch.stack(sums).cpu().tolist() if sums else []  # one device sync
    weights = hashlib.sha256(json.dumps([names, values]).encode()).hexdigest()
    return {"config_digest": config_digest, "weights_digest": weights}


def write_header(f, metadata: dict[str, str], specs: list[tuple[str, torch.dtype, tuple]]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise TypeError(f"cannot save a {dtype} KV pool")
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)


def host_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def stream_to_file(f, gathers: list, device: torch.device) -> None:
    """Writes each gathered tensor in turn; on CUDA the next device-to-host copy overlaps the file write."""
    if device.type != "cuda":
        for gather in gathers:
            f.write(host_bytes(gather().cpu()))
        return
    staging: list[torch.Tensor] = []
    pending = None
    for i, gather in enumerate(gathers):
        src = gather()
        if len(staging) < 2:
            staging.append(torch.empty(src.shape, dtype=src.dtype, pin_memory=True))
        buf = staging[i % 2]
        buf.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if pending is not None:
            pending[1].synchronize()
            f.write(host_bytes(pending[0]))
        pending = (buf, done)
    if pending is not None:
        pending[1].synchronize()
        f.write(host_bytes(pending[0]))


def read_digests(metadata: dict[str, str], path) -> dict[str, str]:
    try:
        digests = json.loads(metadata["digests"])
    except (KeyError, ValueError) as err:
        raise CacheFileError(f"{path}: missing or damaged tensor digests") from err
    if not isinstance(digests, dict):
        raise CacheFileError(f"{path}: damaged tensor digests")
    return digests


def read_checked(f, name: str, digests: dict[str, str], path) -> torch.Tensor:
    tensor = f.get_tensor(name)
    if tensor_digest(tensor) != digests[name]:
        raise CacheFileError(f"{path}: {name} does not match its digest (the file is corrupted)")
    return tensor


def check_tree(parent, length, last_access, tokens, page_size: int, vocab_size: int, path) -> None:
    """Raises CacheFileError unless the arrays describe a valid page-aligned prefix tree."""
    n, ps = len(parent), page_size
    if len(length) != n or len(last_access) != n or length.sum() != len(tokens):
        raise CacheFileError(f"{path}: tree arrays disagree in length")
    if n and (np.any(parent < -1) or np.any(parent >= np.arange(n))):
        raise CacheFileError(f"{path}: tree nodes are not stored parents first")
    if np.any(length <= 0) or np.any(length % ps):
        raise CacheFileError(f"{path}: a tree node's length is not a positive multiple of page_size={ps}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise CacheFileError(f"{path}: token ids outside the model's vocabulary")
    starts = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    keys = {(int(p), tokens[s : s + ps].tobytes()) for p, s in zip(parent, starts)}
    if len(keys) != n:
        raise CacheFileError(f"{path}: two children of one node start with the same page")
