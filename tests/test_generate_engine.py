"""What a radix `generate` call does to its engine: graphs per batch size, page-table writes, warm-up,
graph memory kept out of the pool, and graphs released with the pool they point into."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import fresh_model, random_ids

import hf_radix
from hf_radix.forward.cuda_graph import DecodeGraphs, ExtendGraphs
from hf_radix.forward.graph_shapes import static_buffer_bytes
from hf_radix.forward.model_runner import GRAPH_MEMORY_MARGIN, ModelRunner, graph_memory_bytes
from hf_radix.memory import kv_pool
from hf_radix.memory.page_table import PageTable
from hf_radix.paged_attention.forward_batch import StepRows
from hf_radix.paged_attention.shared_decode import MAX_PREFIX_SPLITS

PAD = 0


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(77)


def _model(max_total_tokens: int = 2048, **options):
    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=max_total_tokens, attn_backend="torch", **options)
    return model


def _generate(model, prompts: list[list[int]], radix: bool, **kwargs):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {"cache_implementation": "radix"} if radix else {}
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **extra, **kwargs)


def _both(model, prompts: list[list[int]], **kwargs):
    ref = _generate(model, prompts, False, **kwargs)
    got = _generate(model, prompts, True, **kwargs)
    got_seq = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(got_seq, ref if isinstance(ref, torch.Tensor) else ref.sequences)
    return got


def _graphs(engine, max_batch: int = 4) -> ModelRunner:
    """The engine's core with graph runners (padded batches run eagerly on the CPU)."""
    core = engine.model_runner
    core.decode_graphs = DecodeGraphs(engine, max_batch=max_batch)
    core.extend_graphs = ExtendGraphs(engine, max_rows=4, max_tokens=32)
    return core


def test_a_generate_batch_of_64_rows_decodes_from_graphs(gen):
    model = _model()
    engine = hf_radix.get_engine(model)
    core = _graphs(engine, max_batch=engine.options.cuda_graph_max_batch)
    prompts = [random_ids(gen, 5 + i % 9) for i in range(64)]
    _both(model, prompts, max_new_tokens=4, eos_token_id=None)
    assert core.decode_graphs.replays == 3  # every decode step of the 64-row batch
    engine.check_integrity()
    assert engine.manager.num_rows == 0


def test_decode_steps_write_the_page_table_once_per_16_steps(monkeypatch, gen):
    model = _model()
    engine = hf_radix.get_engine(model)
    _graphs(engine)
    writes = []
    write = PageTable.write
    monkeypatch.setattr(PageTable, "write", lambda self, *a: (writes.append(len(a[2])), write(self, *a))[1])
    writes.clear()
    _both(model, [random_ids(gen, 9), random_ids(gen, 6)], max_new_tokens=40, eos_token_id=None)
    # the prompts with room for 16 more tokens, then 16 more at steps 17 and 34 (39 steps after the prompts)
    assert [w for w in writes if w] == [9 + 16 + 6 + 16, 2 * 17, 2 * 6]
    assert sum(writes) == (9 + 39) + (6 + 39)  # never past what the call can use
    engine.check_integrity()
    assert engine.manager.num_rows == 0 and engine.manager.num_free_pages + engine.stats_dict()[
        "tree_tokens"] == engine.pool_tokens


def test_first_radix_generate_warms_the_engine_up_once(monkeypatch, gen):
    calls = []
    monkeypatch.setattr(ModelRunner, "captures", property(lambda self: self.decode_graphs is not None))
    warm_up = ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: (calls.append(self), warm_up(self))[1])
    model = _model()
    core = _graphs(hf_radix.get_engine(model))
    prompt = random_ids(gen, 12)
    _both(model, [prompt], max_new_tokens=3)
    assert calls == [core] and set(core.warm_up_times) == {"eager_s", "capture_s"}
    _both(model, [prompt, random_ids(gen, 5)], max_new_tokens=3)
    assert calls == [core]  # once per engine
    lazy = _model(warm_up=False)
    _graphs(hf_radix.get_engine(lazy))
    _both(lazy, [prompt], max_new_tokens=2)
    assert calls == [core]
    hf_radix.get_engine(model).check_integrity()


def test_a_new_pool_releases_the_old_engines_graphs(gen):
    model = _model(max_total_tokens=512)
    engine = hf_radix.get_engine(model)
    core = _graphs(engine)
    prompt = random_ids(gen, 10)
    kept = _both(model, [prompt], max_new_tokens=3, return_dict_in_generate=True)  # holds its finished cache
    assert core.decode_graphs.replays == 2 and core.extend_graphs.replays == 1
    graphs = [weakref.ref(core.decode_graphs), weakref.ref(core.extend_graphs)]
    step = StepRows.of([0], [0], [[5]])
    new_engine = hf_radix.configure(model, max_total_tokens=1024)
    assert engine.closed and new_engine is not engine
    gc.collect()
    assert [g() for g in graphs] == [None, None] and core.released  # freed though `core` is still held
    with pytest.raises(RuntimeError, match="released"):
        core.forward(step)  # nothing replays into the freed pool
    old_core = weakref.ref(core)
    del core
    gc.collect()
    assert old_core() is None  # the returned cache does not keep the old core alive
    new_core = _graphs(new_engine)
    _both(model, [prompt], max_new_tokens=3)
    assert new_core.decode_graphs.replays == 2 and kept.past_key_values.finished
    # backend options rebuild the core: its graphs go at once too
    held = weakref.ref(new_core.decode_graphs)
    hf_radix.configure(model, fused_ops=False)
    gc.collect()
    assert held() is None and new_core.released and hf_radix.get_engine(model) is new_engine
    _both(model, [prompt], max_new_tokens=3)
    new_engine.check_integrity()


def test_graph_memory_estimate_counts_static_buffers_and_the_largest_forward():
    model = fresh_model("llama")
    text = model.config
    static = static_buffer_bytes(256, 256, 1024) + static_buffer_bytes(8, 256, 1024)
    # ids, positions, out_loc per token, a logits index per row (int64), three int32 row arrays, each array
    # padded to 16 bytes in one block, with room behind them for the rest of an upload; the slot list (int64,
    # rows x kv_bound)
    assert static_buffer_bytes(3, 5, 7) == 8 * (3 * 6 + 4 + 4 * (3 + 5) + 256 + 4 * 7) + 4 * (8 + 4 + 8)
    estimate = graph_memory_bytes(model, torch.bfloat16, 256, 1024)
    per_token = 2 * (4 * text.hidden_size + 3 * text.intermediate_size + (4 + 2 * 2) * 16)
    shared_partials = 256 * 4 * MAX_PREFIX_SPLITS * (16 + 1) * 4  # fp32 output + lse per query head and split
    activations = 256 * per_token + 256 * text.vocab_size * 6 + shared_partials
    assert estimate == static + 2 * activations + GRAPH_MEMORY_MARGIN
    assert graph_memory_bytes(model, torch.bfloat16, 64, 1024) < estimate
    pieces = graph_memory_bytes(model, torch.bfloat16, 256, 1024, piece=128)  # deterministic: acc, l, m
    assert pieces == estimate + 2 * 256 * 4 * (8 * (16 + 2) - MAX_PREFIX_SPLITS * (16 + 1)) * 4


def test_pool_sized_from_free_memory_leaves_the_graph_reserve(monkeypatch):
    shape = kv_pool.KVShape(num_layers=2, num_kv_heads=2, head_dim=16)
    per_token = shape.bytes_per_token(torch.float16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000 * per_token, 0))
    cuda = torch.device("cuda")
    assert kv_pool.pool_size_tokens(shape, torch.float16, cuda, 1, None, 0.5) == 5000
    assert kv_pool.pool_size_tokens(shape, torch.float16, cuda, 1, None, 0.5, 2000 * per_token) == 4000
    assert kv_pool.pool_size_tokens(shape, torch.float16, cuda, 1, 300, 0.5, 2000 * per_token) == 300
    engine = hf_radix.configure(fresh_model("llama"), attn_backend="torch")
    assert engine.graph_reserve == 0  # off CUDA no graphs are captured
