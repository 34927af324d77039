"""Warm starts: save the prefix cache (tree + the K/V of its pages) to a safetensors file and load it back.

File layout (safetensors; no pickle): `tree.parent`, `tree.length`, `tree.last_access` (int64, one entry
per node, parents before children), `tree.tokens` (int64, every node's token ids in node order), then per
layer `k.{i}` / `v.{i}` (`[tokens, kv_heads, head_dim]`, the pool dtype, same token order) so that save
and load stream one layer at a time. The metadata holds the format version, page size, dtype and head
layout, a model fingerprint (config digest + a digest of sampled weights) and a digest of every tensor:
a file from another model, dtype, page size or head layout, or a truncated or corrupted one, is refused
before the engine changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from transformers.utils import logging

from .placement import require_one_device
from .radix_tree import RadixNode, RadixPrefixCache

if TYPE_CHECKING:
    from .engine import RadixEngine

logger = logging.get_logger(__name__)

__all__ = ["FORMAT_VERSION", "CacheFileError", "load_cache", "model_fingerprint", "save_cache"]

FORMAT = "hf_radix.prefix_cache"
FORMAT_VERSION = 1
TREE_TENSORS = ("tree.parent", "tree.length", "tree.last_access", "tree.tokens")
_DTYPES = {
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
# Config entries that do not change what K/V a prompt produces.
_CONFIG_IGNORED = {
    "_name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "pad_token_id",
    "eos_token_id",
    "bos_token_id",
    "problem_type",
    "chunk_size_feed_forward",
    "architectures",
}


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


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """A digest of the config entries that shape K/V and a cheap digest of ~4K sampled values per weight."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_IGNORED and k[:1] != "_"}
    config_digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    names, sums = [], []
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].contiguous()
            words = sample.view(_INT_VIEW[sample.element_size()]).to(torch.int64)
            weight = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=words.device)
            names.append(f"{name}:{tuple(param.shape)}:{param.dtype}")
            sums.append(((words + 0x9E3779B9) * weight).sum())
    values = torch.stack(sums).cpu().tolist() if sums else []  # one device sync
    weights = hashlib.sha256(json.dumps([names, values]).encode()).hexdigest()
    return {"config_digest": config_digest, "weights_digest": weights}


# ------------------------------------------------------------------------------------------------- save
def _layout(engine: RadixEngine) -> dict[str, str]:
    shape = engine.pool.shape
    return {
        "page_size": str(engine.page_size),
        "dtype": str(engine.pool.dtype).removeprefix("torch."),
        "num_layers": str(shape.num_layers),
        "num_kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
    }


def _check_idle(engine: RadixEngine, action: str) -> None:
    if engine.manager.num_rows:
        raise RuntimeError(
            f"cannot {action} the prefix cache while {engine.manager.num_rows} requests are running"
        )


def _check_one_pool(engine: RadixEngine, action: str) -> None:
    """Cache files hold one pool's K/V: refused for a pool over several devices or a tensor-parallel shard."""
    require_one_device(engine.pool, f"{action} of the prefix cache (cache files)")
    if engine.tp_group is not None:
        raise NotImplementedError(
            f"hf_radix: {action} of the prefix cache (cache files) is not supported under tensor parallel "
            "(each rank's pool holds only its own KV heads)"
        )


def save_cache(engine: RadixEngine, path: str | os.PathLike) -> dict:
    """Writes the engine's prefix tree and the K/V of its pages to `path`; refused while requests run.

    Returns {"tokens", "bytes", "seconds", "gb_per_s"} (K/V bytes written per second).
    """
    _check_idle(engine, "save")
    _check_one_pool(engine, "save")
    start = time.perf_counter()
    nodes, last_access, host_base = _tree_to_save(engine)
    index = {id(node): i for i, node in enumerate(nodes)}
    parent = np.array([index.get(id(n.parent), -1) for n in nodes], dtype=np.int64)
    length = np.array([len(n.key) for n in nodes], dtype=np.int64)
    tokens = np.concatenate([n.key for n in nodes]) if nodes else np.empty(0, np.int64)
    slots = np.concatenate([n.value for n in nodes]) if nodes else np.empty(0, np.int64)
    pool = engine.pool
    tree = {
        "tree.parent": parent,
        "tree.length": length,
        "tree.last_access": last_access,
        "tree.tokens": tokens,
    }
    tensors: dict[str, torch.Tensor | None] = {k: torch.from_numpy(v) for k, v in tree.items()}
    read_kv = _SavedKV(engine, slots, host_base)
    gathers = {}
    for layer in range(pool.shape.num_layers):
        for kind in "kv":
            gathers[f"{kind}.{layer}"] = lambda kind=kind, layer=layer: read_kv(kind, layer)
    dims = {"k": pool.shape.head_dim, "v": pool.shape.value_dim}
    digests = {name: tensor_digest(t) for name, t in tensors.items()}
    digests.update({name: tensor_digest(gather()) for name, gather in gathers.items()})
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        **_layout(engine),
        **model_fingerprint(engine.model),
        "model_class": type(engine.model).__name__,
        "num_tokens": str(len(slots)),
        "num_nodes": str(len(nodes)),
        "digests": json.dumps(digests),
    }
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    specs += [(name, pool.dtype, (len(slots), pool.shape.num_kv_heads, dims[name[0]])) for name in gathers]
    tmp = Path(f"{os.fspath(path)}.tmp")
    with open(tmp, "wb") as f:
        _write_header(f, metadata, specs)
        for t in tensors.values():
            f.write(_host_bytes(t))
        _stream_to_file(f, [gathers[name] for name in gathers], engine.device)
    os.replace(tmp, path)
    kv_bytes = len(slots) * pool.shape.bytes_per_token(pool.dtype)
    seconds = time.perf_counter() - start
    logger.info("saved %d cached tokens (%.2f GB) to %s in %.2fs", len(slots), kv_bytes / 1e9, path, seconds)
    return {"tokens": len(slots), "bytes": kv_bytes, "seconds": seconds, "gb_per_s": kv_bytes / 1e9 / seconds}


def _tree_to_save(engine: RadixEngine) -> tuple[list[RadixNode], np.ndarray, int | None]:
    """The nodes to save (parents first), their recency, and where host-tier slots start in their values.

    Without a host tier (or with an empty one) this is the GPU tree, slots as they are. With one, it is a
    merged tree of both tiers: the GPU tree's paths first (so where both hold a prefix, the GPU copy is
    the one saved), then the host tree's; a value `host_base + h` stands for host slot `h`. Recency keeps
    each tier's order, with every host-only prefix older than every GPU-resident one.
    """
    manager, tier = engine.manager, engine.host_tier
    if tier is None or not tier.tree.size_info.total_size:
        nodes = manager.tree.nodes()
        return nodes, np.array([n.last_access for n in nodes], dtype=np.int64), None
    host_base = (manager.num_pages + 1) * manager.page_size  # past the scratch page
    host_access, host_top = _slot_access(tier.tree, tier.num_pages * tier.page_size)
    gpu_access, _ = _slot_access(manager.tree, host_base)
    merged = RadixPrefixCache(manager.page_size)
    for source, shift in ((manager.tree, 0), (tier.tree, host_base)):
        for node in source.nodes():
            if not node.children:
                path, values = _path(node)
                merged.insert_prefix(path, values + shift)
    nodes = merged.nodes()
    last = np.array([n.value[-1] for n in nodes], dtype=np.int64)
    on_host = last >= host_base
    last_access = np.where(on_host, host_access[np.where(on_host, last - host_base, 0)],
                           gpu_access[np.where(on_host, 0, last)] + host_top + 1)
    index = {id(node): i for i, node in enumerate(nodes)}
    for i in range(len(nodes) - 1, -1, -1):  # children after parents: a parent is at least as recent
        parent = index.get(id(nodes[i].parent))
        if parent is not None:
            last_access[parent] = max(last_access[parent], last_access[i])
    return nodes, last_access, host_base


def _slot_access(tree: RadixPrefixCache, num_slots: int) -> tuple[np.ndarray, int]:
    """The last access of the node holding each slot (0 where none does), and the largest of them."""
    access = np.zeros(num_slots, dtype=np.int64)
    for node in tree.nodes():
        access[node.value] = node.last_access
    return access, int(access.max(initial=0))


def _path(node: RadixNode) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and slots from the root down to `node`."""
    keys, values = [], []
    while node.parent is not None:
        keys.append(node.key)
        values.append(node.value)
        node = node.parent
    return np.concatenate(keys[::-1]), np.concatenate(values[::-1])


class _SavedKV:
    """One layer's K or V of the saved slots, on the pool's device: GPU slots from the pool, the others
    (values from `host_base` on) from the host tier's buffers, once its copies in flight have landed."""

    def __init__(self, engine: RadixEngine, slots: np.ndarray, host_base: int | None):
        self.pool, self.tier, device = engine.pool, engine.host_tier, engine.device
        on_host = slots >= host_base if host_base is not None else np.zeros(len(slots), dtype=bool)
        self.count = len(slots)
        self.gpu_at = torch.as_tensor(np.flatnonzero(~on_host), device=device)
        self.gpu_slots = torch.as_tensor(slots[~on_host], device=device)
        self.host_at = torch.as_tensor(np.flatnonzero(on_host), device=device)
        host = slots[on_host] - (host_base or 0)
        if len(host):
            self.tier.wait_for_copies()
        ps = engine.page_size
        self.host_pages, self.host_rows = torch.from_numpy(host // ps), torch.from_numpy(host % ps)

    def __call__(self, kind: str, layer: int) -> torch.Tensor:
        cache = self.pool.k_cache(layer) if kind == "k" else self.pool.v_cache(layer)
        if not len(self.host_at):
            return cache.index_select(0, self.gpu_slots)
        out = torch.empty((self.count, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        out[self.gpu_at] = cache.index_select(0, self.gpu_slots)
        host = (self.tier.keys if kind == "k" else self.tier.values)[self.host_pages, layer, self.host_rows]
        out[self.host_at] = host.to(cache.device)
        return out


def _write_header(f, metadata: dict[str, str], specs: list[tuple[str, torch.dtype, tuple]]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise TypeError(f"cannot save a {dtype} KV pool")
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)


def _host_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _stream_to_file(f, gathers: list, device: torch.device) -> None:
    """Writes each gathered tensor in turn; on CUDA the next device-to-host copy overlaps the file write."""
    if device.type != "cuda":
        for gather in gathers:
            f.write(_host_bytes(gather().cpu()))
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
            f.write(_host_bytes(pending[0]))
        pending = (buf, done)
    if pending is not None:
        pending[1].synchronize()
        f.write(_host_bytes(pending[0]))


# ------------------------------------------------------------------------------------------------- load
def load_cache(engine: RadixEngine, path: str | os.PathLike) -> dict:
    """Adds the prefixes saved in `path` to the engine's tree, most recently used first, in free pages.

    Everything (format, model fingerprint, layout, tree structure, every tensor's digest) is checked
    before the tree changes; on any error the engine is left as it was. Prefixes that do not fit in the
    free pages are skipped (least recently used first). Returns {"tokens" (loaded), "saved_tokens",
    "bytes", "seconds", "gb_per_s"}.
    """
    _check_idle(engine, "load")
    _check_one_pool(engine, "load")
    start = time.perf_counter()
    try:
        f = safe_open(os.fspath(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise CacheFileError(
            f"{path} is not a readable hf_radix cache file (truncated or corrupted?): {err}"
        ) from err
    with f:
        metadata = f.metadata() or {}
        _check_metadata(engine, metadata, path)
        digests = _digests(metadata, path)
        kv_names = [f"{kind}.{layer}" for layer in range(engine.pool.shape.num_layers) for kind in "kv"]
        if set(f.keys()) != {*TREE_TENSORS, *kv_names} or set(digests) != set(f.keys()):
            raise CacheFileError(
                f"{path}: unexpected tensors {sorted(set(f.keys()) ^ {*TREE_TENSORS, *kv_names})}"
            )
        tree = {name: _read_checked(f, name, digests, path) for name in TREE_TENSORS}
        parent, length, last_access, tokens = (tree[n].numpy() for n in TREE_TENSORS)
        _check_tree(engine, parent, length, last_access, tokens, path)
        dims = {"k": engine.pool.shape.head_dim, "v": engine.pool.shape.value_dim}
        for name in kv_names:
            kv_shape = [len(tokens), engine.pool.shape.num_kv_heads, dims[name[0]]]
            info = f.get_slice(name)
            if info.get_shape() != kv_shape or info.get_dtype() != _DTYPES[engine.pool.dtype]:
                raise CacheFileError(
                    f"{path}: {name} has shape {info.get_shape()} / {info.get_dtype()}, "
                    f"expected {kv_shape} / {_DTYPES[engine.pool.dtype]}"
                )
        taken = _select_mru(
            parent, length, last_access, engine.manager.num_free_pages * engine.page_size, engine.page_size
        )
        offsets = np.concatenate([[0], np.cumsum(length)])
        file_index = np.concatenate(
            [np.arange(offsets[i], offsets[i] + n) for i, n in taken.items()] or [np.empty(0, np.int64)]
        )
        pages = engine.manager.take_pages(len(file_index) // engine.page_size)
        staged = (pages[:, None] + np.arange(engine.page_size)).reshape(-1)
        try:
            _stream_from_file(engine, f, kv_names, digests, file_index, staged, path)
        except BaseException:
            engine.manager.release_pages(staged)
            raise
    _commit(engine, parent, last_access, tokens, offsets, taken, staged)
    kv_bytes = len(tokens) * engine.pool.shape.bytes_per_token(engine.pool.dtype)
    seconds = time.perf_counter() - start
    logger.info("loaded %d of %d cached tokens from %s in %.2fs", len(staged), len(tokens), path, seconds)
    return {
        "tokens": len(staged),
        "saved_tokens": len(tokens),
        "bytes": kv_bytes,
        "seconds": seconds,
        "gb_per_s": kv_bytes / 1e9 / seconds,
    }


def _check_metadata(engine: RadixEngine, metadata: dict[str, str], path) -> None:
    if metadata.get("format") != FORMAT:
        raise CacheFileError(f"{path} is not an hf_radix prefix-cache file")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise CacheFileError(
            f"{path} has format version {metadata.get('format_version')}; this hf_radix reads "
            f"version {FORMAT_VERSION}"
        )
    for key, ours in _layout(engine).items():
        if metadata.get(key) != ours:
            raise CacheFileError(
                f"{path} was saved with {key}={metadata.get(key)}; this engine has {key}={ours}"
            )
    fingerprint = model_fingerprint(engine.model)
    if metadata.get("config_digest") != fingerprint["config_digest"]:
        raise CacheFileError(
            f"{path} was saved from another model configuration "
            f"({metadata.get('model_class')}); refusing to load it into {type(engine.model).__name__}"
        )
    if metadata.get("weights_digest") != fingerprint["weights_digest"]:
        raise CacheFileError(f"{path} was saved from a model with other weights (same configuration)")


def _digests(metadata: dict[str, str], path) -> dict[str, str]:
    try:
        digests = json.loads(metadata["digests"])
    except (KeyError, ValueError) as err:
        raise CacheFileError(f"{path}: missing or damaged tensor digests") from err
    if not isinstance(digests, dict):
        raise CacheFileError(f"{path}: damaged tensor digests")
    return digests


def _read_checked(f, name: str, digests: dict[str, str], path) -> torch.Tensor:
    tensor = f.get_tensor(name)
    if tensor_digest(tensor) != digests[name]:
        raise CacheFileError(f"{path}: {name} does not match its digest (the file is corrupted)")
    return tensor


def _check_tree(engine: RadixEngine, parent, length, last_access, tokens, path) -> None:
    """Raises CacheFileError unless the arrays describe a valid page-aligned prefix tree."""
    n, ps = len(parent), engine.page_size
    if len(length) != n or len(last_access) != n or length.sum() != len(tokens):
        raise CacheFileError(f"{path}: tree arrays disagree in length")
    if n and (np.any(parent < -1) or np.any(parent >= np.arange(n))):
        raise CacheFileError(f"{path}: tree nodes are not stored parents first")
    if np.any(length <= 0) or np.any(length % ps):
        raise CacheFileError(f"{path}: a tree node's length is not a positive multiple of page_size={ps}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= engine.vocab_size):
        raise CacheFileError(f"{path}: token ids outside the model's vocabulary")
    starts = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    keys = {(int(p), tokens[s : s + ps].tobytes()) for p, s in zip(parent, starts)}
    if len(keys) != n:
        raise CacheFileError(f"{path}: two children of one node start with the same page")


def _select_mru(parent, length, last_access, budget: int, page_size: int) -> dict[int, int]:
    """Node -> tokens to load: most recently used first, parents before children, within `budget` tokens.

    The first node that does not fit whole is cut to the pages left; loading stops there.
    """
    taken: dict[int, int] = {}
    for i in np.lexsort((np.arange(len(parent)), -last_access)):
        i = int(i)
        if parent[i] != -1 and taken.get(int(parent[i])) != length[parent[i]]:
            continue  # its parent is not (fully) loaded
        n = min(int(length[i]), budget - budget % page_size)
        if n <= 0:
            break
        taken[i] = n
        budget -= n
        if n < length[i]:
            break
    return dict(sorted(taken.items()))


def _stream_from_file(engine: RadixEngine, f, names: list[str], digests, file_index, staged, path) -> None:
    """Reads each layer's K or V (prefetching the next), checks its digest and writes the selected tokens."""
    pool, device = engine.pool, engine.device
    src = torch.as_tensor(file_index, device=device)
    dst = torch.as_tensor(staged, device=device)
    with ThreadPoolExecutor(1) as reader:
        ahead = reader.submit(f.get_tensor, names[0])
        for i, name in enumerate(names):
            host = ahead.result()
            if i + 1 < len(names):
                ahead = reader.submit(f.get_tensor, names[i + 1])
            tensor = host.to(device)
            if tensor_digest(tensor) != digests[name]:
                raise CacheFileError(f"{path}: {name} does not match its digest (the file is corrupted)")
            kind, layer = name.split(".")
            cache = pool.k_cache(int(layer)) if kind == "k" else pool.v_cache(int(layer))
            cache.index_copy_(0, dst, tensor.index_select(0, src) if len(src) != len(tensor) else tensor)


def _commit(engine: RadixEngine, parent, last_access, tokens, offsets, taken: dict[int, int], staged) -> None:
    """Inserts the loaded paths (oldest leaf first, so recency survives) and frees pages the tree had."""
    manager = engine.manager
    slot_of, cursor = {}, 0
    for i, n in taken.items():
        slot_of[i] = staged[cursor : cursor + n]
        cursor += n
    has_child = {int(parent[i]) for i in taken if parent[i] != -1}
    leaves = sorted((i for i in taken if i not in has_child), key=lambda i: last_access[i])
    for leaf in leaves:
        chain = [leaf]
        while parent[chain[-1]] != -1:
            chain.append(int(parent[chain[-1]]))
        chain.reverse()
        ids = np.concatenate([tokens[offsets[i] : offsets[i] + taken[i]] for i in chain])
        manager.tree.insert_prefix(ids, np.concatenate([slot_of[i] for i in chain]))
    unused = staged[~np.isin(staged, manager.tree.slot_indices())]
    manager.release_pages(unused)
