"""The engine: continuous batching of many requests over one model (docs/engine.md)."""

import asyncio
import threading

import numpy as np
import pytest

import candlewick as cw
from candlewick import interventions as iv

GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def rt(tiny_with_tokenizer):
    return cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")


def prompt(i):
    rng = np.random.default_rng(i)
    return rng.integers(3, 512, size=int(rng.integers(3, 20))).tolist()


def test_sixteen_requests_from_four_threads_each_get_their_own_answer(rt):
    want = {}
    for i in range(16):
        rt.session.reset()
        want[i] = rt.generate(prompt(i), **GREEDY).token_ids
    got = {}
    with cw.Engine(rt, max_batch_size=8) as engine:

        def client(ids):
            for i in ids:
                req = engine.submit(prompt(i), **GREEDY)
                text = "".join(req)
                got[i] = (req.result.token_ids, text, req.result.text)

        threads = [threading.Thread(target=client, args=(range(k, 16, 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stats = engine.stats()
    assert sorted(got) == list(range(16))
    for i, (ids, streamed, text) in got.items():
        assert ids == want[i], i
        assert streamed == text
    assert stats["finished"] == 16 and stats["steps"] < 16 * 8  # requests shared steps


def test_a_cancelled_request_frees_its_slot(rt):
    with cw.Engine(rt, max_batch_size=1) as engine:
        long = engine.submit(prompt(1), max_tokens=None, temperature=0.0, ignore_eos=True)
        next(iter(long))
        long.cancel()
        short = engine.submit(prompt(2), **GREEDY)
        assert short.wait() is not None
        assert long.wait() is None and long.cancelled


def test_a_full_queue_refuses_at_once(rt):
    with cw.Engine(rt, max_batch_size=1, max_queue=1) as engine:
        running = engine.submit(prompt(1), max_tokens=None, temperature=0.0, ignore_eos=True)
        next(iter(running))
        with pytest.raises(cw.QueueFullError):
            for _ in range(4):
                engine.submit(prompt(2), **GREEDY)
        running.cancel()
    assert issubclass(cw.QueueFullError, cw.CandlewickError)


def test_a_requests_interventions_are_its_own(rt):
    h = rt.model_info["hidden_size"]
    edit = [iv.add("model.layers.1.output", np.full(h, 2.0, dtype=np.float32))]
    rt.session.reset()
    plain_alone = rt.generate(prompt(3), **GREEDY).token_ids
    rt.session.reset()
    rt.interventions = edit
    steered_alone = rt.generate(prompt(3), **GREEDY).token_ids
    rt.interventions = []
    assert steered_alone != plain_alone
    with cw.Engine(rt, max_batch_size=4) as engine:
        steered = engine.submit(prompt(3), interventions=edit, **GREEDY)
        plain = engine.submit(prompt(3), **GREEDY)
        assert steered.wait().token_ids == steered_alone
        assert plain.wait().token_ids == plain_alone


def test_async_iteration(rt):
    async def run(engine):
        req = engine.submit(prompt(4), **GREEDY)
        return "".join([piece async for piece in req]), req.result

    with cw.Engine(rt) as engine:
        text, result = asyncio.run(run(engine))
    assert text == result.text and len(result.token_ids) == 8


def test_bad_requests_are_typed_errors_and_the_engine_goes_on(rt):
    with cw.Engine(rt) as engine:
        with pytest.raises(cw.TokenOutOfRangeError):
            engine.submit([1, 2, 10**6], **GREEDY).wait()
        with pytest.raises(cw.InvalidInterventionError):
            engine.submit([1, 2], interventions=[iv.add("model.layers.9.output", [0.0])], **GREEDY).wait()
        assert engine.submit(prompt(5), **GREEDY).wait().finish_reason == "length"


def test_generate_batch_on_a_float32_checkpoint_equals_generate_exactly(rt):
    prompts = [prompt(i) for i in range(5)]
    batch = rt.generate_batch(prompts, **GREEDY)
    for p, got in zip(prompts, batch):
        rt.session.reset()
        alone = rt.generate(p, **GREEDY)
        assert got.token_ids == alone.token_ids and got.text == alone.text


@pytest.mark.parametrize("chunk", [1, 64, None])
def test_a_long_prompt_joins_a_chunk_per_step_and_answers_as_alone(rt, chunk):
    # Issue 25: while a long prompt is prefilled a chunk per step, the running requests keep
    # decoding; every answer is what the same request gives alone.
    long_prompt = np.random.default_rng(7).integers(3, 512, size=300).tolist()
    rt.session.reset()
    want_long = rt.generate(long_prompt, **GREEDY).token_ids
    rt.session.reset()
    want_short = rt.generate(prompt(1), max_tokens=40, temperature=0.0, ignore_eos=True).token_ids
    with cw.Engine(rt, max_batch_size=4, prefill_chunk=chunk) as engine:
        short = engine.submit(prompt(1), max_tokens=40, temperature=0.0, ignore_eos=True)
        next(iter(short))  # decoding before the long prompt arrives
        long = engine.submit(long_prompt, **GREEDY)
        assert long.wait().token_ids == want_long
        assert short.wait().token_ids == want_short


def test_load_options_beside_a_loaded_runtime_are_refused_naming_them(rt, tiny_with_tokenizer):
    """`Engine(path, **load_options)` loads with them; a runtime is loaded already, so they
    would be dropped: refused instead, before any engine starts."""
    with pytest.raises(cw.InvalidOptionError, match=r"^max_context, threads: .*ModelRuntime\.load"):
        cw.Engine(rt, threads=1, max_context=64)
    with cw.Engine(tiny_with_tokenizer, device="cpu", max_context=64) as engine:
        assert engine.runtime.session.max_context == 64
    with cw.Engine(rt) as engine:
        assert engine.submit([3, 4, 5], **GREEDY).wait().token_ids == rt.generate([3, 4, 5], **GREEDY).token_ids


TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.mark.parametrize("prompt", ["t3 t4 t5", [3, 4, 5]], ids=["text", "ids"])
def test_a_chat_template_on_a_prompt_no_template_renders_is_refused(rt, prompt):
    with cw.Engine(rt) as engine:
        with pytest.raises(cw.InvalidOptionError, match="^chat_template: "):
            engine.submit(prompt, chat_template=TEMPLATE, **GREEDY)
        # With chat messages the template is what renders them.
        chat = engine.submit([{"role": "user", "content": "t3 t4 t5"}], chat_template=TEMPLATE, **GREEDY).wait()
        rt.session.reset()
        assert chat.token_ids == rt.generate("t3 t4 t5 ", **GREEDY).token_ids
