"""Python conventions (issue 16): real signatures and docstrings, Python reprs, Hugging Face's
`apply_chat_template`, OpenAI-style content parts, `max_tokens=None`, `seed=-1`, closing
streams and runtimes, and log-probabilities per streamed piece."""

import inspect
import re

import pytest

import candlewick as cw
from candlewick import _native

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# A template that reads OpenAI-style parts itself, as the ones of recent chat models do.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for p in message['content'] %}{{ p['text'] }}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TEXT = [{"role": "user", "content": "t5 t6"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "t5 t6"}]}]


@pytest.fixture(scope="module")
def rt(tiny_with_tokenizer):
    return cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu", max_context=64)


MAIN = {
    "ModelRuntime.load", "ModelRuntime.prefill", "ModelRuntime.decode", "ModelRuntime.inspect_prefill",
    "ModelRuntime.trace", "ModelRuntime.generate", "ModelRuntime.stream", "ModelRuntime.chat",
    "ModelRuntime.generate_batch", "ModelRuntime.fork", "Tokenizer.encode", "Tokenizer.decode",
    "Tokenizer.apply_chat_template", "Engine.submit", "generation_defaults",
}


def public_callables():
    """(qualified name, callable) of every function and method the native module offers."""
    for name, obj in vars(_native).items():
        if name.startswith("_"):
            continue
        if inspect.isbuiltin(obj) or inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or isinstance(member, property) or inspect.isdatadescriptor(member):
                    continue
                if callable(member) or isinstance(member, staticmethod):
                    yield f"{name}.{attr}", getattr(obj, attr)


def test_every_native_callable_has_a_signature_and_a_docstring():
    seen = 0
    for name, fn in public_callables():
        seen += 1
        sig = inspect.signature(fn)  # raises ValueError where there is none
        kinds = {p.kind for p in sig.parameters.values()}
        if name != "Tokenizer.apply_chat_template":  # template variables, as transformers takes them
            assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{name}{sig}"
        doc = inspect.getdoc(fn) or ""
        assert doc.strip(), f"{name} has no docstring"
        params = [p for p in sig.parameters if p not in ("self", "$self", "cls")]
        if params:
            assert "Args:" in doc, f"{name}: no Args section"
            for p in params:
                assert re.search(rf"^\s+\**{p} ?[(:]", doc, re.M), f"{name}: argument `{p}` is not documented"
        if name in MAIN:
            assert "Returns:" in doc and "Example:" in doc, f"{name}: no Returns or Example section"
    assert seen > 40


@pytest.mark.parametrize("method", ["generate", "stream", "chat", "generate_batch"])
def test_generation_methods_show_their_keywords_and_the_one_default_table(method):
    sig = inspect.signature(getattr(cw.ModelRuntime, method))
    defaults = _native.generation_defaults()
    assert sig.parameters["max_tokens"].default == defaults["max_tokens"]
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "stop", "seed", "logprobs"):
        assert sig.parameters[name].default is None, name
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["ignore_eos"].default is False
    doc = inspect.getdoc(getattr(cw.ModelRuntime, method))
    assert "Example:" in doc and "temperature (float | None)" in doc


def test_unknown_keywords_and_wrong_kinds_name_the_argument(rt):
    with pytest.raises(TypeError, match="nonsense"):
        rt.generate("t1", nonsense=1)
    with pytest.raises(TypeError, match="temperature must be a number"):
        rt.generate("t1", temperature="hot")
    with pytest.raises(ValueError, match="max_tokens"):
        rt.generate("t1", max_tokens=-1)


def test_reprs_read_as_python(rt):
    reprs = [repr(x) for x in (
        rt, rt.backend, rt.session, rt.capabilities, rt.tokenizer, rt.prefill([1, 2]).wait(),
        rt.generate("t1 t2", max_tokens=2, temperature=0), rt.session.snapshot(),
        cw.ObservationRequest.select(["model.layers.0"]), cw.ObservationRequest.exact(["model.norm"]),
        rt.trace([1, 2], cw.ObservationRequest.exact(["model.norm"])).observations,
        cw.interventions.add("model.layers.0.output", [0.0] * 64, scale=2.0),
    )]
    for r in reprs:
        assert not re.search(r"Some\(|\bNone\(|\btrue\b|\bfalse\b|\"", r), r
    tok = repr(rt.tokenizer)
    assert re.fullmatch(r"Tokenizer\(vocab_size=512, bos_id=(\d+|None), eos_ids=\[[\d, ]*\], chat_template=False\)", tok)
    assert "persistent_cache=True" in repr(rt.capabilities)
    assert repr(cw.ObservationRequest.select(["model.layers.0"])) == "ObservationRequest.select(['model.layers.0'])"


def test_apply_chat_template_takes_transformers_names_and_defaults(rt):
    tok = rt.tokenizer
    params = inspect.signature(tok.apply_chat_template).parameters
    assert list(params)[:8] == ["conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict"]
    assert params["add_generation_prompt"].default is False and params["tokenize"].default is True
    text = tok.apply_chat_template(TEXT, chat_template=TEMPLATE, tokenize=False)
    assert text.endswith("</s>")  # no generation prompt unless asked, as transformers
    ids = tok.apply_chat_template(conversation=TEXT, chat_template=TEMPLATE)
    assert ids == tok.encode(text, add_special_tokens=False)
    d = tok.apply_chat_template(TEXT, chat_template=TEMPLATE, return_dict=True)
    assert d["input_ids"] == ids and d["attention_mask"] == [1] * len(ids)
    opened = tok.apply_chat_template(TEXT + [{"role": "assistant", "content": "t7 t8"}], chat_template=TEMPLATE,
                                     tokenize=False, continue_final_message=True)
    assert opened.endswith("<assistant>t7 t8")
    batch = tok.apply_chat_template([TEXT, PARTS], chat_template=TEMPLATE, tokenize=False)
    assert batch == [text, text]
    with pytest.raises(cw.TokenizerError, match="not compatible"):
        tok.apply_chat_template(TEXT, chat_template=TEMPLATE, continue_final_message=True, add_generation_prompt=True)


@pytest.mark.parametrize("template", [TEMPLATE, PARTS_TEMPLATE], ids=["reads-strings", "reads-parts"])
def test_content_parts_work_everywhere_messages_are_taken(rt, template):
    tok = rt.tokenizer
    want = tok.apply_chat_template(TEXT, chat_template=template, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(PARTS, chat_template=template, add_generation_prompt=True, tokenize=False) == want
    a = rt.chat(TEXT, chat_template=template, max_tokens=3, temperature=0)
    b = rt.chat(PARTS, chat_template=template, max_tokens=3, temperature=0)
    assert a.token_ids == b.token_ids and a.usage["prompt_tokens"] == b.usage["prompt_tokens"]
    with cw.Engine(rt) as engine:
        req = engine.submit(PARTS, chat_template=template, max_tokens=3, temperature=0)
        assert req.wait().token_ids == a.token_ids


def test_messages_are_converted_without_json(rt):
    # Tuples are lists and dict order is kept, as json.dumps would; other objects are refused by name.
    msgs = ({"role": "user", "content": "t5"},)
    assert rt.tokenizer.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False).endswith("<user>t5</s>")
    with pytest.raises(TypeError, match="set"):
        rt.tokenizer.apply_chat_template([{"role": "user", "content": {1, 2}}], chat_template=TEMPLATE)
    with pytest.raises(TypeError, match="list of"):
        rt.chat("not messages", chat_template=TEMPLATE)


def test_max_tokens_none_runs_until_the_context_is_full(tiny_with_tokenizer):
    small = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu", max_context=12)
    r = small.generate("t1 t2 t3", max_tokens=None, ignore_eos=True, temperature=0)
    assert r.finish_reason == "length"
    assert r.usage["prompt_tokens"] + r.usage["completion_tokens"] >= small.session.max_context
    assert r.usage["completion_tokens"] > _native.generation_defaults()["max_tokens"] // 100


def test_seed_minus_one_is_random_and_a_seed_repeats(rt):
    kw = dict(max_tokens=8, temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    assert rt.generate("t1", seed=7, **kw).token_ids == rt.generate("t1", seed=7, **kw).token_ids
    runs = {tuple(rt.generate("t1", seed=-1, **kw).token_ids) for _ in range(4)}
    assert len(runs) > 1
    with pytest.raises(ValueError, match="seed"):
        rt.generate("t1", seed=-2)


def test_a_stream_closed_early_keeps_its_usage_and_finish_reason(rt):
    s = rt.stream("t1 t2", max_tokens=20, temperature=0, ignore_eos=True)
    first = next(s)
    assert s.result is None
    s.close()
    assert s.result.finish_reason == "cancelled"
    assert s.result.usage["completion_tokens"] >= 1 and s.result.text.startswith(first)
    s.close()  # twice is fine
    assert list(s) == []
    with rt.stream("t1 t2", max_tokens=20, temperature=0, ignore_eos=True) as s2:
        for _ in s2:
            break
    assert s2.result.finish_reason == "cancelled"
    # A stream that ran to its end keeps its own reason when closed.
    s3 = rt.stream("t1 t2", max_tokens=3, temperature=0, ignore_eos=True)
    pieces = list(s3)
    s3.close()
    assert s3.result.finish_reason == "length" and "".join(pieces) == s3.result.text


def test_stream_logprobs_come_with_each_piece(rt):
    want = rt.generate("t1 t2", max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    s = rt.stream("t1 t2", max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    got = []
    for piece in s:
        assert s.logprobs, piece
        got += s.logprobs
    assert [e["token"] for e in got] == [e["token"] for e in s.result.logprobs][: len(got)]
    assert [e["token"] for e in s.result.logprobs] == [e["token"] for e in want.logprobs]
    for a, b in zip(got, want.logprobs):
        assert abs(a["logprob"] - b["logprob"]) < 1e-5 and len(a["top_logprobs"]) == 3
    assert rt.stream("t1", max_tokens=2).logprobs is None


def test_engine_pieces_carry_their_logprobs(rt):
    with cw.Engine(rt) as engine:
        req = engine.submit("t1 t2", max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
        got = []
        for _ in req:
            got += req.logprobs
        assert [e["token"] for e in got] == [e["token"] for e in req.result.logprobs][: len(got)]
        assert len(got) >= 4


def test_a_closed_runtime_raises_a_typed_error(tiny_with_tokenizer):
    with cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu") as rt:
        assert rt.generate("t1", max_tokens=1).token_ids
        stream = rt.stream("t1", max_tokens=5)
        tok = rt.tokenizer
    assert rt.closed and repr(rt) == "ModelRuntime(closed)"
    for call in (lambda: rt.generate("t1"), lambda: rt.prefill([1]), lambda: rt.session.position,
                 lambda: rt.session.reset(), lambda: rt.tokenizer, lambda: next(stream)):
        with pytest.raises(cw.RuntimeClosedError, match="closed"):
            call()
    assert issubclass(cw.RuntimeClosedError, cw.SessionError)
    assert tok.encode("t1") == [1]  # a tokenizer taken before stays usable
    rt.close()
