"""Weights that are NaN or infinite (issue 23): refused at load with `ArtifactError` naming the
tensor, as llama.cpp's `--check-tensors` does; `check_tensors=False` loads them anyway."""

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import candlewick as cw
from conftest import TINY
from test_gguf import default_vocab, tiny_tensors, write_tiny_gguf


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_in_a_checkpoint_is_an_artifact_error_naming_it(tmp_path, bad):
    d = tmp_path / "llama"
    shutil.copytree(TINY / "llama", d)
    weights = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].copy()
    weights[name][3, 7] = bad
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(cw.ArtifactError, match=f"`{name}`.*not finite.*check_tensors=False"):
        cw.ModelRuntime.load(d, device="cpu")
    rt = cw.ModelRuntime.load(d, device="cpu", check_tensors=False)
    assert not np.isfinite(rt.prefill([3, 4, 5]).wait().logits).all()


def test_a_finite_checkpoint_in_half_precision_loads(tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(TINY / "llama", d)
    weights = {k: v.astype(np.float16) for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(weights, str(d / "model.safetensors"))
    cw.ModelRuntime.load(d, device="cpu").prefill([3, 4]).wait()
    name = "model.embed_tokens.weight"
    weights[name][5, 1] = np.float16(np.inf)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(cw.ArtifactError, match=f"`{name}`: value {5 * weights[name].shape[1] + 1} is not finite"):
        cw.ModelRuntime.load(d, device="cpu")


def _quantized(name, ggml_type, poison):
    """`name`'s tiny weights as `ggml_type` blocks, with the scale of block 2 set to `poison`."""
    import gguf

    value = tiny_tensors(len(default_vocab()["tokens"]))[name]
    data = gguf.quants.quantize(value, ggml_type)
    flat = data.reshape(-1).view(np.uint8).copy()
    block = gguf.GGML_QUANT_SIZES[ggml_type][1]
    flat[2 * block:2 * block + 2] = np.frombuffer(np.float16(poison).tobytes(), np.uint8)
    return flat.reshape(data.shape), ggml_type


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1"])
def test_a_non_finite_block_scale_in_a_gguf_is_an_artifact_error_naming_it(tmp_path, kind):
    import gguf

    ggml_type = getattr(gguf.GGMLQuantizationType, kind)
    name = "blk.1.ffn_up.weight"
    path = write_tiny_gguf(tmp_path / "bad.gguf", raw_tensors={name: _quantized(name, ggml_type, np.nan)})
    with pytest.raises(cw.ArtifactError, match=f"`{name}`: the scale of block 2 is not finite"):
        cw.ModelRuntime.load(path, device="cpu")
    rt = cw.ModelRuntime.load(path, device="cpu", check_tensors=False)
    assert rt.model_info["num_layers"] == 2
    good = write_tiny_gguf(tmp_path / "good.gguf", raw_tensors={name: _quantized(name, ggml_type, 0.5)})
    assert np.isfinite(cw.ModelRuntime.load(good, device="cpu").prefill([3, 4]).wait().logits).all()


def test_an_infinite_float_tensor_in_a_gguf_is_an_artifact_error(tmp_path):
    name = "blk.0.attn_norm.weight"
    value = tiny_tensors(len(default_vocab()["tokens"]))[name].copy()
    value[4] = np.inf
    import gguf

    path = write_tiny_gguf(tmp_path / "bad.gguf",
                           raw_tensors={name: (value.view(np.uint8), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(cw.ArtifactError, match=f"`{name}`: value 4 is not finite"):
        cw.ModelRuntime.load(path, device="cpu")
    # De-quantized at load, the same check has run on the file's bytes first.
    with pytest.raises(cw.ArtifactError, match=name):
        cw.ModelRuntime.load(path, device="cpu", dtype="f32")


def test_the_readme_describes_the_check_it_makes():
    """The README's "Untrusted files" had said weights were not checked at all (issue 38); it must
    describe this check as the tests above hold it: finiteness only, at load, the error it raises
    and the way to skip it."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = " ".join(text.split("## Untrusted files", 1)[1].split("\n## ", 1)[0].split())
    assert "not checked for plausible values" not in section
    for fact in ("only finiteness is checked", "GGUF and safetensors", "`ArtifactError` naming the tensor",
                 "`check_tensors=False` skips it"):
        assert fact in section, fact
