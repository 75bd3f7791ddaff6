"""Structured output and tool calls through `candlewick serve` with the official `openai` client
(issue 26): `response_format`, `tools` with `tool_choice` required / named / auto, a tool result
sent back, streamed tool calls, and a 400 for every field the server does not honour."""

import json

import jsonschema
import pytest

from server_helpers import stop
from test_server import MODEL, NAME, start_server  # noqa: F401  (MODEL: the Gemma GGUF)

openai = pytest.importorskip("openai")

# A Hermes-style template (as Qwen 2.5's) over Gemma's turns, rendering tools, calls and results.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>system\nYou may call these tools, writing "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<end_of_turn>\n{% endif %}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else ('user' if m['role'] == 'tool' else m['role']) }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% elif m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] | trim }}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    proc, base = start_server(tmp_path_factory.mktemp("tools"), template=TEMPLATE)
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stop(proc)


def check_calls(calls, only=None):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id
        assert only is None or c.function.name == only
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_gives_valid_calls(client, seed):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0.8, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_and_its_result_goes_back(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=named,
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.0)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, only="get_time")
    assert len(calls) == 1
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}]
    answer = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=16, temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens


def test_streamed_tool_calls_assemble_into_valid_arguments(client):
    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=120, temperature=0.0, stream=True)
    calls, reasons = {}, []
    for ch in stream:
        for c in ch.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function.name:
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
    assert "tool_calls" in reasons and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def _turn(i, city):
    """A past turn that asked for a city's weather, called the tool, and answered from its result."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "c"})}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "20 C"},
            {"role": "assistant", "content": "It is 20 C."}]


def test_auto_calls_a_tool_where_the_conversation_leads_to_one(client):
    """With tool_choice auto (the default) nothing constrains the answer: the model's own text is
    parsed into calls. After two turns that called get_weather, greedy Gemma 3 270M calls it for
    Paris; asked cold, it answers in text, which comes back as text with no calls."""
    history = _turn(0, "London") + _turn(1, "Rome")
    r = client.chat.completions.create(model=NAME, messages=history + ASK, tools=TOOLS, max_tokens=60,
                                       temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls, only="get_weather")
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    cold = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0.0)
    assert cold.choices[0].message.tool_calls is None and cold.choices[0].message.content
    assert cold.choices[0].finish_reason == "length"


def test_response_format_on_both_endpoints(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, max_tokens=80, temperature=0.0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    # The integer is bounded: with any integer allowed, greedy Gemma 3 270M may write digits until
    # max_tokens (`{"name":1000000...`), which the schema permits.
    c = client.completions.create(model=NAME, prompt="A JSON object:", max_tokens=60, temperature=0.0,
                                  extra_body={"response_format": {"type": "json_object",
                                                                  "schema": {"type": "object", "maxProperties": 1,
                                                                             "additionalProperties": {
                                                                                 "type": "integer", "minimum": 0,
                                                                                 "maximum": 1000}}}})
    assert c.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(c.choices[0].text), dict)


@pytest.mark.parametrize("endpoint, extra, field", [
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"tools": TOOLS}, "tools"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
])
def test_a_field_the_server_does_not_honour_is_a_400_naming_it(client, endpoint, extra, field):
    with pytest.raises(openai.BadRequestError, match=field):
        if endpoint == "completions":
            client.completions.create(model=NAME, prompt="Hi", max_tokens=2, extra_body=extra)
        else:
            client.chat.completions.create(model=NAME, messages=ASK, max_tokens=2, extra_body=extra)


def test_an_unsupported_schema_keyword_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError, match="if"):
        client.chat.completions.create(model=NAME, messages=ASK, response_format=bad, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
