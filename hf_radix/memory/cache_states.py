"""Cache files of a model with state layers: the state snapshots on the saved nodes (see `cache_io`).

The layout gains `state_specs` in the metadata (every state layer's kinds, shapes and dtypes: a file of
another state layout, or one without snapshots, is refused like any layout mismatch), `tree.state`
(int64 per node: the index of its snapshot, -1 for none) and `state.<layer>.<kind>` (`[snapshots,
*shape]`). A load attaches a snapshot where its node was loaded whole and a state slot is free: in the
GPU tree, else in the host tier's; the most recently used first.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import torch

from .cache_file import CacheFileError, read_checked
from .radix_node import RadixNode
from .radix_snapshots import StateSlots

if TYPE_CHECKING:
    from ..engine import RadixEngine

__all__ = ["attach_snapshots", "read_snapshots", "snapshot_tensors", "state_layout", "state_tensor_names"]

Snapshots = tuple[np.ndarray, dict[str, torch.Tensor]]  # per node: snapshot index or -1; the states


def _slots(engine: RadixEngine) -> StateSlots | None:
    return engine.manager.state_slots


def state_layout(engine: RadixEngine) -> dict[str, str]:
    """The `state_specs` layout entry ({} for a model without state layers)."""
    slots = _slots(engine)
    if slots is None:
        return {}
    specs = [
        [layer, [[k.kind, list(k.shape), str(k.dtype).removeprefix("torch.")] for k in spec.kinds]]
        for layer, spec in sorted(slots.pool.specs.items())
    ]
    return {"state_specs": json.dumps(specs)}


def state_tensor_names(engine: RadixEngine) -> list[str]:
    """The tensors a file of this engine holds besides the tree and the K/V."""
    slots = _slots(engine)
    if slots is None:
        return []
    return ["tree.state", *(f"state.{layer}.{kind}" for layer, kind in slots.pool.tensors)]


def _paths(nodes: list[RadixNode]) -> list[bytes]:
    """Each node's token path (parents before children in `nodes`), as bytes."""
    path: dict[int, bytes] = {}
    out = []
    for node in nodes:
        out.append(path.get(id(node.parent), b"") + node.key.tobytes())
        path[id(node)] = out[-1]
    return out


def snapshot_tensors(engine: RadixEngine, nodes: list[RadixNode]) -> dict[str, torch.Tensor]:
    """`tree.state` and the snapshot states of the saved `nodes` (a GPU snapshot wins over the host's)."""
    slots = _slots(engine)
    if slots is None:
        return {}
    sources: dict[bytes, tuple[int, int]] = {}  # path -> (tier: 0 GPU, 1 host; slot)
    tier = engine.host_tier
    trees = [(1, tier.tree)] if tier is not None and tier.snapshots is not None else []
    for source, tree in [*trees, (0, slots.tree)]:
        held = tree.nodes()
        for p, node in zip(_paths(held), held):
            if node.state_slot is not None:
                sources[p] = (source, node.state_slot)
    picked = [(i, sources[p]) for i, p in enumerate(_paths(nodes)) if p in sources]
    index = np.full(len(nodes), -1, dtype=np.int64)
    index[[i for i, _ in picked]] = np.arange(len(picked))
    pools = [slots.pool] + ([tier.snapshots.host.pool] if trees else [])
    states = [pools[source].state_dict([slot]) for _, (source, slot) in picked]
    out = {"tree.state": torch.from_numpy(index)}
    for layer, kind in slots.pool.tensors:
        key, t = f"{layer}.{kind}", slots.pool.tensors[(layer, kind)]
        parts = [s[key] for s in states]
        out[f"state.{key}"] = torch.cat(parts) if parts else torch.empty((0, *t.shape[1:]), dtype=t.dtype)
    return out


def read_snapshots(engine: RadixEngine, f, digests: dict[str, str], num_nodes: int, path) -> Snapshots | None:
    """Reads and checks the file's snapshots (before the engine changes); None without state layers."""
    slots = _slots(engine)
    if slots is None:
        return None
    index = read_checked(f, "tree.state", digests, path).numpy()
    states = {name[6:]: read_checked(f, name, digests, path) for name in state_tensor_names(engine)[1:]}
    count = {len(t) for t in states.values()}
    if len(index) != num_nodes or len(count) != 1 or np.any(index < -1) or np.any(index >= max(count)):
        raise CacheFileError(f"{path}: tree.state does not index the saved snapshots")
    for (layer, kind), t in slots.pool.tensors.items():
        got = states[f"{layer}.{kind}"]
        if got.shape[1:] != t.shape[1:] or got.dtype != t.dtype:
            raise CacheFileError(f"{path}: state.{layer}.{kind} is {tuple(got.shape)} {got.dtype}")
    return index, states


def attach_snapshots(engine: RadixEngine, snapshots: Snapshots | None, parent, last_access, tokens, offsets,
                     taken: list[dict[int, int]]) -> int:
    """Attaches the snapshots of the nodes loaded whole (`taken`: node -> tokens loaded, into the GPU tree
    and into the host tier's), in free state slots, most recently used first; returns how many."""
    if snapshots is None:
        return 0
    tier = engine.host_tier
    trees = [(taken[0], _slots(engine))]
    if tier is not None and tier.snapshots is not None:
        trees.append((taken[1], tier.snapshots.host))
    index, states = snapshots
    length = np.diff(offsets)
    order = sorted(np.flatnonzero(index >= 0).tolist(), key=lambda i: -last_access[i])
    attached = 0
    for loaded, slots in trees:
        whole = [i for i in order if loaded.get(i) == length[i]][: slots.pool.num_free]
        for i in reversed(whole):  # oldest first: the paths touched keep their order of recency
            chain = [i]
            while parent[chain[-1]] != -1:
                chain.append(int(parent[chain[-1]]))
            ids = np.concatenate([tokens[offsets[j] : offsets[j + 1]] for j in reversed(chain)])
            handle = slots.tree.match_kv(ids)
            if handle.cached_len != len(ids) or handle.state_slot is not None:
                continue
            slot = slots.pool.alloc(1, zero=False)[0]
            slots.pool.load_state_dict([slot], {k: v[index[i] : index[i] + 1] for k, v in states.items()})
            attached += slots.attach(handle, len(ids), slot)
        done = set(whole)
        order = [i for i in order if i not in done]
    return attached
