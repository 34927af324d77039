"""transformers conventions: logging through transformers' verbosity, the pool's announcement and its size in
errors, `run` following `model.generation_config`, one pool per model."""

from __future__ import annotations

import importlib
import pkgutil
import weakref

import pytest
import torch
import transformers
from conftest import fresh_model
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.memory import kv_pool
from hf_radix.scheduling.sampling import generate_new_tokens


def _modules_with_logger():
    packages = pkgutil.walk_packages(hf_radix.__path__, "hf_radix.")
    names = [m.name for m in packages if not m.name.endswith(".__main__")]  # importing one runs a CLI
    modules = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (lm-eval, triton) is not installed
            continue
        if hasattr(module, "logger"):
            modules.append(module)
    return modules


@pytest.fixture
def restore_verbosity():
    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


def test_transformers_verbosity_controls_every_hf_radix_logger(restore_verbosity):
    modules = _modules_with_logger()
    expected = {"hf_radix.engine", "hf_radix.scheduler", "hf_radix.memory.kv_pool"}
    assert expected <= {m.__name__ for m in modules}
    root = logging.get_logger()  # transformers' root logger: its handler prints hf_radix's messages too
    for module in modules:
        assert module.logger.name == module.__name__
        transformers.logging.set_verbosity_error()
        with CaptureLogger(root) as quiet:
            module.logger.warning("silenced")
        transformers.logging.set_verbosity_info()
        with CaptureLogger(root) as loud:
            module.logger.info("shown")
        assert quiet.out == "" and loud.out == "shown\n", module.__name__


# -- the pool announces itself; its size in messages excludes the scratch page --------------------------
def _pool_messages(model, **options) -> str:
    logging.warning_once.cache_clear()  # each case below must be able to warn
    with CaptureLogger(logging.get_logger()) as captured:
        hf_radix.configure(model, attn_backend="torch", **options)
    return captured.out


def test_default_sized_pool_warns_how_much_memory_and_how_to_change_it(restore_verbosity):
    transformers.logging.set_verbosity_warning()
    model = fresh_model("llama")
    message = _pool_messages(model)
    assert "GiB of cpu memory" in message and "32,768 tokens" in message
    assert "max_total_tokens" in message and "mem_fraction" in message and "hf_radix.configure" in message
    assert _pool_messages(model, max_total_tokens=256) == ""  # sized by hand on CPU: INFO only
    transformers.logging.set_verbosity_info()
    message = _pool_messages(model, max_total_tokens=258, page_size=4)
    assert "(256 tokens, max_total_tokens=258)" in message
    assert "260" not in message  # said once, without the scratch page (64 pages of 4 + 1)


def test_pool_errors_count_the_tokens_asked_for(tokenizer):
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=256)
    assert runner.engine.pool_tokens == 256 and hf_radix.cache_stats(model)["pool_tokens"] == 256
    out = runner.run([list(range(2, 300))], SamplingParams(max_new_tokens=2))[0]
    assert out.finish_reason == "error" and out.error.endswith("the KV pool holds 256")
    with pytest.raises(ValueError, match="of the pool's 256 are free"), torch.inference_mode():
        model.generate(torch.arange(2, 200)[None], max_new_tokens=100, do_sample=False,
                       cache_implementation="radix")
    runner.check_integrity()


# -- run() without sampling params follows model.generation_config, as generate does ---------------------
def test_sampling_params_from_generation_config():
    config = transformers.GenerationConfig()
    # generate's defaults: greedy, 20 new tokens
    assert SamplingParams.from_generation_config(config) == SamplingParams(max_new_tokens=20)
    config = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=5,
                                           stop_strings=["\n"])
    assert SamplingParams.from_generation_config(config) == SamplingParams(
        max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=50, stop=("\n",)  # top_k: generate's default
    )
    config = transformers.GenerationConfig(do_sample=True, top_k=0, min_p=None)
    assert SamplingParams.from_generation_config(config).top_k == -1  # 0 disables top-k in transformers
    config = transformers.GenerationConfig(temperature=0.7, top_k=5, max_new_tokens=3)  # do_sample unset
    assert SamplingParams.from_generation_config(config) == SamplingParams(max_new_tokens=3)


def test_new_tokens_follow_generate_length_rules():
    default, counted = transformers.GenerationConfig(), transformers.GenerationConfig(max_length=50)
    assert generate_new_tokens(default) == generate_new_tokens(default, 100) == 20
    assert generate_new_tokens(default, 100, max_positions=110) == 10  # within the model's positions
    assert generate_new_tokens(counted, 30) == 20  # max_length counts the prompt
    assert generate_new_tokens(transformers.GenerationConfig(max_length=50, max_new_tokens=7), 30) == 7
    assert SamplingParams.from_generation_config(counted, prompt_len=45).max_new_tokens == 5
    with pytest.raises(ValueError, match="max_length=50, which counts the prompt"):
        generate_new_tokens(counted)
    with pytest.raises(ValueError, match="the prompt has 50 tokens but generate's max_length is 50"):
        generate_new_tokens(counted, 50)



@pytest.mark.parametrize(
    "name,settings",
    [("num_beams", {"num_beams": 4}), ("repetition_penalty", {"repetition_penalty": 1.1}),
     ("min_p", {"do_sample": True, "min_p": 0.1})],
)
def test_generation_config_the_runner_cannot_honour_raises(name, settings):
    with pytest.raises(ValueError, match=f"sets {{'{name}'"):
        SamplingParams.from_generation_config(transformers.GenerationConfig(**settings))


def test_run_without_sampling_params_generates_as_many_tokens_as_generate():
    model = fresh_model("llama", seed=3)
    model.generation_config.eos_token_id = None  # every answer runs to its length (the runner reads it now)
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=1024)
    short, long = list(range(5, 25)), list(range(5, 45))

    def plain(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            return model.generate(torch.tensor([prompt]), pad_token_id=0, eos_token_id=None,
                                  do_sample=False)[0, len(prompt):].tolist()

    with pytest.warns(UserWarning, match="default `max_length`"):
        expected = plain(short)
    assert len(expected) == 20 and runner.run([short])[0].token_ids == expected  # transformers' default
    model.generation_config.max_length = 30  # counts the prompt: 10 new tokens after 20
    expected = plain(short)
    outs = runner.run([short, long])
    assert len(expected) == 10 and outs[0].token_ids == expected
    assert outs[1].finish_reason == "error" and "max_length is 30" in outs[1].error  # generate raises too
    with pytest.raises(ValueError, match="`max_length` is set to 30"):
        plain(long)
    runner.check_integrity()


def test_run_without_sampling_params_follows_generation_config():
    model = fresh_model("llama", seed=3)
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=1024)
    prompt = list(range(5, 25))
    model.generation_config.max_new_tokens = 7
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), pad_token_id=0)[0, len(prompt):].tolist()
    assert runner.run([prompt])[0].token_ids == expected
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1  # sampling that can only pick the argmax: the same tokens
    assert runner.run([prompt])[0].token_ids == expected
    model.generation_config.num_beams = 2
    with pytest.raises(ValueError, match="num_beams"):
        runner.run([prompt])
    runner.check_integrity()


# -- one pool per model ------------------------------------------------------------------------------------
def test_backend_options_keep_the_engine_and_its_cache():
    model = fresh_model("llama")
    runner = RadixBatchRunner(model, attn_backend="torch", max_total_tokens=512)
    prompt = list(range(5, 40))
    first = runner.run([prompt], SamplingParams(max_new_tokens=3))[0]
    other = RadixBatchRunner(model, attn_backend="auto", mem_fraction=0.5)  # mem_fraction: size is fixed
    assert other.engine is runner.engine and other.engine.options.attn_backend == "auto"
    again = other.run([prompt], SamplingParams(max_new_tokens=3))[0]
    assert again.cached_tokens == len(prompt) - 1 and again.token_ids == first.token_ids
    runner.check_integrity()


@pytest.mark.parametrize("host_cache_tokens", [None, 256])
def test_new_pool_options_release_the_old_pool_before_allocating(monkeypatch, host_cache_tokens):
    model = fresh_model("llama")
    hf_radix.configure(model, attn_backend="torch", max_total_tokens=512, host_cache_tokens=host_cache_tokens)
    runner = RadixBatchRunner(model)
    prompt = list(range(5, 40))
    first = runner.run([prompt], SamplingParams(max_new_tokens=3))[0]
    old_pool, old_buffer = weakref.ref(runner.engine.pool), weakref.ref(runner.engine.pool.buffer)
    old_alive_at_allocation = []
    allocate = kv_pool.KVPool.__init__

    def recording_init(self, *args, **kwargs):
        old_alive_at_allocation.append(old_pool() is not None or old_buffer() is not None)
        allocate(self, *args, **kwargs)

    monkeypatch.setattr(kv_pool.KVPool, "__init__", recording_init)
    other = RadixBatchRunner(model, page_size=4)
    assert old_alive_at_allocation == [False] and runner.engine.closed
    assert other.engine.page_size == 4 and other.engine.options.max_total_tokens == 512  # others carry over
    # the first runner follows the model to its new pool (no second allocation) and still matches
    assert runner.run([prompt], SamplingParams(max_new_tokens=3))[0].token_ids == first.token_ids
    assert runner.engine is other.engine and len(old_alive_at_allocation) == 1
    other.check_integrity()


def test_pool_options_do_not_change_under_running_requests():
    model = fresh_model("llama")
    engine = hf_radix.configure(model, attn_backend="torch", max_total_tokens=512)
    handle = engine.manager.match([5, 6, 7])
    engine.manager.lock(handle)
    row = engine.manager.open_row(handle)  # a request in flight
    for options in ({"page_size": 4}, {"attn_backend": "auto"}):
        with pytest.raises(RuntimeError, match="while requests are running"):
            hf_radix.configure(model, **options)
    assert hf_radix.get_engine(model) is engine and not engine.closed
    engine.manager.cache_req(row, [5, 6, 7], 0, finished=True)
    engine.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pool_sized_by_mem_fraction_is_rebuilt_in_the_memory_it_freed():
    """The issue's case: a second runner with another page size got a pool from the memory the first left."""
    model = fresh_model("llama").cuda()
    runner = RadixBatchRunner(model, mem_fraction=0.5, max_running_requests=8)
    prompts = [list(range(5, 60)) + [n] for n in range(8, 16)]
    first = runner.run(prompts, SamplingParams(max_new_tokens=4))  # captures decode/extend graphs
    old_tokens, old_buffer = runner.engine.pool_tokens, weakref.ref(runner.engine.pool.buffer)
    other = RadixBatchRunner(model, page_size=16, mem_fraction=0.5)
    assert old_buffer() is None
    assert other.engine.pool_tokens > 0.9 * old_tokens  # not 0.5 of what the old pool left free
    assert [o.token_ids for o in runner.run(prompts, SamplingParams(max_new_tokens=4))] == [
        o.token_ids for o in first
    ]
    other.check_integrity()


def test_only_working_attention_backends_are_accepted():
    with pytest.raises(ValueError, match=r"attn_backend must be one of \('auto', 'torch', 'triton'\)"):
        hf_radix.configure(fresh_model("llama"), attn_backend="flashinfer", max_total_tokens=64)
