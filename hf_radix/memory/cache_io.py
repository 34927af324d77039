"""Warm starts: save the prefix cache (tree + the K/V of its pages) to a safetensors file and load it back.

File layout (safetensors; no pickle; see `cache_file`): `tree.parent`, `tree.length`, `tree.last_access`
(int64, one entry per node, parents before children), `tree.tokens` (int64, every node's token ids in node
order), then per layer `k.{i}` / `v.{i}` (`[tokens, kv_heads, head_dim]`, the pool dtype, same token
order), streamed one layer at a time. The metadata holds the format version, page size, dtype, head layout,
the adapter set (namespace) the prefixes were computed with, a model fingerprint (config digest + a digest
of sampled weights) and a digest of every tensor: a file from another model, weights, adapter set, dtype or
layout, or a damaged one, is refused before the engine changes. Models with state layers add the state
snapshots on the nodes and their layout (`cache_states`). A save holds the active adapter set's
prefixes of both tiers; a load fills the GPU pool and the host tier with the most recent ones that fit.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from transformers.utils import logging

from .cache_file import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    TREE_TENSORS,
    CacheFileError,
    check_tree,
    host_bytes,
    model_fingerprint,
    read_checked,
    read_digests,
    stream_to_file,
    tensor_digest,
    write_header,
)
from .cache_states import attach_snapshots, read_snapshots, snapshot_tensors, state_layout, state_tensor_names
from .placement import require_one_device
from .radix_tree import RadixNode, RadixPrefixCache

if TYPE_CHECKING:
    from ..engine import RadixEngine

logger = logging.get_logger(__name__)

__all__ = ["FORMAT_VERSION", "CacheFileError", "load_cache", "model_fingerprint", "save_cache"]

# ------------------------------------------------------------------------------------------------- save
def _layout(engine: RadixEngine) -> dict[str, str]:
    shape = engine.pool.shape
    return {
        "page_size": str(engine.page_size),
        "dtype": str(engine.pool.dtype).removeprefix("torch."),
        "num_layers": str(shape.num_layers),
        "num_kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
        "namespace": engine.state.namespace_label(),  # the adapter set the prefixes were computed with
        **state_layout(engine),  # models with state layers: their snapshots' layout
    }


def _prepare(engine: RadixEngine, action: str) -> None:
    """Refused while requests run, or for a pool over several devices or a tensor-parallel shard (files
    hold one pool's K/V); then the cache follows the model (never K/V of other weights; the active
    adapter set's prefixes)."""
    if rows := engine.manager.num_rows:
        raise RuntimeError(f"cannot {action} the prefix cache while {rows} requests are running")
    require_one_device(engine.pool, f"{action} of the prefix cache (cache files)")
    if engine.tp_group is not None:
        raise NotImplementedError(
            f"hf_radix: {action} of the prefix cache (cache files) is not supported under tensor parallel "
            "(each rank's pool holds only its own KV heads)"
        )
    engine.sync_model_state()


def save_cache(engine: RadixEngine, path: str | os.PathLike) -> dict:
    """Writes the engine's prefix tree (both tiers') and the K/V of its pages to `path`; refused while
    requests run.

    Returns {"tokens", "bytes", "seconds", "gb_per_s"} (K/V bytes written per second).
    """
    _prepare(engine, "save")
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
    tensors.update(snapshot_tensors(engine, nodes))
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
        **model_fingerprint(engine.model, engine.state.inactive_adapter_tensors()),
        "model_class": type(engine.model).__name__,
        "num_tokens": str(len(slots)),
        "num_nodes": str(len(nodes)),
        "digests": json.dumps(digests),
    }
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    specs += [(name, pool.dtype, (len(slots), pool.shape.num_kv_heads, dims[name[0]])) for name in gathers]
    tmp = Path(f"{os.fspath(path)}.tmp")
    with open(tmp, "wb") as f:
        write_header(f, metadata, specs)
        for t in tensors.values():
            f.write(host_bytes(t))
        stream_to_file(f, [gathers[name] for name in gathers], engine.device)
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
            if not node.children or node.state_slot is not None:  # a node boundary at every snapshot
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


# ------------------------------------------------------------------------------------------------- load
def load_cache(engine: RadixEngine, path: str | os.PathLike) -> dict:
    """Adds the prefixes saved in `path` to the engine's tree, most recently used first, in free pages.

    Everything (format, model fingerprint, layout, tree structure, every tensor's digest) is checked
    before the tree changes; on any error the engine is left as it was. Prefixes that do not fit in the
    free pages are skipped (least recently used first). A host tier, too, takes the most recently used
    whole paths that fit in its free host pages. Returns {"tokens" (loaded into the pool), "host_tokens"
    (into the host tier), "saved_tokens", "snapshots" (state snapshots attached: models with state
    layers), "bytes", "seconds", "gb_per_s"}.
    """
    _prepare(engine, "load")
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
        digests = read_digests(metadata, path)
        kv_names = [f"{kind}.{layer}" for layer in range(engine.pool.shape.num_layers) for kind in "kv"]
        expected = {*TREE_TENSORS, *kv_names, *state_tensor_names(engine)}
        if set(f.keys()) != expected or set(digests) != set(f.keys()):
            raise CacheFileError(f"{path}: unexpected tensors {sorted(set(f.keys()) ^ expected)}")
        tree = {name: read_checked(f, name, digests, path) for name in TREE_TENSORS}
        parent, length, last_access, tokens = (tree[n].numpy() for n in TREE_TENSORS)
        check_tree(parent, length, last_access, tokens, engine.page_size, engine.vocab_size, path)
        snapshots = read_snapshots(engine, f, digests, len(parent), path)
        dims = {"k": engine.pool.shape.head_dim, "v": engine.pool.shape.value_dim}
        for name in kv_names:
            kv_shape = [len(tokens), engine.pool.shape.num_kv_heads, dims[name[0]]]
            info = f.get_slice(name)
            if info.get_shape() != kv_shape or info.get_dtype() != DTYPES[engine.pool.dtype]:
                raise CacheFileError(
                    f"{path}: {name} has shape {info.get_shape()} / {info.get_dtype()}, "
                    f"expected {kv_shape} / {DTYPES[engine.pool.dtype]}"
                )
        ps, manager, tier = engine.page_size, engine.manager, engine.host_tier
        offsets = np.concatenate([[0], np.cumsum(length)])
        taken = _select_mru(parent, length, last_access, manager.num_free_pages * ps, ps)
        file_index = _file_index(offsets, taken)
        pages = manager.take_pages(len(file_index) // ps)
        staged = (pages[:, None] + np.arange(ps)).reshape(-1)
        host_taken: dict[int, int] = {}  # the host tier keeps whole paths, as on eviction
        host_index = host_staged = np.empty(0, np.int64)
        if tier is not None:
            host_taken = _select_mru(parent, length, last_access, tier.num_free_pages * ps, ps)
            host_index = _file_index(offsets, host_taken)
            host_staged = tier.take_free_pages(len(host_index) // ps)
        try:
            gpu, host = (file_index, staged), (host_index, host_staged)
            _stream_from_file(engine, f, kv_names, digests, gpu, host, path)
        except BaseException:
            manager.release_pages(staged)
            if tier is not None:
                tier.release_pages(host_staged)
            raise
    manager.release_pages(_insert(manager.tree, parent, last_access, tokens, offsets, taken, staged))
    if tier is not None:
        tier.release_pages(_insert(tier.tree, parent, last_access, tokens, offsets, host_taken, host_staged))
    attached = attach_snapshots(engine, snapshots, parent, last_access, tokens, offsets, [taken, host_taken])
    kv_bytes = len(tokens) * engine.pool.shape.bytes_per_token(engine.pool.dtype)
    seconds = time.perf_counter() - start
    logger.info("loaded %d of %d cached tokens from %s in %.2fs (%d into the host tier)", len(staged),
                len(tokens), path, seconds, len(host_staged))
    return {
        "tokens": len(staged),
        "host_tokens": len(host_staged),
        "saved_tokens": len(tokens),
        "snapshots": attached,
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
    metadata = {"namespace": "base model", **metadata}  # files from before adapter namespaces
    for key, ours in _layout(engine).items():
        if metadata.get(key) != ours:
            raise CacheFileError(
                f"{path} was saved with {key}={metadata.get(key)}; this engine has {key}={ours}"
            )
    fingerprint = model_fingerprint(engine.model, engine.state.inactive_adapter_tensors())
    if metadata.get("config_digest") != fingerprint["config_digest"]:
        raise CacheFileError(
            f"{path} was saved from another model configuration "
            f"({metadata.get('model_class')}); refusing to load it into {type(engine.model).__name__}"
        )
    if metadata.get("weights_digest") != fingerprint["weights_digest"]:
        raise CacheFileError(f"{path} was saved from a model with other weights (same configuration)")


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


def _file_index(offsets: np.ndarray, taken: dict[int, int]) -> np.ndarray:
    """Positions in the file's token order of the tokens `taken` selects, node by node."""
    parts = [np.arange(offsets[i], offsets[i] + n) for i, n in taken.items()]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def _stream_from_file(engine: RadixEngine, f, names: list[str], digests, gpu, host, path) -> None:
    """Reads each layer's K or V (prefetching the next), checks its digest and writes the selected tokens:
    `gpu` = (file positions, pool slots), `host` = (file positions, host-tier slots)."""
    pool, device, tier, ps = engine.pool, engine.device, engine.host_tier, engine.page_size
    src, dst = (torch.as_tensor(a, device=device) for a in gpu)
    host_src = torch.from_numpy(host[0])
    host_pages, host_rows = torch.from_numpy(host[1] // ps), torch.from_numpy(host[1] % ps)
    with ThreadPoolExecutor(1) as reader:
        ahead = reader.submit(f.get_tensor, names[0])
        for i, name in enumerate(names):
            read = ahead.result()
            if i + 1 < len(names):
                ahead = reader.submit(f.get_tensor, names[i + 1])
            tensor = read.to(device)
            if tensor_digest(tensor) != digests[name]:
                raise CacheFileError(f"{path}: {name} does not match its digest (the file is corrupted)")
            kind, layer = name.split(".")
            cache = pool.k_cache(int(layer)) if kind == "k" else pool.v_cache(int(layer))
            cache.index_copy_(0, dst, tensor.index_select(0, src) if len(src) != len(tensor) else tensor)
            if len(host_src):
                side = tier.keys if kind == "k" else tier.values
                side[host_pages, int(layer), host_rows] = read[host_src]


def _insert(tree: RadixPrefixCache, parent, last_access, tokens, offsets, taken: dict[int, int], staged):
    """Inserts the loaded paths into `tree` (oldest leaf first, so recency survives); returns the slots of
    `staged` it did not take (the tree held those tokens already)."""
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
        tree.insert_prefix(ids, np.concatenate([slot_of[i] for i in chain]))
    return staged[~np.isin(staged, tree.slot_indices())]
