"""Cache files of a model with state layers: snapshots are saved with their nodes and come back with them;
a file of another state layout (or none) is refused. The engine's manager is swapped for one with a state
pool (the engine itself does not build one yet)."""

from __future__ import annotations

import pytest
import torch
from conftest import fresh_model, random_ids
from test_hybrid_cache_manager import SPEC, _state

from hf_radix import CacheFileError, RadixBatchRunner
from hf_radix.hybrid_layers import StateKindSpec, StateLayerSpec
from hf_radix.memory.cache_io import load_cache, save_cache
from hf_radix.memory.cache_manager import CacheManager
from hf_radix.memory.host_tier import HostTier
from hf_radix.memory.state_pool import StatePool

pytestmark = pytest.mark.slow  # the memory layer's own logic: no transformers version changes it


def _engine(page_size: int, tokens: int = 256, host_tokens: int | None = None, spec=SPEC, slots: int = 8):
    runner = RadixBatchRunner(fresh_model("llama"), attn_backend="torch", max_total_tokens=tokens,
                              page_size=page_size)
    engine = runner.engine
    if spec is None:
        return engine
    old = engine.manager
    engine.manager = CacheManager(old.num_pages, page_size, device=engine.device,
                                  scratch_slot=engine.scratch_slot, state_pool=StatePool(spec, slots))
    if host_tokens:
        engine.host_tier = HostTier(engine.pool, host_tokens, state_slots=slots)
        engine.host_tier.attach(engine.manager)
    return engine


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    system = random_ids(gen, 12)
    return [system + random_ids(gen, n) for n in (5, 9, 14)] + [random_ids(gen, 10)]


def _value(ids: list[int]) -> float:
    return float(sum(ids) % 9973 + len(ids))


def _serve(manager: CacheManager, ids: list[int]) -> None:
    """One request: its state at the prompt's last page boundary snapshotted there, and at the system
    prompt's end (a branch point)."""
    handle = manager.match(ids)
    manager.lock(handle)
    row = manager.open_row(handle)
    manager.allocate([row], [len(ids)])
    ps, states = manager.page_size, manager.state_slots.pool.tensors[(3, "recurrent")]
    for upto in (12, (len(ids) - 1) // ps * ps):
        if manager.row_cached_len(row) < upto < len(ids) and upto % ps == 0:
            states[manager.row_state_slot(row)] = _value(ids[:upto])
            manager.cache_req(row, ids, upto, finished=False)
            manager.snapshot_row(row)
    manager.cache_req(row, ids, len(ids), finished=True)


def _hits(engine) -> list[tuple[int, float | None]]:
    out = []
    for ids in _prompts():
        handle = engine.manager.match(ids)
        n = handle.cached_len
        out.append((n, _state(engine.manager, handle.state_slot) if n else None))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_snapshots_round_trip_through_a_cache_file(tmp_path, page_size: int) -> None:
    engine = _engine(page_size)
    for ids in _prompts():
        _serve(engine.manager, ids)
    expected = _hits(engine)
    assert all(n > 0 and value == _value(ids[:n]) for (n, value), ids in zip(expected, _prompts()))
    save_cache(engine, tmp_path / "c.safetensors")
    fresh = _engine(page_size)
    info = load_cache(fresh, tmp_path / "c.safetensors")
    assert info["snapshots"] == len(engine.manager.tree.snapshot_slots()) > 4
    fresh.manager.check_integrity()
    assert _hits(fresh) == expected
    fresh.manager.check_integrity()


def test_snapshots_of_the_host_tier_are_saved_and_loaded_into_it(tmp_path) -> None:
    engine = _engine(1, tokens=32, host_tokens=128)
    for ids in _prompts():
        _serve(engine.manager, ids)
    assert engine.host_tier.snapshots.host.pool.num_used > 0
    save_cache(engine, tmp_path / "c.safetensors")
    expected = _hits(engine)
    fresh = _engine(1, tokens=32, host_tokens=128)
    info = load_cache(fresh, tmp_path / "c.safetensors")
    assert info["snapshots"] >= 4 and fresh.host_tier.snapshots.host.pool.num_used > 0
    fresh.manager.check_integrity()
    assert [n for n, _ in _hits(fresh)] == [n for n, _ in expected]
    fresh.manager.check_integrity()


OTHER = [StateLayerSpec(3, (StateKindSpec("conv", (2, 3), torch.float32),
                            StateKindSpec("recurrent", (2,), torch.float32)))]


@pytest.mark.parametrize(("saved", "loaded"), [(SPEC, None), (None, SPEC), (SPEC, OTHER)])
def test_a_file_of_another_state_layout_is_refused(tmp_path, saved, loaded) -> None:
    engine = _engine(1, spec=saved)
    if saved is not None:
        _serve(engine.manager, _prompts()[0])
    save_cache(engine, tmp_path / "c.safetensors")
    target = _engine(1, spec=loaded)
    with pytest.raises(CacheFileError):
        load_cache(target, tmp_path / "c.safetensors")
    assert target.manager.tree.size_info.total_size == 0
    target.manager.check_integrity()
