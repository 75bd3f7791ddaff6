"""Regression tests of issue 10: untrusted files and templates end in typed errors.

One test (or parametrized group) per defect class; the reproductions are the issue's own. Each
would abort, hang, panic or load silently before the fix. The fuzz suite (tests/fuzz/) explores
around them; these pin the exact cases down.
"""

import json
import shutil
import struct
import threading
import time

import numpy as np
import pytest

import candlewick as cw
from conftest import TINY
from fuzz.cases import write_gguf
from fuzz.gguf_layout import gguf_layout, patched

LLAMA = TINY / "llama"
GEMMA = TINY / "gemma3"
MISTRAL = TINY / "mistral"


def hf_copy(tmp_path, src, **changes):
    """A copy of a tiny checkpoint with config.json keys replaced (None-valued `DROP` removes)."""
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    for p in dest.iterdir():
        p.chmod(0o644)
    cfg = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


DROP = object()


def gguf(tmp_path, name="m.gguf", arch="llama", **meta):
    """A tiny GGUF with metadata keys replaced: key=(gguf writer method, value)."""
    override = {k.replace("__", "."): v for k, v in meta.items()}
    return write_gguf(tmp_path / name, override, arch=arch)


# ------------------------------------------------------------------------------------------
# 1. Huge claimed sizes: a typed error before any allocation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("num_hidden_layers", 10**10, "num_hidden_layers"),
        ("head_dim", 10**12, "head_dim"),
        ("partial_rotary_factor", 2**31, "partial_rotary_factor"),
    ],
)
def test_huge_config_sizes_are_artifact_errors(tmp_path, key, value, field):
    with pytest.raises(cw.ArtifactError, match=field):
        cw.ModelRuntime.load(hf_copy(tmp_path, LLAMA, **{key: value}), device="cpu")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.key_length"])
def test_huge_gguf_sizes_are_artifact_errors(tmp_path, key):
    path = write_gguf(tmp_path / "huge.gguf", {key: ("add_uint64", 10**12)})
    with pytest.raises(cw.ArtifactError, match=key.replace(".", r"\.")):
        cw.ModelRuntime.load(path, device="cpu")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("tok") / "t.gguf")
    return cw.ModelRuntime.load(path, device="cpu").tokenizer


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "template,match",
    [
        ("{{ messages|tojson(indent=10**12) }}", "indent"),
        ("{{ messages|tojson(indent='" + " " * 1000 + "') }}", "indent"),
        ("{{ '{:>99999999999}'.format('x') }}", "width"),
        ("{{ '{:.99999999999}'.format(1.5) }}", "precision"),
        ("{{ '{:>{w}}'.format('x', w=10**12) }}", "nested"),
        ("{{ '%99999999999d'|format(1) }}", "fuel"),
        ("{{ 'a'|indent(10**12) }}", "fuel"),
    ],
)
def test_template_allocation_bombs_are_typed(tokenizer, template, match):
    with pytest.raises(cw.TokenizerError, match=match):
        tokenizer.apply_chat_template(MESSAGES, chat_template=template)


def test_reasonable_tojson_indent_and_format_still_work(tokenizer):
    out = tokenizer.apply_chat_template(
        MESSAGES, chat_template="{{ messages|tojson(indent=4) }}|{{ '{:>6}'.format('x') }}", tokenize=False
    )
    assert out == json.dumps(MESSAGES, indent=4) + "|     x"


# ------------------------------------------------------------------------------------------
# 2. Hangs: fuel, an output limit, and the GIL released while rendering
# ------------------------------------------------------------------------------------------

LOOP_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


def test_endless_template_stops_with_a_typed_error(tokenizer):
    start = time.monotonic()
    with pytest.raises(cw.TokenizerError, match="fuel"):
        tokenizer.apply_chat_template(MESSAGES, chat_template=LOOP_BOMB)
    assert time.monotonic() - start < 30


def test_template_output_is_bounded(tokenizer):
    with pytest.raises(cw.TokenizerError, match="fuel|exceeds"):
        tokenizer.apply_chat_template(MESSAGES, chat_template="{% for i in range(100) %}{{ 'x' * 10**7 }}{% endfor %}")


def test_template_renders_with_the_gil_released(tokenizer):
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    try:
        before = len(ticks)
        with pytest.raises(cw.TokenizerError):
            tokenizer.apply_chat_template(MESSAGES, chat_template=LOOP_BOMB)
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
    # The render takes a good fraction of a second; a held GIL would freeze the counter.
    assert during > 5


# ------------------------------------------------------------------------------------------
# 3. GGUF alignment: a power of two, checked before candle's reader (also on the tokenizer path)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,value", [("add_uint32", 0), ("add_uint32", 3), ("add_int32", -8), ("add_uint64", 32)])
def test_bad_alignment_is_an_artifact_error(tmp_path, method, value):
    path = write_gguf(tmp_path / "a.gguf", {"general.alignment": (method, value)})
    with pytest.raises(cw.ArtifactError, match=r"general\.alignment"):
        cw.ModelRuntime.load(path, device="cpu")


# ------------------------------------------------------------------------------------------
# 4. Values that used to panic at the first step (and poison the runtime) are load errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0, 0.1, -1, 1.5])
def test_partial_rotary_factor_out_of_range(tmp_path, factor):
    with pytest.raises(cw.ArtifactError, match="partial_rotary_factor"):
        cw.ModelRuntime.load(hf_copy(tmp_path, LLAMA, partial_rotary_factor=factor), device="cpu")


@pytest.mark.parametrize("dims", [0, 1, 1000])
def test_gguf_rope_dimension_count_out_of_range(tmp_path, dims):
    path = write_gguf(tmp_path / "r.gguf", {"llama.rope.dimension_count": ("add_uint32", dims)})
    with pytest.raises(cw.ArtifactError, match=r"rope\.dimension_count"):
        cw.ModelRuntime.load(path, device="cpu")


def test_gguf_mistral_window_of_zero(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"mistral.attention.sliding_window": ("add_uint32", 0)}, arch="mistral")
    with pytest.raises(cw.ArtifactError, match="sliding_window"):
        cw.ModelRuntime.load(path, device="cpu")


@pytest.mark.parametrize("case", [LLAMA, MISTRAL, GEMMA])
def test_hf_window_of_zero(tmp_path, case):
    if case == LLAMA:
        pytest.skip("llama has no sliding window")
    with pytest.raises(cw.ArtifactError, match="sliding_window"):
        cw.ModelRuntime.load(hf_copy(tmp_path, case, sliding_window=0), device="cpu")


def test_gemma_window_pattern_of_zero(tmp_path):
    d = hf_copy(tmp_path, GEMMA, sliding_window_pattern=0, layer_types=DROP)
    with pytest.raises(cw.ArtifactError, match="sliding_window_pattern"):
        cw.ModelRuntime.load(d, device="cpu")


# ------------------------------------------------------------------------------------------
# 7. GGUF layouts llama.cpp rejects
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    data = write_gguf(tmp_path_factory.mktemp("layout") / "base.gguf").read_bytes()
    return data, gguf_layout(data)


def _layout_mutants(data, lay):
    tens = lay["tensors"]
    q, k = tens["blk.0.attn_q.weight"], tens["blk.0.attn_k.weight"]
    (q_off,) = struct.unpack_from("<Q", data, q["offset"])
    dup = bytearray(data)
    dup[k["name_at"] : k["name_at"] + len(k["name"])] = q["name"].encode()
    return {
        "tensor_count one too low": (patched(data, 8, "<Q", len(tens) - 1), "tensor_count|bytes follow"),
        "overlapping offsets": (patched(data, k["offset"], "<Q", q_off), r"blk\.0\.attn_k\.weight"),
        "misaligned offset": (patched(data, k["offset"], "<Q", q_off + 4), r"blk\.0\.attn_k\.weight"),
        "duplicate names": (bytes(dup), "twice"),
        "F32 labelled F16": (patched(data, q["type"], "<I", 1), r"blk\.0\.attn_k\.weight"),
        "F32 labelled Q8_0": (patched(data, tens["blk.0.ffn_up.weight"]["type"], "<I", 8), r"ffn_down"),
        "last tensor labelled F16": (patched(data, tens["output.weight"]["type"], "<I", 1), "bytes follow"),
    }


@pytest.mark.parametrize(
    "label",
    ["tensor_count one too low", "overlapping offsets", "misaligned offset", "duplicate names", "F32 labelled F16",
     "F32 labelled Q8_0", "last tensor labelled F16"],
)
@pytest.mark.parametrize("dtype", [None, "f32"])
def test_gguf_layout_violations(tmp_path, base_gguf, label, dtype):
    blob, match = _layout_mutants(*base_gguf)[label]
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(cw.ArtifactError, match=match):
        cw.ModelRuntime.load(path, device="cpu", dtype=dtype)


# ------------------------------------------------------------------------------------------
# 8. Invalid hyperparameters and wrongly typed values: errors naming the field
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,changes,field",
    [
        (LLAMA, {"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}}, "rope_theta"),
        (LLAMA, {"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, "rope_theta"),
        (LLAMA, {"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 0.0}}, "factor"),
        (LLAMA, {"rms_norm_eps": -1}, "rms_norm_eps"),
        (LLAMA, {"final_logit_softcapping": 1e308}, "final_logit_softcapping"),
        (LLAMA, {"attn_logit_softcapping": 0}, "attn_logit_softcapping"),
        (GEMMA, {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        (GEMMA, {"rope_parameters": {"full_attention": {"rope_theta": -1.0}}}, "rope_theta"),
        (LLAMA, {"max_position_embeddings": -1}, "max_position_embeddings"),
        (LLAMA, {"max_position_embeddings": 0}, "max_position_embeddings"),
        (LLAMA, {"hidden_act": 3}, "hidden_act"),
        (LLAMA, {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        (LLAMA, {"vocab_size": "512"}, "vocab_size"),
        (LLAMA, {"rope_parameters": {"rope_theta": "big"}}, "rope_theta"),
        (LLAMA, {"layer_types": ["full_attention", "sideways", "full_attention"]}, "layer_types"),
    ],
)
def test_invalid_hyperparameters_name_the_field(tmp_path, case, changes, field):
    with pytest.raises(cw.ArtifactError, match=field):
        cw.ModelRuntime.load(hf_copy(tmp_path, case, **changes), device="cpu")


@pytest.mark.parametrize(
    "key,method,value",
    [
        ("llama.rope.freq_base", "add_float32", 0.0),
        ("llama.rope.freq_base", "add_float32", float("nan")),
        ("llama.attention.layer_norm_rms_epsilon", "add_float32", -1.0),
        ("llama.attention.layer_norm_rms_epsilon", "add_float32", float("nan")),
        ("llama.final_logit_softcapping", "add_float32", float("inf")),
        ("llama.context_length", "add_int32", -1),
    ],
)
def test_invalid_gguf_hyperparameters(tmp_path, key, method, value):
    path = write_gguf(tmp_path / "h.gguf", {key: (method, value)})
    with pytest.raises((cw.ArtifactError, cw.UnsupportedError), match=key.replace(".", r"\.")):
        cw.ModelRuntime.load(path, device="cpu")


def test_absent_optional_fields_take_their_defaults(tmp_path):
    d = hf_copy(tmp_path, LLAMA, rms_norm_eps=DROP, max_position_embeddings=DROP, hidden_act=DROP, head_dim=None)
    rt = cw.ModelRuntime.load(d, device="cpu")
    assert rt.model_info["context_length"] == 4096 and rt.model_info["head_dim"] == 16
    assert np.isfinite(rt.prefill([1, 2, 3]).wait().logits).all()


# ------------------------------------------------------------------------------------------
# 10. Ids misread: no wrapping or clamping to a real id; no embedding rows without tokens
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 2**32 + 2, "2", [2, -3]])
def test_hf_eos_ids_out_of_range(tmp_path, value):
    with pytest.raises(cw.ArtifactError, match="eos_token_id"):
        cw.ModelRuntime.load(hf_copy(tmp_path, LLAMA, eos_token_id=value), device="cpu")


@pytest.mark.parametrize("method,value", [("add_int64", -7), ("add_uint64", 2**32 + 2)])
def test_gguf_eos_ids_out_of_range(tmp_path, method, value):
    path = write_gguf(tmp_path / "e.gguf", {"tokenizer.ggml.eos_token_id": (method, value)})
    with pytest.raises(cw.CandlewickError, match="eos_token_id"):
        cw.ModelRuntime.load(path, device="cpu")


def test_gguf_eos_id_past_the_vocabulary_is_the_tokenizers_error(tmp_path):
    path = write_gguf(tmp_path / "e.gguf", {"tokenizer.ggml.eos_token_id": ("add_uint32", 10**6)})
    rt = cw.ModelRuntime.load(path, device="cpu")  # the model runs on ids, as with any bad vocabulary
    with pytest.raises(cw.TokenizerError, match="eos_token_id"):
        rt.tokenizer


def test_gguf_eos_of_minus_one_means_none_not_zero(tmp_path):
    path = write_gguf(tmp_path / "e.gguf", {"tokenizer.ggml.eos_token_id": ("add_int32", -1)})
    rt = cw.ModelRuntime.load(path, device="cpu")
    assert 0 not in rt.tokenizer.eos_ids


def test_gguf_embedding_rows_must_match_the_vocabulary(tmp_path):
    from fuzz.cases import gguf_vocab

    tokens, types, _ = gguf_vocab()
    path = write_gguf(
        tmp_path / "v.gguf",
        {"tokenizer.ggml.tokens": ("add_array", tokens[:-3]), "tokenizer.ggml.token_type": ("add_array", types[:-3]),
         "tokenizer.ggml.merges": ("add_array", [])},
    )
    with pytest.raises(cw.ArtifactError, match=r"token_embd\.weight.*rows"):
        cw.ModelRuntime.load(path, device="cpu")


def test_decoding_an_id_without_a_token_is_an_error(tokenizer):
    with pytest.raises(cw.TokenizerError, match="outside the tokenizer's vocabulary"):
        tokenizer.decode([2, tokenizer.vocab_size + 5])


# ------------------------------------------------------------------------------------------
# 13. Shards named by an index must lie inside the model directory
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["../outside.safetensors", "/abs/model.safetensors", "sub/../../x.safetensors", ""])
def test_index_cannot_escape_the_model_directory(tmp_path, target):
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(LLAMA / "config.json", d / "config.json")
    shutil.copy(LLAMA / "model.safetensors", tmp_path / "outside.safetensors")
    from safetensors.numpy import load_file

    names = load_file(str(LLAMA / "model.safetensors")).keys()
    if target.startswith("/abs"):
        target = str(tmp_path / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: target for n in names}}))
    with pytest.raises(cw.ArtifactError, match="weight_map"):
        cw.ModelRuntime.load(d, device="cpu")


def test_index_inside_the_directory_still_loads(tmp_path):
    d = tmp_path / "model"
    (d / "shards").mkdir(parents=True)
    shutil.copy(LLAMA / "config.json", d / "config.json")
    shutil.copy(LLAMA / "model.safetensors", d / "shards" / "part.safetensors")
    from safetensors.numpy import load_file

    names = load_file(str(LLAMA / "model.safetensors")).keys()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shards/part.safetensors" for n in names}}))
    rt = cw.ModelRuntime.load(d, device="cpu")
    assert rt.model_info["num_layers"] == 3


# ------------------------------------------------------------------------------------------
# 14. A layer count lower than the checkpoint's: unused layers are an error
# ------------------------------------------------------------------------------------------


def test_fewer_configured_layers_than_the_checkpoint_holds(tmp_path):
    with pytest.raises(cw.ArtifactError, match=r"model\.layers\.[12]\..*layer past the 1"):
        cw.ModelRuntime.load(hf_copy(tmp_path, LLAMA, num_hidden_layers=1), device="cpu")


def test_gguf_block_count_lower_than_its_blocks(tmp_path):
    path = write_gguf(tmp_path / "b.gguf", {"llama.block_count": ("add_uint32", 1)})
    with pytest.raises(cw.ArtifactError, match=r"blk\.1\."):
        cw.ModelRuntime.load(path, device="cpu")
