"""A radix call never changes what other threads see; radix calls on one engine never interleave.

Also: models whose attention drops extra keyword arguments (StableLM, Nemotron) run exactly, since the
attention metadata reaches the "radix" attention through a context variable, not a model argument.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from conftest import fresh_model, hf_greedy, hf_logits, random_ids
from transformers import LogitsProcessor, LogitsProcessorList

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams

PAD = 0


def _model(arch: str = "llama") -> torch.nn.Module:
    model = fresh_model(arch)
    hf_radix.configure(model, max_total_tokens=2048, attn_backend="torch")
    return model


def _generate(model, prompt: list[int], radix: bool, **kwargs) -> list[int]:
    if radix:
        kwargs["cache_implementation"] = "radix"
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=PAD, **kwargs
    )
    return out[0, len(prompt) :].tolist()


def _in_new_thread(fn) -> object:
    """Runs `fn` in a fresh thread (a fresh context) to completion; returns its result or raises its error."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class _EveryStep(LogitsProcessor):
    """Calls `hook` at each of generate's sampling steps (inside the radix call, mid-way)."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, input_ids, scores):
        self.hook()
        return scores


def _during_radix_attention(monkeypatch, engine: hf_radix.RadixEngine, hook, times: int) -> list[int]:
    """Calls `hook` from inside the engine's attention backend (mid-forward) at its first `times` calls."""
    backend = engine.backend
    forward = backend.forward
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= times:
            hook()
        return forward(*args, **kwargs)

    monkeypatch.setattr(backend, "forward", wrapped)
    return calls


# ----------------------------------------------------------------------------- plain calls beside radix ones


def test_plain_forward_mid_radix_forward_sees_the_models_own_attention(monkeypatch):
    model = _model()
    gen = torch.Generator().manual_seed(0)
    plain = random_ids(gen, 23)
    alone = hf_logits(model, plain)
    seen = []

    def plain_forward():
        assert model.config._attn_implementation == "radix"  # in the radix call's own thread
        assert _in_new_thread(lambda: model.config._attn_implementation) != "radix"
        seen.append(_in_new_thread(lambda: hf_logits(model, plain)))

    runner = RadixBatchRunner(model)
    _during_radix_attention(monkeypatch, runner.engine, plain_forward, times=6)
    prompts = [random_ids(gen, 9) for _ in range(3)]
    outs = runner.run(prompts, SamplingParams(max_new_tokens=4))
    assert len(seen) == 6
    for logits in seen:
        assert torch.equal(logits, alone)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 4)
    runner.check_integrity()


def test_plain_generate_mid_radix_generate_gives_what_it_gives_alone():
    model = _model("qwen2")
    gen = torch.Generator().manual_seed(1)
    plain, radix = random_ids(gen, 14), random_ids(gen, 11)
    alone = _generate(model, plain, False, max_new_tokens=5)
    radix_alone = _generate(model, radix, False, max_new_tokens=6)
    model.generation_config.prefill_chunk_size = 4  # a setting the radix path takes over
    seen = []

    def plain_generate():
        seen.append(_in_new_thread(lambda: _generate(model, plain, False, max_new_tokens=5)))
        # the radix call takes the setting over in its own context only
        assert _in_new_thread(lambda: model.generation_config.prefill_chunk_size) == 4
        assert model.generation_config.prefill_chunk_size == 4

    processors = LogitsProcessorList([_EveryStep(plain_generate)])
    got = _generate(model, radix, True, max_new_tokens=6, logits_processor=processors)
    assert got == radix_alone
    assert seen == [alone] * 6
    hf_radix.get_engine(model).check_integrity()


def test_free_running_threads_plain_and_radix_on_one_model():
    """No hooks: a thread looping plain forwards/generates beside radix runs and generates, many times."""
    model = _model("gemma2")
    gen = torch.Generator().manual_seed(2)
    plain = random_ids(gen, 19)
    alone_logits = hf_logits(model, plain)
    alone_tokens = _generate(model, plain, False, max_new_tokens=3)
    prompts = [random_ids(gen, 12) for _ in range(4)]
    expected = [hf_greedy(model, p, 3) for p in prompts]
    done = threading.Event()
    mismatches, iterations, errors = [], [0], []

    def plain_loop():
        try:
            while not done.is_set():
                if not torch.equal(hf_logits(model, plain), alone_logits):
                    mismatches.append("forward")
                if _generate(model, plain, False, max_new_tokens=3) != alone_tokens:
                    mismatches.append("generate")
                iterations[0] += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=plain_loop)
    thread.start()
    runner = RadixBatchRunner(model)
    try:
        for _ in range(8):
            outs = runner.run(prompts, SamplingParams(max_new_tokens=3))
            assert [o.token_ids for o in outs] == expected
            assert [_generate(model, p, True, max_new_tokens=3) for p in prompts[:2]] == expected[:2]
    finally:
        done.set()
        thread.join()
    assert not errors, errors
    assert not mismatches
    assert iterations[0] >= 1
    runner.check_integrity()


# ----------------------------------------------------------------------------- radix calls of two threads


class _WatchedLock:
    """The engine's lock, noting when another thread starts waiting for it."""

    def __init__(self, lock):
        self.lock = lock
        self.waiting = threading.Event()
        self.owner: int | None = None

    def __enter__(self):
        if self.owner not in (None, threading.get_ident()):
            self.waiting.set()
        self.lock.acquire()
        self.owner = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self.owner = None
        self.lock.release()


@pytest.mark.parametrize("second", ["runner", "generate"])
def test_radix_calls_from_two_threads_are_serialized(monkeypatch, second: str):
    model = _model()
    engine = hf_radix.get_engine(model)
    gen = torch.Generator().manual_seed(3)
    first_prompts = [random_ids(gen, 10) for _ in range(3)]
    second_prompt = random_ids(gen, 8)
    lock = _WatchedLock(engine.lock)
    monkeypatch.setattr(engine, "lock", lock)
    order: list[int] = []
    record = engine.record_forward
    monkeypatch.setattr(engine, "record_forward", lambda n: (order.append(threading.get_ident()), record(n)))
    results: dict = {}

    def second_call():
        if second == "runner":
            out = RadixBatchRunner(model).run([second_prompt], SamplingParams(max_new_tokens=4))[0]
            results["second"] = out.token_ids
        else:
            results["second"] = _generate(model, second_prompt, True, max_new_tokens=4)

    other = threading.Thread(target=second_call)
    started = []

    def start_second_and_wait_until_it_blocks():
        if not started:
            started.append(True)
            other.start()
            assert lock.waiting.wait(timeout=60), "the second radix call never reached the engine lock"

    _during_radix_attention(monkeypatch, engine, start_second_and_wait_until_it_blocks, times=1)
    outs = RadixBatchRunner(model).run(first_prompts, SamplingParams(max_new_tokens=4))
    other.join()
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 4) for p in first_prompts]
    assert results["second"] == hf_greedy(model, second_prompt, 4)
    first, later = order[0], order[-1]
    assert first != later and order == sorted(order, key=lambda ident: ident != first)  # one block each
    engine.check_integrity()
    assert engine.manager.num_rows == 0


def test_nested_radix_generate_in_one_thread_still_fails_clearly():
    model = _model()
    prompt = [5, 6, 7, 8]

    def nested():
        _generate(model, prompt, True, max_new_tokens=1)

    processors = LogitsProcessorList([_EveryStep(nested)])
    with pytest.raises(RuntimeError, match="another generate"):
        _generate(model, prompt, True, max_new_tokens=2, logits_processor=processors)
    hf_radix.get_engine(model).check_integrity()


# ----------------------------------------------------------------------------- models dropping extra kwargs

_COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    tie_word_embeddings=False,
)


def _kwargs_dropping_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "stablelm":
        config = transformers.StableLmConfig(**_COMMON)
    else:
        config = transformers.NemotronConfig(**_COMMON, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model


@pytest.mark.parametrize("name", ["stablelm", "nemotron"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_models_that_drop_extra_kwargs_match_hf(name: str, page_size: int):
    model = _kwargs_dropping_model(name)
    hf_radix.configure(model, max_total_tokens=1024, page_size=page_size, attn_backend="torch")
    gen = torch.Generator().manual_seed(4)
    shared = random_ids(gen, 21)
    prompts = [shared + random_ids(gen, n) for n in (2, 5)] + [shared]
    runner = RadixBatchRunner(model, chunked_prefill_size=9)
    outs = runner.run(prompts, SamplingParams(max_new_tokens=4))
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.token_ids == hf_greedy(model, prompt, 4)
    context, continuation = shared, random_ids(gen, 4)
    (logprob, _), = runner.loglikelihood([(context, continuation)])
    ids = context + continuation
    reference = hf_logits(model, ids).log_softmax(-1)[len(context) - 1 : -1]
    expected = reference.gather(-1, torch.tensor(continuation)[:, None]).sum().item()
    assert logprob == pytest.approx(expected, abs=1e-5)
    assert _generate(model, prompts[0], True, max_new_tokens=4) == hf_greedy(model, prompts[0], 4)
    runner.check_integrity()
