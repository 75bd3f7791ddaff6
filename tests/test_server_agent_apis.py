"""The Responses API (`openai` client) and the Messages API (`anthropic` client) through
`candlewick serve` on the loopback (issue 42): text, streaming events, stored responses and
previous_response_id, tools and tool results, text.format / JSON schema, stop reasons,
count_tokens, per-request interventions and observations, GBNF `grammar`, and a 400 naming each
field the server does not honour."""

import json

import jsonschema
import numpy as np
import pytest

from server_helpers import post, stop
from test_server import NAME, start_server
from test_server_tools import ASK, SCHEMAS, TEMPLATE, TOOLS

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]
# The `anthropic` client (2.x) has no sampling arguments of its own any more: they go in the body.
GREEDY = {"temperature": 0}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # A template that renders tools, calls and results.
    proc, url = start_server(tmp_path_factory.mktemp("agents"), template=TEMPLATE)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


# -- /v1/responses --------------------------------------------------------------------------


def test_responses_text_equals_chat(oai):
    r = oai.responses.create(model=NAME, input="Name a colour.", instructions="Answer in one word.",
                             max_output_tokens=12, temperature=0)
    chat = oai.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_responses_items_input_and_max_tokens_incomplete(oai):
    r = oai.responses.create(model=NAME, max_output_tokens=3, temperature=0, input=[
        {"role": "developer", "content": "Be verbose."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_responses_stream_events_assemble_to_the_text(oai):
    stream = oai.responses.create(model=NAME, input="Count: one, two,", max_output_tokens=10, temperature=0,
                                  stream=True)
    kinds, deltas, final = [], [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(deltas) == final.output_text
    plain = oai.responses.create(model=NAME, input="Count: one, two,", max_output_tokens=10, temperature=0)
    assert plain.output_text == final.output_text


def test_previous_response_id_continues_the_stored_conversation(oai, base):
    first = oai.responses.create(model=NAME, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = oai.responses.create(model=NAME, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    chat = oai.chat.completions.create(model=NAME, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    # Not stored: cannot be continued; an unknown id is a 404 naming the field.
    unstored = oai.responses.create(model=NAME, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no stored response"):
        oai.responses.create(model=NAME, input="again", previous_response_id=unstored.id, max_output_tokens=2)


def test_responses_store_is_bounded():
    from candlewick.serve.responses import ResponseStore

    store = ResponseStore(size=2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [])
    store.get("resp_1", "x")  # used: now the newest
    store.put({"id": "resp_3"}, [])
    assert list(store.items) == ["resp_1", "resp_3"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_calls_and_their_output(oai, stream):
    kw = dict(model=NAME, input="What is the weather in Paris?", tools=RESPONSES_TOOLS, tool_choice="required",
              max_output_tokens=120, temperature=0.0, parallel_tool_calls=False)
    if stream:
        final = None
        for event in oai.responses.create(stream=True, **kw):
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        r = final
    else:
        r = oai.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    answer = oai.responses.create(model=NAME, previous_response_id=r.id, tools=RESPONSES_TOOLS, max_output_tokens=12,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": "18 C, sunny"}])
    assert answer.status in ("completed", "incomplete")
    named = oai.responses.create(model=NAME, input="Time?", tools=RESPONSES_TOOLS, max_output_tokens=80,
                                 tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
    assert [c.name for c in named.output if c.type == "function_call"] == ["get_time"]


def test_responses_text_format_json_schema(oai):
    r = oai.responses.create(model=NAME, input="A person as JSON:", max_output_tokens=60, temperature=0.7, top_p=0.9,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                              "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_responses_interventions_and_observations_as_on_chat(oai):
    point = "model.layers.3.output"
    edit = [{"point": point, "op": "scale", "index": 0, "factor": 0.0}]
    r = oai.responses.create(model=NAME, input="Hello", max_output_tokens=6, temperature=0,
                             extra_body={"interventions": edit, "observe": [point]})
    chat = oai.chat.completions.create(model=NAME, max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Hello"}],
                                       extra_body={"interventions": edit, "observe": [point]})
    assert r.output_text == chat.choices[0].message.content
    mine, theirs = r.model_extra["candlewick"], chat.model_extra["candlewick"]
    assert mine["observations"][point]["shape"] == theirs["observations"][point]["shape"]
    assert mine["observations"][point]["data"] == theirs["observations"][point]["data"]
    assert np.frombuffer(__import__("base64").b64decode(mine["observations"][point]["data"]), np.float32).size


@pytest.mark.parametrize("extra,field", [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
])
def test_responses_unhonoured_field_is_a_400_naming_it(base, extra, field):
    body = {"model": NAME, "input": "Hi", "max_output_tokens": 2, **extra}
    status, out, _ = post(base, "/v1/responses", body)
    assert status == 400, out
    assert out["error"]["param"] == field and field.split("[")[0].split(".")[0] in out["error"]["message"]


# -- /v1/messages ---------------------------------------------------------------------------


def test_messages_text_equals_chat(claude, oai):
    m = claude.messages.create(model=NAME, max_tokens=12, system="Answer in one word.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Name a colour."}])
    chat = oai.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}])
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    count = claude.messages.count_tokens(model=NAME, system="Answer in one word.",
                                         messages=[{"role": "user", "content": "Name a colour."}])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_messages_stop_reasons(claude):
    m = claude.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "Tell a story."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    free = claude.messages.create(model=NAME, max_tokens=20, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count: one, two, three,"}])
    text = free.content[0].text
    # A word whose first appearance follows some text, so the cut answer keeps that text (a stop
    # at the very start leaves no content block; which words the greedy answer holds, and whether
    # its second word repeats its first, depends on the CPU's kernels).
    word = next((w for w in text.split() if text[:text.find(w)].strip()), text.strip()[-2:])
    cut = claude.messages.create(model=NAME, max_tokens=20, extra_body=GREEDY, stop_sequences=["zzz", word],
                                 messages=[{"role": "user", "content": "Count: one, two, three,"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    kept = "".join(block.text for block in cut.content)
    assert word not in kept and text.startswith(kept)


def test_messages_stream_events_assemble_to_the_text(claude):
    kw = dict(model=NAME, max_tokens=10, extra_body=GREEDY, messages=[{"role": "user", "content": "Count: one, two,"}])
    with claude.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    plain = claude.messages.create(**kw)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_and_tool_result(claude, stream):
    kw = dict(model=NAME, max_tokens=120, extra_body=GREEDY, tools=CLAUDE_TOOLS, tool_choice={"type": "any"},
              messages=[{"role": "user", "content": ASK[0]["content"]}])
    if stream:
        with claude.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses
    for u in uses:
        jsonschema.validate(u.input, SCHEMAS[u.name])
    history = [kw["messages"][0], {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C"}]}]
    answer = claude.messages.create(model=NAME, max_tokens=12, extra_body=GREEDY, tools=CLAUDE_TOOLS, messages=history)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    named = claude.messages.create(model=NAME, max_tokens=80, tools=CLAUDE_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                                   messages=[{"role": "user", "content": "Time?"}])
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]


def test_messages_interventions_observations_and_gbnf(claude, oai):
    point = "model.layers.3.output"
    edit = [{"point": point, "op": "scale", "index": 0, "factor": 0.0}]
    m = claude.messages.create(model=NAME, max_tokens=6, messages=[{"role": "user", "content": "Hello"}],
                               extra_body={"interventions": edit, "observe": [point], **GREEDY})
    chat = oai.chat.completions.create(model=NAME, max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Hello"}],
                                       extra_body={"interventions": edit, "observe": [point]})
    assert m.content[0].text == chat.choices[0].message.content
    assert m.model_extra["candlewick"]["observations"][point]["data"] == \
        chat.model_extra["candlewick"]["observations"][point]["data"]
    gbnf = 'root ::= ("yes" | "no") "."'
    g = claude.messages.create(model=NAME, max_tokens=8, messages=[{"role": "user", "content": "Yes or no?"}],
                               extra_body={"grammar": gbnf})
    assert g.content[0].text in ("yes.", "no.")


def test_chat_and_completions_take_a_gbnf_grammar(oai):
    gbnf = 'root ::= [0-9]+ "-" [0-9]+'
    r = oai.completions.create(model=NAME, prompt="A range:", max_tokens=10, temperature=0.9, seed=1,
                               extra_body={"grammar": gbnf})
    import re
    assert re.fullmatch(r"[0-9]+-?[0-9]*", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("extra,field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),
    ({"metadata": {"user_id": "u", "other": 1}}, "metadata.other"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
])
def test_messages_unhonoured_field_is_a_400_naming_it(base, extra, field):
    body = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **extra}
    status, out, _ = post(base, "/v1/messages", body)
    assert status == 400, out
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert repr(field) in out["error"]["message"] or field in out["error"]["message"], out


def test_messages_output_config_json_schema(claude):
    m = claude.messages.create(model=NAME, max_tokens=60, messages=[{"role": "user", "content": "A person as JSON:"}],
                               output_config={"format": {"type": "json_schema", "schema": PERSON}},
                               extra_body={"temperature": 0.7, "seed": 3})
    jsonschema.validate(json.loads(m.content[0].text), PERSON)
    assert m.stop_reason == "end_turn"


def test_messages_errors_reach_the_client_in_anthropic_shape(claude):
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="another-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])


def test_readme_server_blocks_run_against_the_server(base, tmp_path):
    """The README's `python server` blocks (a Responses and a Messages request), as written but
    for the port."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = re.findall(r"^```python server\n(.*?)^```", readme, re.S | re.M)
    assert len(found) == 2
    for k, block in enumerate(found):
        script = tmp_path / f"server_block_{k}.py"
        script.write_text(block.replace("http://127.0.0.1:8000", base))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
