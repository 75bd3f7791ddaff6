"""Bad input gets a typed exception naming the problem, and the runtime stays usable."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import candlewick as cw
from conftest import TINY

LLAMA = TINY / "llama"


@pytest.fixture
def llama_copy(tmp_path):
    dest = tmp_path / "llama"
    shutil.copytree(LLAMA, dest)
    return dest


def test_every_error_class_derives_from_the_base():
    for name in [
        "ArtifactError", "UnsupportedError", "UnsupportedArchitectureError", "UnsupportedTensorTypeError",
        "DeviceError", "SessionError", "TokenOutOfRangeError", "ContextFullError", "ObservationError",
        "TokenizerError", "InternalError",
    ]:
        assert issubclass(getattr(cw, name), cw.CandlewickError)
    assert issubclass(cw.CandlewickError, Exception)


def test_directory_without_config(tmp_path):
    with pytest.raises(cw.ArtifactError, match="config.json"):
        cw.ModelRuntime.load(tmp_path)


def test_missing_path():
    with pytest.raises(cw.ArtifactError, match="not found"):
        cw.ModelRuntime.load("/nonexistent/model")


def test_unknown_model_type(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(cw.UnsupportedArchitectureError, match="mamba"):
        cw.ModelRuntime.load(llama_copy)


def test_malformed_config(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(cw.ArtifactError, match="config.json"):
        cw.ModelRuntime.load(llama_copy)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.3, 0.5, 0.9, 0.9999])
def test_truncated_safetensors(llama_copy, fraction):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(cw.ArtifactError, match="safetensors"):
        cw.ModelRuntime.load(llama_copy)


def test_missing_tensor(llama_copy):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(cw.ArtifactError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        cw.ModelRuntime.load(llama_copy)


def test_tensor_of_wrong_shape(llama_copy):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), dtype=np.float32)
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(cw.ArtifactError, match=r"k_proj\.weight.*\[16, 64\].*\[32, 64\]"):
        cw.ModelRuntime.load(llama_copy)


def test_tensor_of_unsupported_type(llama_copy):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    tensors["model.norm.weight"] = np.zeros((64,), dtype=np.int32)
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(cw.UnsupportedTensorTypeError, match=r"model\.norm\.weight.*I32"):
        cw.ModelRuntime.load(llama_copy)


def test_unknown_dtype():
    # An argument error: a ValueError as well as a CandlewickError, naming the accepted values.
    with pytest.raises(cw.InvalidOptionError, match="dtype=`f64`.*f32, f16, bf16") as e:
        cw.ModelRuntime.load(LLAMA, dtype="f64")
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "metal", "tpu", "cuda:x"])
def test_device_the_build_lacks(device):
    built = [d for d, _ in cw.ModelRuntime.load(LLAMA, device="cpu").backend.devices()]
    if device.split(":")[0] in {d.split(":")[0] for d in built}:
        pytest.skip("this build has that device")
    with pytest.raises(cw.DeviceError, match="not available"):
        cw.ModelRuntime.load(LLAMA, device=device)


def test_token_out_of_range_leaves_session_usable():
    rt = cw.ModelRuntime.load(LLAMA, device="cpu")
    rt.prefill([3, 4, 5])
    for bad in ([512], [3, 600], [-1]):
        with pytest.raises(cw.TokenOutOfRangeError):
            rt.decode(bad)
    assert rt.session.position == 3
    fresh = cw.ModelRuntime.load(LLAMA, device="cpu")
    # Same math in a different matmul shape: equal up to float32 rounding.
    np.testing.assert_allclose(rt.decode([6]).wait().logits, fresh.prefill([3, 4, 5, 6]).wait().logits, atol=1e-5)


def test_context_full_leaves_session_as_it_was():
    rt = cw.ModelRuntime.load(LLAMA, device="cpu", max_context=8)
    assert rt.session.max_context == 8
    rt.prefill([3, 4, 5, 6, 7])
    with pytest.raises(cw.ContextFullError, match="max_context 8"):
        rt.prefill([8, 9, 10, 11])
    assert rt.session.position == 5
    rt.decode([8, 9, 10])
    assert rt.session.position == 8
    with pytest.raises(cw.ContextFullError):
        rt.decode([11])


def test_empty_step_and_bad_truncate_are_session_errors():
    rt = cw.ModelRuntime.load(LLAMA, device="cpu")
    with pytest.raises(cw.SessionError, match="no tokens"):
        rt.prefill([])
    rt.prefill([3, 4])
    with pytest.raises(cw.SessionError, match="holds only 2"):
        rt.session.truncate(5)


def test_views_cannot_be_constructed():
    for cls in (cw.Backend, cw.Session, cw.StepOutput, cw.Submission, cw.InspectedOutput, cw.ObservationSet):
        with pytest.raises(TypeError):
            cls()


def test_two_runtimes_keep_independent_sessions():
    a = cw.ModelRuntime.load(LLAMA, device="cpu")
    b = cw.ModelRuntime.load(LLAMA, device="cpu")
    a.prefill([3, 4, 5, 6])
    assert (a.session.position, b.session.position) == (4, 0)
    assert b.prefill([3]).wait().logits.shape == (1, 512)
    a.session.reset()
    assert (a.session.position, b.session.position) == (0, 1)


def test_output_of_another_runtime_is_refused():
    a = cw.ModelRuntime.load(LLAMA, device="cpu")
    b = cw.ModelRuntime.load(LLAMA, device="cpu")
    out = a.prefill([3]).wait()
    with pytest.raises(cw.SessionError, match="another runtime"):
        b.observe_output(out)


def test_views_are_bound_to_their_runtime():
    rt = cw.ModelRuntime.load(LLAMA, device="cpu")
    session = rt.session
    rt.prefill([3, 4])
    assert session.position == 2
    assert rt.backend.name == "candle" and rt.backend.device == "cpu"
