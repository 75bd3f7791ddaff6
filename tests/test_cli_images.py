"""`--image PATH` on `candlewick generate` and `chat`: each image read before the model loads (a
bad one is a usage error), then passed on as `images=` (generate) or as the first message's
image parts (chat). The runtime is a stand-in recording what the command line passes; the
runtime's own handling of images is tested with the vision models (issue 39)."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from candlewick import cli


class FakeStream:
    def __init__(self):
        self.result = SimpleNamespace(text="ok", usage={}, finish_reason="stop")

    def __iter__(self):
        return iter(["ok"])


class FakeRuntime:
    def __init__(self):
        self.calls = []
        self.tokenizer = SimpleNamespace(chat_template="{{ messages }}")

    def stream(self, prompt, **kw):
        self.calls.append(("stream", prompt, kw))
        return FakeStream()

    def chat(self, messages, **kw):
        self.calls.append(("chat", [dict(m) for m in messages], kw))
        return FakeStream()


@pytest.fixture
def picture(tmp_path):
    p = tmp_path / "p.png"
    Image.fromarray(np.zeros((4, 6, 3), np.uint8)).save(p)
    return str(p)


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(cli, "load", lambda args: rt)
    return rt


def test_a_missing_image_is_a_usage_error_before_loading(fake, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--image", "/no/such.png", "--quiet", "hi"])
    assert e.value.code == 2
    assert "--image /no/such.png: no image file" in capsys.readouterr().err
    assert not fake.calls


def test_generate_passes_the_images(fake, picture, capsys):
    assert cli.main(["generate", "--image", picture, "--image", picture, "--quiet", "<image> and <image>"]) == 0
    kind, prompt, kw = fake.calls[0]
    assert kind == "stream" and prompt == "<image> and <image>" and kw["images"] == [picture, picture]
    cli.main(["generate", "--quiet", "no image"])
    assert "images" not in fake.calls[1][2]


def test_chat_gives_the_images_with_the_first_message(fake, picture, monkeypatch, capsys):
    lines = iter(["what is it?", "and now?"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.main(["chat", "--image", picture, "--quiet"]) == 0
    first, second = fake.calls[0][1], fake.calls[1][1]
    assert first[-1] == {"role": "user", "content": [{"type": "image", "path": picture},
                                                     {"type": "text", "text": "what is it?"}]}
    assert second[-1] == {"role": "user", "content": "and now?"}
