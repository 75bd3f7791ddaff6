"""Models by their Hub name (issue 38, DESIGN §14), without the network: a Hub on 127.0.0.1
(`fake_hub.py`) serving real tiny models, and a cache filled through it and then read with
HF_HUB_OFFLINE=1. Each error a user can meet is checked, and what is downloaded: only the
chosen files."""

import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import candlewick as cw
from candlewick import hub as cwhub

import fake_hub
import gguf_convert
from conftest import TINY
from server_helpers import get_json, launch

hf_constants = pytest.importorskip("huggingface_hub.constants")

GGUF = "org/tiny-GGUF"
README = Path(__file__).resolve().parent.parent / "README.md"
README_GGUF = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
README_HF = "Qwen/Qwen2.5-0.5B-Instruct"
SPLIT = ("tiny-Q6_K-00001-of-00002.gguf", "tiny-Q6_K-00002-of-00002.gguf")
PROMPT = "<t1><t2><t3>"  # the converted GGUF's vocabulary is `<t0>` … (gguf_convert._minimal_vocab)


def gguf_files(root: Path) -> dict[str, Path]:
    """Real GGUF files of the tiny llama: float32 and Q8_0 conversions, a two-part split file,
    and a vision projector."""
    import gguf

    f32 = gguf_convert.convert(TINY / "llama", root / "f32.gguf", "f32")
    q8 = gguf_convert.convert(TINY / "llama", root / "q8.gguf", "q8_0")
    # The same conversion in two parts, as llama.cpp's gguf-split writes a model.
    half = -(-len(gguf.GGUFReader(str(f32)).tensors) // 2)
    parts = gguf_convert.convert(TINY / "llama", root / "split.gguf", "f32", split_max_tensors=half)
    assert len(parts) == 2 and all(p.exists() for p in parts), parts
    w = gguf.GGUFWriter(str(root / "mmproj.gguf"), "clip")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"f32": f32, "q8": q8, "part1": parts[0], "part2": parts[1], "mmproj": root / "mmproj.gguf"}


def sharded(src: Path, dest: Path) -> Path:
    """`src`'s checkpoint with its weights in two shards and an index, as transformers saves
    a large model."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    (dest / "model.safetensors").unlink()
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dest / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


# Files of a safetensors repository that loading never reads: other weight formats, the
# original checkpoint Mistral-style repositories ship beside the transformers one.
EXTRA = {"pytorch_model.bin": b"\0" * 64, "flax_model.msgpack": b"\0" * 64, "onnx/model.onnx": b"\0" * 64,
         "consolidated.safetensors": b"\0" * 64, "tf_model.h5": b"\0" * 64, "README.md": b"# tiny\n"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_with_tokenizer):
    root = tmp_path_factory.mktemp("hub-files")
    made = gguf_files(root)
    made["sharded"] = sharded(tiny_with_tokenizer, root / "sharded")
    made["hf"] = tiny_with_tokenizer
    return made


@pytest.fixture(scope="module")
def server(files):
    hub = fake_hub.FakeHub()
    hf = files["hf"]
    checkpoint = {f: hf / f for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")}
    hub.add(GGUF, {"tiny-Q4_K_M.gguf": files["f32"], "tiny-Q8_0.gguf": files["q8"], SPLIT[0]: files["part1"],
                   SPLIT[1]: files["part2"], "mmproj-tiny-F16.gguf": files["mmproj"], "README.md": b"# GGUF\n"})
    hub.add(GGUF, {"tiny-Q5_K_M.gguf": files["q8"], "README.md": b"# v1\n"}, revision="v1")
    hub.add("org/several-GGUF", {"tiny-Q8_0.gguf": files["q8"], "tiny-F16.gguf": files["f32"]})
    hub.add("org/tiny", {**checkpoint, **EXTRA})
    sh = files["sharded"]
    hub.add("org/tiny-sharded", {f.name: f for f in sh.iterdir() if f.is_file()})
    hub.add("org/gated-GGUF", {"tiny-Q8_0.gguf": files["q8"]}, gated=True)
    hub.add("org/private-GGUF", {"tiny-Q8_0.gguf": files["q8"]}, private=True)
    hub.add("org/docs-only", {"README.md": b"# nothing to load\n", "notes.txt": b"x"})
    # Stand-ins for the repositories the README names, with the file names of the real ones
    # and the tiny model's content, so that the README's lines run as written.
    hub.add(README_GGUF, {"qwen2.5-0.5b-instruct-fp16.gguf": files["f32"],
                          "qwen2.5-0.5b-instruct-q4_k_m.gguf": files["f32"],
                          "qwen2.5-0.5b-instruct-q8_0.gguf": files["q8"],
                          "README.md": b"# stand-in\n", "LICENSE": b"Apache-2.0\n"})
    hub.add(README_HF, {**checkpoint, "README.md": b"# stand-in\n"})
    hub.start()
    yield hub
    hub.close()


def closed_port() -> int:
    """A port nothing listens on: connections to it are refused, as with no network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What huggingface_hub reads from the environment once, at import, and every value a test gave
# it (its modules copy some by name: huggingface_hub 0.x's file_download holds its own
# HF_HUB_CACHE, so a copy that a later import made still holds an earlier test's value).
_SETTINGS = ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN_PATH")
_GIVEN = {name: [getattr(hf_constants, name)] for name in _SETTINGS if hasattr(hf_constants, name)}


def point_at(monkeypatch, endpoint: str, home: Path, offline: bool = False) -> None:
    """huggingface_hub's endpoint, cache and offline switch for this test: in the environment,
    and in every copy its modules keep of what they read from it at import."""
    cache = home / "hub"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    values = {"ENDPOINT": endpoint,
              "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
              "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": offline, "HF_TOKEN_PATH": str(home / "token")}
    modules = [m for n, m in list(sys.modules.items()) if n == "huggingface_hub" or n.startswith("huggingface_hub.")]
    for name, given in _GIVEN.items():
        for module in modules:
            current = getattr(module, name, None)
            held = any(current is v or (type(current) is type(v) and current == v) for v in given)
            if module is hf_constants or held:
                monkeypatch.setattr(module, name, values[name])
        given.append(values[name])


@pytest.fixture
def home(tmp_path):
    """This test's HF_HOME: an empty cache."""
    return tmp_path / "hf"


@pytest.fixture
def hub(server, home, monkeypatch):
    """The fake Hub, with huggingface_hub pointed at it and at an empty cache."""
    point_at(monkeypatch, server.url, home)
    server.heal()
    with server._lock:
        server.requests.clear()
    return server


def offline(monkeypatch, server, home):
    """From here on HF_HUB_OFFLINE=1; the request log starts empty."""
    point_at(monkeypatch, server.url, home, offline=True)
    with server._lock:
        server.requests.clear()


def downloaded(server) -> set[str]:
    """The files whose content was requested (GET of a resolve URL)."""
    return {p.split("/resolve/", 1)[1].split("/", 1)[1] for p in server.paths("GET") if "/resolve/" in p}


# --- names -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["org/name", "org/name:Q4_K_M", "Org-1/Name_2.5-GGUF:q8_0", "hf.co/org/name:Q8_0",
                                  "https://huggingface.co/org/name", "huggingface.co/org/name:latest"])
def test_hub_names(name):
    assert cwhub.is_hub_name(name)


@pytest.mark.parametrize("name", ["model.gguf", "org/model.gguf", "./org/name", "/abs/org/name", "a/b/c", "name",
                                  "org/name:bad tag", "org--x/name", "org/..", "C:/models/x", ""])
def test_paths_are_not_hub_names(name):
    assert not cwhub.is_hub_name(name)
    # Neither an existing path nor a Hub name: back unchanged, for the loader's "not found".
    assert cwhub.resolve_model(name) == name


def test_a_local_path_wins_and_is_never_sent(hub, tmp_path, monkeypatch, files):
    local = tmp_path / "org" / "tiny-GGUF"
    local.mkdir(parents=True)
    shutil.copy(files["q8"], local / "x.gguf")
    monkeypatch.chdir(tmp_path)
    assert cwhub.resolve_model(GGUF) == GGUF
    assert cwhub.resolve_model(str(local / "x.gguf")) == str(local / "x.gguf")
    with pytest.raises(cw.InvalidOptionError, match="local path"):
        cwhub.resolve_model(GGUF, revision="v1")
    assert hub.requests == []


def test_importing_candlewick_does_not_import_huggingface_hub():
    code = "import sys, candlewick; print('huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- GGUF repositories -----------------------------------------------------------------------

def test_default_is_q4_k_m_and_only_that_file_is_fetched(hub, files):
    path = cwhub.resolve_model(GGUF)
    assert Path(path).name == "tiny-Q4_K_M.gguf"
    assert Path(path).read_bytes() == files["f32"].read_bytes()
    assert downloaded(hub) == {"tiny-Q4_K_M.gguf"}
    assert not any("mmproj" in p for p in hub.paths())


@pytest.mark.parametrize("name", [f"{GGUF}:q8_0", f"{GGUF}:Q8_0", f"hf.co/{GGUF}:Q8_0",
                                  f"https://huggingface.co/{GGUF}:q8_0"])
def test_the_tag_is_case_insensitive(hub, files, name):
    path = cwhub.resolve_model(name)
    assert Path(path).name == "tiny-Q8_0.gguf" and Path(path).read_bytes() == files["q8"].read_bytes()
    assert downloaded(hub) == {"tiny-Q8_0.gguf"}


def test_a_split_file_comes_whole_and_the_first_part_is_returned(hub, files):
    import gguf

    path = Path(cwhub.resolve_model(f"{GGUF}:Q6_K"))
    assert path.name == SPLIT[0]
    assert (path.parent / SPLIT[1]).read_bytes() == files["part2"].read_bytes()
    assert downloaded(hub) == set(SPLIT)
    fields = gguf.GGUFReader(str(path)).fields
    assert int(fields["split.count"].parts[-1][0]) == 2
    # It loads, from both parts: the whole file's logits.
    got = cw.ModelRuntime.load(path, device="cpu").prefill([1, 2, 3, 4]).wait().logits
    want = cw.ModelRuntime.load(files["f32"], device="cpu").prefill([1, 2, 3, 4]).wait().logits
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_unknown_tag_lists_the_available_ones(hub):
    with pytest.raises(cw.UnknownTagError) as e:
        cwhub.resolve_model(f"{GGUF}:Q2_K")
    assert e.value.available == ["Q4_K_M", "Q6_K", "Q8_0"] and e.value.tag == "Q2_K" and e.value.repo_id == GGUF
    assert GGUF in str(e.value) and "Q2_K" in str(e.value) and "Q8_0" in str(e.value)
    assert isinstance(e.value, cw.HubError) and isinstance(e.value, cw.ArtifactError)
    assert downloaded(hub) == set()


def test_several_quantizations_without_q4_k_m_need_a_tag(hub):
    with pytest.raises(cw.UnknownTagError) as e:
        cwhub.resolve_model("org/several-GGUF")
    assert e.value.available == ["F16", "Q8_0"] and e.value.tag is None
    assert "org/several-GGUF:TAG" in str(e.value)
    assert Path(cwhub.resolve_model("org/several-GGUF:f16")).name == "tiny-F16.gguf"


def test_filename_takes_a_name_or_a_glob(hub):
    assert Path(cwhub.resolve_model(GGUF, filename="*Q8_0.gguf")).name == "tiny-Q8_0.gguf"
    assert Path(cwhub.resolve_model(GGUF, filename="tiny-Q4_K_M.gguf")).name == "tiny-Q4_K_M.gguf"
    # One part named: the whole split file.
    assert Path(cwhub.resolve_model(GGUF, filename=SPLIT[1])).name == SPLIT[0]
    assert downloaded(hub) == {"tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", *SPLIT}


def test_filename_errors(hub):
    with pytest.raises(cw.UnknownFileError, match="several models") as e:
        cwhub.resolve_model(GGUF, filename="*.gguf")
    assert "tiny-Q8_0.gguf" in e.value.available and not any("mmproj" in f for f in e.value.available)
    with pytest.raises(cw.UnknownFileError, match="vision projector"):
        cwhub.resolve_model(GGUF, filename="mmproj*")
    with pytest.raises(cw.UnknownFileError, match="no GGUF model file matches"):
        cwhub.resolve_model(GGUF, filename="*Q3_K*")
    with pytest.raises(cw.InvalidOptionError, match="not both"):
        cwhub.resolve_model(f"{GGUF}:Q8_0", filename="*Q8_0.gguf")
    assert downloaded(hub) == set()


def test_revision_chooses_a_branch_or_tag(hub):
    with pytest.raises(cw.UnknownTagError):
        cwhub.resolve_model(f"{GGUF}:Q5_K_M")
    path = Path(cwhub.resolve_model(f"{GGUF}:Q5_K_M", revision="v1"))
    assert path.name == "tiny-Q5_K_M.gguf"
    commit = hub.repos[GGUF].refs["v1"]
    assert path.parent.name == commit
    # A commit id works as well, and a file of another revision is not taken.
    assert Path(cwhub.resolve_model(GGUF, revision=commit)).name == "tiny-Q5_K_M.gguf"
    with pytest.raises(cw.UnknownRevisionError, match="no revision 'v9'") as e:
        cwhub.resolve_model(GGUF, revision="v9")
    assert e.value.revision == "v9" and e.value.repo_id == GGUF


def test_ollama_latest_is_the_default(hub):
    assert Path(cwhub.resolve_model(f"hf.co/{GGUF}:latest")).name == "tiny-Q4_K_M.gguf"


# --- safetensors repositories ----------------------------------------------------------------

def test_safetensors_fetch_only_what_loading_reads(hub, files):
    path = Path(cwhub.resolve_model("org/tiny"))
    assert path.is_dir()
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert downloaded(hub) == expected
    assert {p.name for p in path.iterdir()} == expected
    # The other weight formats were never asked for, not even their metadata.
    for extra in EXTRA:
        assert not any(p.endswith("/" + extra) for p in hub.paths()), extra
    rt = cw.ModelRuntime.load(path, device="cpu")
    local = cw.ModelRuntime.load(files["hf"], device="cpu")
    assert rt.generate("t1 t2 t3", max_tokens=4, temperature=0.0).text == \
        local.generate("t1 t2 t3", max_tokens=4, temperature=0.0).text


def test_sharded_safetensors_fetch_the_index_and_its_shards(hub, files):
    path = Path(cwhub.resolve_model("org/tiny-sharded"))
    assert downloaded(hub) == {"config.json", "generation_config.json", "tokenizer.json",
                               "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                               "model-00002-of-00002.safetensors"}
    ids = [1, 2, 3, 4]
    got = cw.ModelRuntime.load(path, device="cpu").prefill(ids).wait().logits
    want = cw.ModelRuntime.load(files["hf"], device="cpu").prefill(ids).wait().logits
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_tag_on_a_safetensors_repository(hub):
    with pytest.raises(cw.UnknownTagError, match="no GGUF model files"):
        cwhub.resolve_model("org/tiny:Q4_K_M")


def test_a_repository_without_a_model(hub):
    with pytest.raises(cw.HubError, match="holds no model") as e:
        cwhub.resolve_model("org/docs-only")
    assert "README.md" in str(e.value)


# --- errors ----------------------------------------------------------------------------------

def test_unknown_repository(hub):
    with pytest.raises(cw.UnknownRepositoryError) as e:
        cwhub.resolve_model("org/missing-GGUF:Q4_K_M")
    assert e.value.repo_id == "org/missing-GGUF" and "org/missing-GGUF" in str(e.value)
    assert "HF_TOKEN" in str(e.value) and "local path" in str(e.value)


def test_gated_repository_needs_a_token_with_access(hub, monkeypatch):
    with pytest.raises(cw.GatedRepositoryError) as e:
        cwhub.resolve_model("org/gated-GGUF")
    assert "org/gated-GGUF" in str(e.value) and "tiny-Q8_0.gguf" in str(e.value) and "HF_TOKEN" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_no_access")
    with pytest.raises(cw.GatedRepositoryError):
        cwhub.resolve_model("org/gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", fake_hub.TOKEN)
    assert Path(cwhub.resolve_model("org/gated-GGUF")).name == "tiny-Q8_0.gguf"


def test_private_repository_reads_as_unknown_without_a_token(hub, monkeypatch):
    with pytest.raises(cw.UnknownRepositoryError, match="private"):
        cwhub.resolve_model("org/private-GGUF")
    monkeypatch.setenv("HF_TOKEN", fake_hub.TOKEN)
    assert Path(cwhub.resolve_model("org/private-GGUF")).name == "tiny-Q8_0.gguf"


def test_no_network_and_nothing_cached(server, home, monkeypatch):
    point_at(monkeypatch, f"http://127.0.0.1:{closed_port()}", home)
    with pytest.raises(cw.HubOfflineError) as e:
        cwhub.resolve_model(f"{GGUF}:Q8_0")
    text = str(e.value)
    assert "cannot be reached" in text and f"{GGUF}:Q8_0" in text
    assert "local path" in text and "HF_HUB_OFFLINE=1" in text


def test_no_network_falls_back_to_the_cache(hub, home, monkeypatch):
    path = cwhub.resolve_model(f"{GGUF}:Q8_0")
    point_at(monkeypatch, f"http://127.0.0.1:{closed_port()}", home)
    assert cwhub.resolve_model(f"{GGUF}:Q8_0") == path


def test_a_hub_that_is_down_falls_back_to_the_cache(hub):
    path = cwhub.resolve_model(f"{GGUF}:Q8_0")
    hub.down = 503
    assert cwhub.resolve_model(f"{GGUF}:Q8_0") == path
    with pytest.raises(cw.HubOfflineError, match="503"):
        cwhub.resolve_model(f"{GGUF}:Q4_K_M")


def nothing_partial_in_reach(home: Path, name: str) -> None:
    """No partial file where the loader could be given it: huggingface_hub writes downloads as
    `blobs/*.incomplete` (kept for resuming before 1.0, removed since) and links a file into
    its snapshot only once whole."""
    assert not list(home.rglob(name)), "a partial file was left where the loader would find it"
    assert all(p.parent.name == "blobs" for p in home.rglob("*.incomplete"))


def test_a_download_cut_off_is_an_error_and_leaves_nothing_to_load(hub, home, files, monkeypatch):
    size = files["q8"].stat().st_size
    hub.cut_off(GGUF, "tiny-Q8_0.gguf", after=size // 2)
    # huggingface_hub 1.x waits a second before each of its five attempts to take it up again.
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    with pytest.raises(cw.DownloadError) as e:
        cwhub.resolve_model(f"{GGUF}:Q8_0")
    assert e.value.repo_id == GGUF and e.value.filename == "tiny-Q8_0.gguf"
    assert GGUF in str(e.value) and "tiny-Q8_0.gguf" in str(e.value)
    nothing_partial_in_reach(home, "tiny-Q8_0.gguf")
    # Nothing is loaded from the cache either, online or off.
    offline(monkeypatch, hub, home)
    with pytest.raises(cw.HubOfflineError):
        cwhub.resolve_model(f"{GGUF}:Q8_0")
    # The network back: the same call gets the whole file.
    point_at(monkeypatch, hub.url, home)
    hub.heal()
    path = cwhub.resolve_model(f"{GGUF}:Q8_0")
    assert Path(path).read_bytes() == files["q8"].read_bytes()


def test_a_download_cut_off_once_ends_whole(hub, home, files, monkeypatch):
    size = files["q8"].stat().st_size
    hub.cut_off(GGUF, "tiny-Q8_0.gguf", after=size // 3, outage=False, times=1)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    try:
        path = cwhub.resolve_model(f"{GGUF}:Q8_0")  # huggingface_hub 1.x tries again by itself
    except cw.DownloadError:
        nothing_partial_in_reach(home, "tiny-Q8_0.gguf")
        path = cwhub.resolve_model(f"{GGUF}:Q8_0")  # 0.x resumes the partial file on the next call
    assert Path(path).read_bytes() == files["q8"].read_bytes()
    assert len([p for p in hub.paths("GET") if p.endswith("/tiny-Q8_0.gguf")]) == 2


# --- offline, from the cache -----------------------------------------------------------------

def test_offline_a_cached_model_resolves_without_any_request(hub, home, monkeypatch):
    online = {name: cwhub.resolve_model(name, **kw) for name, kw in [
        (GGUF, {}), (f"{GGUF}:q8_0", {}), (f"{GGUF}:Q6_K", {}), ("org/tiny", {}), ("org/tiny-sharded", {}),
        (f"{GGUF}:Q5_K_M", {"revision": "v1"})]}
    offline(monkeypatch, hub, home)
    assert cwhub.resolve_model(GGUF) == online[GGUF]
    assert cwhub.resolve_model(f"{GGUF}:Q8_0") == online[f"{GGUF}:q8_0"]
    assert cwhub.resolve_model(GGUF, filename="*Q8_0*") == online[f"{GGUF}:q8_0"]
    assert cwhub.resolve_model(f"{GGUF}:Q6_K") == online[f"{GGUF}:Q6_K"]
    assert cwhub.resolve_model("org/tiny") == online["org/tiny"]
    assert cwhub.resolve_model("org/tiny-sharded") == online["org/tiny-sharded"]
    assert cwhub.resolve_model(f"{GGUF}:Q5_K_M", revision="v1") == online[f"{GGUF}:Q5_K_M"]
    cw.ModelRuntime.load(online["org/tiny-sharded"], device="cpu")
    assert hub.requests == []


def test_offline_what_is_not_cached_is_a_clear_error(hub, home, monkeypatch):
    cwhub.resolve_model(f"{GGUF}:Q8_0")
    offline(monkeypatch, hub, home)
    with pytest.raises(cw.HubOfflineError) as e:
        cwhub.resolve_model(f"{GGUF}:Q4_K_M")
    assert "HF_HUB_OFFLINE" in str(e.value) and "Q4_K_M" in str(e.value) and "Q8_0" in str(e.value)
    with pytest.raises(cw.HubOfflineError, match="not in the cache"):
        cwhub.resolve_model("org/tiny")
    with pytest.raises(cw.HubOfflineError, match="not in the cache"):
        cwhub.resolve_model(GGUF, revision="v1")
    assert hub.requests == []


def test_cached_models_lists_tags_and_sizes(hub, files):
    assert cwhub.cached_models() == []
    cwhub.resolve_model(f"{GGUF}:Q8_0")
    cwhub.resolve_model(f"{GGUF}:Q6_K")
    cwhub.resolve_model("org/tiny")
    cwhub.resolve_model(f"{GGUF}:Q5_K_M", revision="v1")
    listed = {m.name: m for m in cwhub.cached_models()}
    assert set(listed) == {f"{GGUF}:Q8_0", f"{GGUF}:Q6_K", "org/tiny", f"{GGUF}:Q5_K_M (revision v1)"}
    assert listed[f"{GGUF}:Q8_0"].size == files["q8"].stat().st_size
    assert listed[f"{GGUF}:Q6_K"].files == SPLIT
    assert listed[f"{GGUF}:Q6_K"].size == files["part1"].stat().st_size + files["part2"].stat().st_size
    assert listed[f"{GGUF}:Q6_K"].path == cwhub.resolve_model(f"{GGUF}:Q6_K")
    assert listed["org/tiny"].path == cwhub.resolve_model("org/tiny")


# --- the Python API --------------------------------------------------------------------------

def test_engine_takes_a_hub_name(hub):
    with cw.Engine(GGUF, filename="*Q8_0.gguf", device="cpu", max_batch_size=1) as engine:
        assert engine.runtime.model_info["file_size"] > 0
        text = engine.submit(PROMPT, max_tokens=3, temperature=0.0).wait().text
    assert text and downloaded(hub) == {"tiny-Q8_0.gguf"}
    rt = cw.ModelRuntime.load(cwhub.resolve_model(f"{GGUF}:Q8_0"), device="cpu")
    with pytest.raises(cw.InvalidOptionError, match="filename"):
        cw.Engine(rt, filename="*Q8_0.gguf")


# The binding's hook (ModelRuntime.load resolving a Hub name through resolve_model) lands on
# the Rust side; these run as soon as its signature takes `revision`.
needs_binding = pytest.mark.skipif(
    "revision" not in (cw.ModelRuntime.load.__text_signature__ or ""),
    reason="ModelRuntime.load does not resolve Hub names yet (no filename=/revision= in its signature)")


@needs_binding
def test_model_runtime_load_by_hub_name(hub, home, monkeypatch):
    a = cw.ModelRuntime.load(f"{GGUF}:Q8_0", device="cpu")
    b = cw.ModelRuntime.load(GGUF, filename="*Q8_0.gguf", revision="main", device="cpu")
    greedy = dict(max_tokens=3, temperature=0.0)
    assert a.generate(PROMPT, **greedy).text == b.generate(PROMPT, **greedy).text
    with pytest.raises(cw.UnknownTagError):
        cw.ModelRuntime.load(f"{GGUF}:Q2_K")
    with pytest.raises(cw.UnknownRepositoryError):
        cw.ModelRuntime.load("org/missing")
    offline(monkeypatch, hub, home)
    cw.ModelRuntime.load(f"{GGUF}:Q8_0", device="cpu")
    assert hub.requests == []


@needs_binding
def test_model_runtime_load_refuses_hub_options_with_a_local_path(files):
    with pytest.raises(cw.InvalidOptionError):
        cw.ModelRuntime.load(files["q8"], revision="main")


# --- the command line ------------------------------------------------------------------------

def cli(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "candlewick", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def cli_env(endpoint: str, home: Path, **extra) -> dict:
    """The environment of a `candlewick` process: huggingface_hub pointed at `endpoint` and
    the cache under `home`, no token, quiet progress bars."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    return env


def test_pull_and_ls(hub, home):
    env = cli_env(hub.url, home)
    r = cli(env, "ls")
    assert r.returncode == 0 and "no models" in r.stderr
    r = cli(env, "pull", f"{GGUF}:q8_0")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and path.is_file() and str(home) in str(path)
    r = cli(env, "pull", "org/tiny")
    assert r.returncode == 0 and Path(r.stdout.strip(), "config.json").is_file(), r.stderr
    r = cli(env, "pull", GGUF, "--filename", SPLIT[0])
    assert r.returncode == 0 and Path(r.stdout.strip()).name == SPLIT[0], r.stderr
    r = cli(env, "ls")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "FILES"]
    row = next(line for line in lines if line.startswith(f"{GGUF}:Q8_0 "))
    assert "tiny-Q8_0.gguf" in row and " kB" in row
    assert any(line.startswith(f"{GGUF}:Q6_K ") and "(+1)" in line for line in lines)
    assert any(line.startswith("org/tiny ") for line in lines)
    listed = json.loads(cli(env, "ls", "--json").stdout)
    assert {m["name"] for m in listed} == {f"{GGUF}:Q8_0", f"{GGUF}:Q6_K", "org/tiny"}
    assert next(m for m in listed if m["name"] == f"{GGUF}:Q8_0")["path"] == str(path)


def test_pull_errors_name_the_repository_without_a_traceback(hub, home, tmp_path):
    env = cli_env(hub.url, home)
    r = cli(env, "pull", f"{GGUF}:Q2_K")
    assert r.returncode == 1 and "UnknownTagError" in r.stderr and "Q4_K_M, Q6_K, Q8_0" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli(env, "pull", "org/gated-GGUF")
    assert r.returncode == 1 and "GatedRepositoryError" in r.stderr and "Traceback" not in r.stderr
    r = cli(cli_env(f"http://127.0.0.1:{closed_port()}", home), "pull", GGUF)
    assert r.returncode == 1 and "HubOfflineError" in r.stderr and "Traceback" not in r.stderr
    r = cli(env, "pull", str(tmp_path))
    assert r.returncode != 0 and "local path" in r.stderr


def test_generate_with_a_hub_name_online_then_offline(hub, home, files):
    args = ["generate", PROMPT, "-n", "4", "--temp", "0", "-q", "--device", "cpu"]
    local = cli(cli_env(hub.url, home), *args, "-m", str(files["q8"]))
    assert local.returncode == 0, local.stderr
    online = cli(cli_env(hub.url, home), *args, "-m", f"{GGUF}:Q8_0")
    assert online.returncode == 0, online.stderr
    assert online.stdout == local.stdout and online.stdout.strip()
    with hub._lock:
        hub.requests.clear()
    off = cli(cli_env(hub.url, home, HF_HUB_OFFLINE="1"), *args, "-m", f"{GGUF}:Q8_0")
    assert off.returncode == 0 and off.stdout == local.stdout, off.stderr
    # And with no network at all (nothing listening): the cache still answers.
    gone = cli(cli_env(f"http://127.0.0.1:{closed_port()}", home), *args, "-m", f"{GGUF}:Q8_0")
    assert gone.returncode == 0 and gone.stdout == local.stdout, gone.stderr
    assert hub.requests == []


def test_generate_options_and_errors(hub, home, files):
    env = cli_env(hub.url, home)
    args = ["generate", PROMPT, "-n", "2", "--temp", "0", "-q", "--device", "cpu"]
    r = cli(env, *args, "-m", GGUF, "--filename", "*Q8_0.gguf", "--revision", "main")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = cli(env, *args, "-m", str(files["q8"]), "--revision", "v1")
    assert r.returncode == 2 and "local path" in r.stderr and "Traceback" not in r.stderr
    r = cli(env, *args, "--filename", "*Q8_0.gguf")
    assert r.returncode != 0 and "--model org/name" in r.stderr
    r = cli(env, *args, "-m", "org/missing")
    assert r.returncode == 1 and "UnknownRepositoryError" in r.stderr and "org/missing" in r.stderr


def test_serve_a_hub_name(hub, home):
    pytest.importorskip("uvicorn")
    proc, base = launch("-m", f"{GGUF}:Q8_0", env=cli_env(hub.url, home), timeout=60)
    try:
        models = get_json(base, "/v1/models")
        assert [m["id"] for m in models["data"]] == [f"{GGUF}:Q8_0"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_stubs_cover_the_hub_module():
    # Type hints are inline (hub.py is pure Python); every public name is documented.
    for name in cwhub.__all__:
        obj = getattr(cwhub, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__, name


# --- the README ------------------------------------------------------------------------------

def readme_blocks(lang: str) -> list[str]:
    """The README's blocks fenced as ```{lang} hub: those that name models on the Hub."""
    import re

    return re.findall(rf"^```{lang} hub\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_names_only_stand_in_repositories():
    import re

    text = "\n".join(readme_blocks("bash") + readme_blocks("python"))
    assert "candlewick generate -m" in text and "candlewick pull" in text and "candlewick ls" in text
    assert "HF_HUB_OFFLINE=1 candlewick generate" in text
    named = set(re.findall(r"\b(Qwen/[\w.-]+)", text))
    assert named and named <= {README_GGUF, README_HF}


def test_the_readme_hub_lines_run_as_written(hub, home):
    import shlex

    lines = [line for block in readme_blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(lines) >= 4
    for line in lines:
        argv = shlex.split(line, comments=True)
        env = cli_env(hub.url, home)
        while "=" in argv[0]:  # `VAR=value candlewick ...`
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        assert argv[0] == "candlewick"
        r = cli(env, *argv[1:])
        assert r.returncode == 0, (line, r.stderr[-2000:])
        if argv[1] == "ls":
            assert f"{README_GGUF}:Q4_K_M" in r.stdout and f"{README_GGUF}:Q8_0" in r.stdout
    assert downloaded(hub) == {"qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct-q8_0.gguf"}


@needs_binding
def test_the_readme_python_hub_block_runs_as_written(hub, home, tmp_path):
    (tmp_path / "hub_block.py").write_text("\n".join(readme_blocks("python")))
    r = subprocess.run([sys.executable, "hub_block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=cli_env(hub.url, home))
    assert r.returncode == 0, r.stderr[-3000:]
