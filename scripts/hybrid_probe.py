"""Measure, per hybrid family, whether continuing from a cached (or snapshotted) state is exact.

Run: PYTHONPATH=. python scripts/hybrid_probe.py [family ...]
Prints one line per family and measurement (max abs logits difference against a full forward).
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.utils import logging

from hf_radix.hybrid_layers import tiny_configs, tiny_hybrid_model

warnings.filterwarnings("ignore")
logging.set_verbosity_error()
L, P = 21, 8


def run(model, ids, cache=None, mask=None, start=0):
    """One forward of ``ids`` placed at ``start``; positions as generate computes them (mask cumsum)."""
    if mask is None:
        pos = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    else:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    if cache is None and getattr(model, "_probe_cache", False):
        cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=pos)
    if out.get("cache") is None:  # RecurrentGemma returns no cache: keep ours
        model._probe_cache = True
        return run(model, ids, cache, mask, start) if cache is None else (out.logits, cache)
    return out.logits, out.cache


def continued(model, ids, cache, chunk, mask=None):
    outs = []
    for s in range(P, ids.shape[1], chunk):
        m = None if mask is None else mask[:, : s + chunk]
        logits, cache = run(model, ids[:, s : s + chunk], cache, m, start=s)
        outs.append(logits)
    return torch.cat(outs, 1)


def restore_fresh(model, snap, zero=False):
    """A fresh cache of the class generate builds, with the snapshot's tensors copied in."""
    fresh = type(snap)() if type(snap) is not DynamicCache else DynamicCache(config=model.config)
    if hasattr(snap, "linear_cache"):
        fresh.linear_cache = [t.clone() if torch.is_tensor(t) else t for t in snap.linear_cache]
    for i, layer in enumerate(snap.layers):
        if i >= len(fresh.layers):
            fresh.layers.append(type(layer)())
        dst = fresh.layers[i]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in range(layer.number_of_states):
                conv, rec = layer.conv_states[s], layer.recurrent_states[s]
                if conv is not None:
                    dst.lazy_initialization(conv_states=conv, state_idx=s, conv_kernel_size=conv.shape[-1])
                    dst.conv_states[s].copy_(conv * (not zero))
                if rec is not None:
                    dst.lazy_initialization(recurrent_states=rec, state_idx=s)
                    dst.recurrent_states[s].copy_(rec * (not zero))
                dst.has_previous_state[s] = layer.has_previous_state[s]
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            dst.update(layer.keys.clone(), layer.values.clone())
    return fresh


def probe(name: str) -> None:
    try:
        model = tiny_hybrid_model(name)
    except Exception as e:  # noqa: BLE001
        print(f"{name:18s} CANNOT BUILD {type(e).__name__}: {str(e)[:150]}")
        return
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, L), generator=g)
    res = {}
    with torch.no_grad():
        full_nc = model(input_ids=ids[:1], use_cache=False, position_ids=torch.arange(L)[None]).logits
        full, cache = run(model, ids[:1])
        res["cache_vs_nocache"] = (full - full_nc).abs().max().item()
        try:
            for c in (1, 3, 7):
                _, cache = run(model, ids[:1, :P])
                res[f"chunk{c}"] = (continued(model, ids[:1], cache, c) - full[:, P:]).abs().max().item()
            _, cache = run(model, ids[:1, :P])
            snap = copy.deepcopy(cache)
            run(model, ids[:1, P:], cache, start=P)  # mutate the original; the snapshot must not move
            res["deepcopy_snap"] = (continued(model, ids[:1], snap, 3) - full[:, P:]).abs().max().item()
            _, cache = run(model, ids[:1, :P])
            res["fresh_restore"] = (continued(model, ids[:1], restore_fresh(model, cache), 3)
                                    - full[:, P:]).abs().max().item()
            _, cache = run(model, ids[:1, :P])
            res["zeroed_state(baseline)"] = (continued(model, ids[:1], restore_fresh(model, cache, True), 3)
                                             - full[:, P:]).abs().max().item()
            # batched rows with different states, vs each row alone
            full2 = torch.cat([run(model, ids[i:i + 1])[0] for i in range(2)])
            _, cache = run(model, ids[:, :P])
            res["batch2"] = (continued(model, ids, cache, 3) - full2[:, P:]).abs().max().item()
            # left padding: row 1 is 5 tokens shorter, padded on the left, then continued
            pad = 5
            ids_p = ids.clone()
            ids_p[1, :pad] = 0
            mask = torch.ones_like(ids)
            mask[1, :pad] = 0
            short = run(model, ids[1:, pad:])[0]
            model._probe_cache = getattr(model, "_probe_cache", False)
            lp, cache = run(model, ids_p[:, :P], mask=mask[:, :P])
            cont = continued(model, ids_p, cache, 3, mask)
            res["leftpad_prefill"] = (lp[1, pad:] - short[0, : P - pad]).abs().max().item()
            res["leftpad_cont"] = (cont[1] - short[0, P - pad:]).abs().max().item()
        except Exception as e:  # noqa: BLE001
            res["ERROR"] = f"{type(e).__name__}: {str(e)[:200]}"
        kinds = {}
        if hasattr(cache, "layers"):
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    kinds[i] = [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in
                                (layer.conv_states[0], layer.recurrent_states[0]) if t is not None]
    fmt = " ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
    print(f"{name:18s} cache={type(cache).__name__} {fmt}\n{'':18s} states={kinds}")


if __name__ == "__main__":
    for name in sys.argv[1:] or list(tiny_configs()):
        probe(name)
