"""Seeds and deterministic mutations: safetensors, config.json, GGUF and chat templates.

Every generator takes a `random.Random` and a scratch directory and yields `Case`s; the same
seed gives the same inputs. `must_reject` marks inputs that are invalid by construction (a
silent acceptance of one of those is a defect); other mutations may be harmless.
"""

import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    from .gguf_layout import gguf_layout, patched
except ImportError:  # imported as a top-level module by runner.py, which puts tests/fuzz on sys.path
    from gguf_layout import gguf_layout, patched

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("CANDLEWICK_FIXTURES", REPO.parent / "shared" / "fixtures"))
TINY = FIXTURES / "tiny"
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


@dataclass
class Case:
    """One input: what to run, and whether it is invalid by construction."""

    family: str
    label: str
    request: dict
    must_reject: bool = False
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# Values that break parsers: huge, negative, zero, wrong type
# ------------------------------------------------------------------------------------------

INT_SPECIALS = [0, 1, -1, 2, 3, 2**31, 2**32 + 2, 10**10, 10**12, 2**63 - 1]
FLOAT_SPECIALS = [0.0, -1.0, 1e-30, 0.1, 1e308, -1e308, 0.5, 2.0**31]
TYPE_SPECIALS = ["x", None, True, [], {}, [1, 2], {"a": 1}, 1.5]


def special_values(rng, original):
    """A few hostile replacements for a config.json value."""
    pool = INT_SPECIALS + FLOAT_SPECIALS + TYPE_SPECIALS
    picks = rng.sample(pool, 4)
    if isinstance(original, bool):
        picks.append(1)
    return picks


# ------------------------------------------------------------------------------------------
# Hugging Face directories: config.json values and types, safetensors headers, truncation
# ------------------------------------------------------------------------------------------


def copy_dir(src, dest):
    dest.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dest / name)
        os.chmod(dest / name, 0o644)
    return dest


# Values that are invalid whatever the checkpoint: (key, value).
INVALID_CONFIG = [
    ("num_hidden_layers", 10**10),
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 0),
    ("head_dim", 10**12),
    ("head_dim", 0),
    ("partial_rotary_factor", 2**31),
    ("partial_rotary_factor", 0),
    ("partial_rotary_factor", 0.01),
    ("partial_rotary_factor", -1),
    ("rms_norm_eps", -1),
    ("max_position_embeddings", -1),
    ("max_position_embeddings", 0),
    ("hidden_act", 3),
    ("hidden_act", "relu6"),
    ("eos_token_id", -1),
    ("eos_token_id", 2**32 + 2),
    ("bos_token_id", "x"),
    ("num_key_value_heads", 3),
    ("vocab_size", "512"),
    ("tie_word_embeddings", "yes"),
    ("final_logit_softcapping", 1e308),
    ("attn_logit_softcapping", 0),
]


def config_cases(rng, scratch, archs, n_random):
    """Targeted invalid values on every architecture, then random replacements of any key."""
    n = 0
    for arch in archs:
        base = json.loads((TINY / arch / "config.json").read_text())
        targeted = list(INVALID_CONFIG)
        if arch == "gemma3":
            targeted += [("query_pre_attn_scalar", 0), ("sliding_window", 0), ("sliding_window_pattern", 0)]
            targeted += [("rope_parameters", {"full_attention": {"rope_theta": -1.0}})]
        if arch == "mistral":
            targeted += [("sliding_window", 0)]
        if arch == "llama":
            targeted += [
                ("rope_parameters", {"rope_theta": 0.0, "rope_type": "default"}),
                ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "linear", "factor": 0.0}),
                ("rope_parameters", {"rope_theta": -1.0, "rope_type": "default"}),
                ("num_hidden_layers", 1),  # fewer layers than the checkpoint holds
            ]
        if arch == "gemma3":
            # Gemma reads `hidden_activation`; its `hidden_act` is ignored, as in transformers.
            targeted = [(k, v) for k, v in targeted if k != "hidden_act" or not isinstance(v, str)]
        for key, value in targeted:
            cfg = dict(base)
            if key == "sliding_window_pattern":
                cfg.pop("layer_types", None)
            cfg[key] = value
            d = copy_dir(TINY / arch, scratch / f"cfg-{n}")
            (d / "config.json").write_text(json.dumps(cfg))
            n += 1
            yield Case("config.json", f"{arch} {key}={json.dumps(value)[:40]}", {"kind": "load", "path": str(d)}, True)
        keys = sorted(base)
        for _ in range(n_random):
            cfg = dict(base)
            key = rng.choice(keys)
            value = rng.choice(special_values(rng, cfg[key]) + ["<drop>"])
            if value == "<drop>":
                del cfg[key]
            else:
                cfg[key] = value
            d = copy_dir(TINY / arch, scratch / f"cfg-{n}")
            (d / "config.json").write_text(json.dumps(cfg))
            n += 1
            yield Case("config.json", f"{arch} random {key}={json.dumps(value)[:40]}", {"kind": "load", "path": str(d)})


def safetensors_parts(path):
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + hlen])
    return data, hlen, header


def write_safetensors(path, header, body, hlen_override=None):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    hlen = len(raw) if hlen_override is None else hlen_override
    path.write_bytes(struct.pack("<Q", hlen) + raw + body)


def safetensors_cases(rng, scratch, archs, n_random):
    """Header field mutations (dtype, shape, offsets, length prefix), truncations, byte flips."""
    n = 0
    for arch in archs:
        data, hlen, header = safetensors_parts(TINY / arch / "model.safetensors")
        body = data[8 + hlen :]
        names = sorted(k for k in header if k != "__metadata__")

        def emit(label, mutate, must_reject=True, raw=None):
            nonlocal n
            d = copy_dir(TINY / arch, scratch / f"st-{n}")
            n += 1
            if raw is not None:
                (d / "model.safetensors").write_bytes(raw)
            else:
                h = json.loads(json.dumps(header))
                hl = mutate(h)
                write_safetensors(d / "model.safetensors", h, body, hl)
            return Case("safetensors", f"{arch} {label}", {"kind": "load", "path": str(d)}, must_reject)

        for _ in range(n_random):
            name = rng.choice(names)
            what = rng.choice(["dtype", "shape", "offsets", "drop", "hlen", "truncate", "flip"])
            if what == "dtype":
                dt = rng.choice(["F16", "BF16", "I64", "U8", "F64", "BOOL", "Q8", ""])
                yield emit(f"{name} dtype {dt}", lambda h: h[name].__setitem__("dtype", dt) or None, dt != "F32")
            elif what == "shape":
                shape = list(header[name]["shape"])
                i = rng.randrange(len(shape))
                shape[i] = rng.choice([0, 1, 2**31, 2**62, shape[i] + 1])
                yield emit(f"{name} shape {shape}", lambda h: h[name].__setitem__("shape", shape) or None)
            elif what == "offsets":
                a, b = header[name]["data_offsets"]
                offs = rng.choice([[b, a], [a, b + 4], [a + 4, b], [0, b - a], [a, 2**62], [len(body), len(body) + b - a]])
                if offs == [a, b]:
                    continue  # the tensor already sits there: not a mutation
                yield emit(f"{name} offsets {offs}", lambda h: h[name].__setitem__("data_offsets", offs) or None)
            elif what == "drop":
                yield emit(f"drop {name}", lambda h: h.pop(name) and None)
            elif what == "hlen":
                v = rng.choice([0, 1, hlen - 1, hlen + 1, 2**62, len(data)])
                yield emit(f"header length {v}", lambda h: v)
            elif what == "truncate":
                cut = rng.randrange(len(data))
                yield emit(f"truncated at {cut}", None, raw=data[:cut])
            else:
                blob = bytearray(data)
                for _ in range(rng.randint(1, 4)):
                    blob[rng.randrange(8 + hlen)] = rng.randrange(256)
                yield emit("header byte flips", None, must_reject=False, raw=bytes(blob))
        # Path escape through a sharded index (issue class 13): must not load weights from outside.
        for target in ["/etc/passwd", "../outside.safetensors", "../" + arch + "/model.safetensors"]:
            d = scratch / f"st-{n}" / "model"
            n += 1
            d.mkdir(parents=True)
            shutil.copy(TINY / arch / "config.json", d / "config.json")
            shutil.copy(TINY / arch / "model.safetensors", d.parent / "outside.safetensors")
            (d.parent / arch).mkdir()
            shutil.copy(TINY / arch / "model.safetensors", d.parent / arch / "model.safetensors")
            index = {"metadata": {}, "weight_map": {k: target for k in names}}
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
            yield Case("safetensors", f"{arch} index points at {target}", {"kind": "load", "path": str(d)}, True)


# ------------------------------------------------------------------------------------------
# GGUF: a tiny Llama written with the gguf package, then its metadata and tensor table mutated
# ------------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 32, 4, 2, 64, 2


def gguf_vocab():
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<|bos|>", "<|eos|>", *sorted(ByteLevel.alphabet()), "\u0120t", "he", "\u0120the"]
    return tokens, [3, 3] + [1] * (len(tokens) - 2), ["\u0120 t", "h e", "\u0120t he"]


def write_gguf(path, meta_override=None, arch="llama", chat_template=None, seed=0):
    """A tiny random Llama GGUF; `meta_override` = {key: (writer method, value)} replaces keys."""
    import gguf

    tokens, types, merges = gguf_vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    md = {
        f"{arch}.context_length": ("add_uint32", 512),
        f"{arch}.embedding_length": ("add_uint32", HIDDEN),
        f"{arch}.block_count": ("add_uint32", LAYERS),
        f"{arch}.feed_forward_length": ("add_uint32", FF),
        f"{arch}.attention.head_count": ("add_uint32", HEADS),
        f"{arch}.attention.head_count_kv": ("add_uint32", KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
        f"{arch}.rope.freq_base": ("add_float32", 10000.0),
        "tokenizer.ggml.model": ("add_string", "gpt2"),
        "tokenizer.ggml.pre": ("add_string", "default"),
        "tokenizer.ggml.tokens": ("add_array", tokens),
        "tokenizer.ggml.token_type": ("add_array", types),
        "tokenizer.ggml.merges": ("add_array", merges),
        "tokenizer.ggml.bos_token_id": ("add_uint32", 0),
        "tokenizer.ggml.eos_token_id": ("add_uint32", 1),
    }
    if chat_template is not None:
        md["tokenizer.chat_template"] = ("add_string", chat_template)
    md.update(meta_override or {})
    for key, (method, value) in md.items():
        if method is None:
            continue
        if method == "add_key_value":
            value, vtype = value
            w.add_key_value(key, value, vtype)
        else:
            getattr(w, method)(key, value)

    def mat(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hd = HIDDEN // HEADS
    w.add_tensor("token_embd.weight", mat(len(tokens), HIDDEN))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm(HIDDEN))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(HEADS * hd, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(KV_HEADS * hd, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(KV_HEADS * hd, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(HIDDEN, HEADS * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm(HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(FF, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(FF, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(HIDDEN, FF))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.add_tensor("output.weight", mat(len(tokens), HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_INVALID_META = [
    ("llama.block_count", "add_uint64", 10**12),
    ("llama.block_count", "add_uint32", 0),
    ("llama.block_count", "add_int32", -1),
    ("llama.attention.key_length", "add_uint64", 10**12),
    ("llama.attention.key_length", "add_uint32", 0),
    ("llama.rope.dimension_count", "add_uint32", 0),
    ("llama.rope.dimension_count", "add_uint32", 1),
    ("llama.rope.dimension_count", "add_uint32", 1000),
    ("llama.rope.freq_base", "add_float32", 0.0),
    ("llama.rope.freq_base", "add_float32", -1.0),
    ("llama.rope.freq_base", "add_float32", float("nan")),
    ("llama.attention.layer_norm_rms_epsilon", "add_float32", -1.0),
    ("llama.attention.layer_norm_rms_epsilon", "add_float32", float("nan")),
    ("llama.context_length", "add_int32", -1),
    ("llama.attention.head_count", "add_uint32", 0),
    ("llama.attention.head_count_kv", "add_uint32", 3),
    ("llama.embedding_length", "add_uint64", 10**12),
    ("tokenizer.ggml.eos_token_id", "add_int64", -7),
    ("tokenizer.ggml.eos_token_id", "add_uint64", 2**32 + 2),
    ("general.alignment", "add_uint32", 0),
    ("general.alignment", "add_uint32", 3),
    ("general.alignment", "add_int32", -8),
    ("llama.final_logit_softcapping", "add_float32", float("inf")),
]


def gguf_cases(rng, scratch, n_random):
    """Invalid metadata, tensor-table mutations, truncations and header byte flips of a tiny GGUF."""
    n = 0

    def path():
        nonlocal n
        n += 1
        return scratch / f"g-{n}.gguf"

    for key, method, value in GGUF_INVALID_META:
        p = write_gguf(path(), {key: (method, value)})
        yield Case("gguf", f"{key}={value} ({method})", {"kind": "load", "path": str(p)}, True)
    # Mistral with a window of 0 (panicked on decode).
    p = write_gguf(path(), {"mistral.attention.sliding_window": ("add_uint32", 0)}, arch="mistral")
    yield Case("gguf", "mistral sliding_window=0", {"kind": "load", "path": str(p)}, True)

    base = write_gguf(scratch / "g-base.gguf").read_bytes()
    lay = gguf_layout(base)
    by_name = lay["tensors"]
    tens = list(by_name.values())

    def blob_case(label, blob, must_reject=True):
        p = path()
        p.write_bytes(blob)
        return Case("gguf", label, {"kind": "load", "path": str(p)}, must_reject)

    # llama.cpp's layout rules.
    yield blob_case("tensor_count one too low", patched(base, 8, "<Q", len(tens) - 1))
    yield blob_case("tensor_count one too high", patched(base, 8, "<Q", len(tens) + 1))
    yield blob_case("kv_count one too low", patched(base, 16, "<Q", len(lay["kv"]) - 1))
    q, k = by_name["blk.0.attn_q.weight"], by_name["blk.0.attn_k.weight"]
    (q_off,) = struct.unpack_from("<Q", base, q["offset"])
    yield blob_case("overlapping offsets", patched(base, k["offset"], "<Q", q_off))
    yield blob_case("misaligned offset", patched(base, k["offset"], "<Q", q_off + 4))
    dup = bytearray(base)
    dup[k["name_at"] : k["name_at"] + len(k["name"])] = q["name"].encode()
    yield blob_case("duplicate tensor names", bytes(dup))
    yield blob_case("F32 bytes labelled F16", patched(base, q["type"], "<I", 1))
    yield blob_case("F32 bytes labelled Q8_0", patched(base, by_name["blk.0.ffn_up.weight"]["type"], "<I", 8))
    yield blob_case("last tensor F32 labelled F16", patched(base, by_name["output.weight"]["type"], "<I", 1))
    for d in [0, 2**40, 2**62, 2**64 - 1]:
        yield blob_case(f"dimension {d}", patched(base, q["dims"], "<Q", d))
    for nd in [0, 5, 2**31]:
        yield blob_case(f"n_dims {nd}", patched(base, q["n_dims"], "<I", nd))
    for ty in [2, 16, 99, 2**31]:
        yield blob_case(f"tensor type {ty}", patched(base, q["type"], "<I", ty))
    for cut in [0, 4, 12, 24, 100, lay["end_of_header"] - 1, lay["end_of_header"] + 10, len(base) - 1]:
        yield blob_case(f"truncated at {cut}", base[:cut])

    kv_keys = sorted(lay["kv"])
    for _ in range(n_random):
        what = rng.choice(["kv value", "kv type", "tensor field", "flip", "truncate"])
        if what == "kv value":
            key = rng.choice(kv_keys)
            info = lay["kv"][key]
            fmt = {4: "<I", 5: "<i", 6: "<f", 10: "<Q", 11: "<q", 12: "<d", 7: "<B", 8: "<Q", 9: "<I"}.get(info["ty"])
            if fmt is None:
                continue
            value = {"<I": rng.choice([0, 1, 2**32 - 1]), "<i": rng.choice([-1, 0, 2**31 - 1]),
                     "<f": rng.choice([0.0, -1.0, float("nan"), float("inf")]), "<Q": rng.choice([0, 2**62, 2**64 - 1]),
                     "<q": rng.choice([-1, 2**62]), "<d": rng.choice([0.0, float("nan")]), "<B": rng.choice([0, 2, 255])}[fmt]
            yield blob_case(f"{key} raw value {value}", patched(base, info["value"], fmt, value), False)
        elif what == "kv type":
            key = rng.choice(kv_keys)
            ty = rng.choice([0, 4, 5, 6, 8, 9, 10, 13, 2**31])
            yield blob_case(f"{key} value type {ty}", patched(base, lay["kv"][key]["type"], "<I", ty), False)
        elif what == "tensor field":
            t = rng.choice(tens)
            field_, fmt = rng.choice([("dims", "<Q"), ("type", "<I"), ("offset", "<Q"), ("n_dims", "<I")])
            value = rng.choice([0, 1, 3, 2**31, 2**32 - 1]) if fmt == "<I" else rng.choice([0, 1, 31, 32, 2**62])
            yield blob_case(f"{t['name']} {field_}={value}", patched(base, t[field_], fmt, value), False)
        elif what == "flip":
            blob = bytearray(base)
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(lay["end_of_header"])] = rng.randrange(256)
            yield blob_case("header byte flips", bytes(blob), False)
        else:
            cut = rng.randrange(len(base))
            yield blob_case(f"truncated at {cut}", base[:cut])


# ------------------------------------------------------------------------------------------
# Chat templates: work, output and allocation bombs, and random recombinations
# ------------------------------------------------------------------------------------------

TEMPLATE_BOMBS = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% for i in range(100000000) %}x{% endfor %}",
    "{{ messages|tojson(indent=10**12) }}",
    "{{ messages|tojson(indent=2**40) }}",
    "{{ '{:>99999999999}'.format('x') }}",
    "{{ '{:.99999999999}'.format(1.5) }}",
    "{{ '%99999999999d'|format(1) }}",
    "{{ 'x' * 10**12 }}",
    "{{ ('x' * 10**7) * 10 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ range(10**12)|list|length }}",
    "{{ messages * 10**9 }}",
    "{% for m in messages %}{{ m.content * 10**8 }}{% endfor %}",
    "{{ 'a'.center(10**12) }}",
    "{{ 'a'|indent(10**12) }}",
    "{{ 'x'|center(10**12) }}",
    "{{ raise_exception('stop') }}",
    "{% if %}",
    "{{ strftime_now('%Y' * 1000) }}",
    "{{ strftime_now('%Q %-' ) }}",
]
TEMPLATE_PIECES = [
    "{{ messages|tojson(indent=N) }}", "{{ '{:>N}'.format('x') }}", "{% for i in range(N) %}x{% endfor %}",
    "{{ 'ab' * N }}", "{{ messages[0].content }}", "{{ bos_token }}", "{{ raise_exception('r') }}",
    "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ strftime_now('%d %b %Y') }}",
]


def template_cases(rng, scratch, n_random):
    """Bombs that must stop with a typed error or a bounded output, then random recombinations."""
    model = write_gguf(scratch / "template-model.gguf")
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    for src in TEMPLATE_BOMBS:
        yield Case("template", src[:60], {"kind": "template", "path": str(model), "template": src, "messages": messages})
    for _ in range(n_random):
        parts = [rng.choice(TEMPLATE_PIECES).replace("N", str(rng.choice([0, 1, 5, 10**4, 10**6, 10**9, 10**15])))
                 for _ in range(rng.randint(1, 3))]
        src = "".join(parts)
        yield Case("template", src[:60], {"kind": "template", "path": str(model), "template": src, "messages": messages})


# ------------------------------------------------------------------------------------------
# Non-finite weights (issue 23): a NaN or infinity anywhere in a float tensor or a block scale
# ------------------------------------------------------------------------------------------


def nonfinite_cases(rng, scratch, archs, n_random):
    """One NaN or infinity written over a random float of a random tensor: must be refused."""
    n = 0
    for arch in archs:
        data, hlen, header = safetensors_parts(TINY / arch / "model.safetensors")
        names = sorted(k for k in header if k != "__metadata__" and header[k]["dtype"] == "F32")
        for _ in range(max(1, n_random // 5)):
            name = rng.choice(names)
            a, b = header[name]["data_offsets"]
            at = 8 + hlen + a + 4 * rng.randrange((b - a) // 4)
            value = rng.choice([float("nan"), float("inf"), float("-inf")])
            blob = bytearray(data)
            blob[at:at + 4] = struct.pack("<f", value)
            d = copy_dir(TINY / arch, scratch / f"nf-{n}")
            n += 1
            (d / "model.safetensors").write_bytes(bytes(blob))
            yield Case("non-finite", f"{arch} {name} = {value}", {"kind": "load", "path": str(d)}, True)


# ------------------------------------------------------------------------------------------
# API calls with hostile sizes and options (issue 23): a failed call raises a typed error and
# leaves the session exactly as it was
# ------------------------------------------------------------------------------------------

HUGE = [2**31, 2**32, 2**63 - 1, 2**64 - 1, 2**64, 10**18, -1, -(2**63)]


def api_cases(rng, scratch, n_random):
    """Each case loads the tiny Llama (with a word-level tokenizer), prefills a few tokens, then
    makes one hostile call; `must_reject` calls must raise a typed error without moving the
    session (the worker checks its position and tokens)."""
    model = tiny_with_tokenizer(scratch)
    vocab = 512
    fixed = [
        # Contexts past 2^32 - 1 tokens are refused; 2^31 is a context like any other.
        ("load", {"max_context": v}, not 0 < v < 2**32) for v in HUGE + [0]
    ] + [
        ("load", {"threads": v}, True) for v in [0, -1, 2**64 - 1, 10**6]
    ] + [
        ("generate", {"logit_bias": {str(vocab + 5): 1.0}, "max_tokens": 4}, True),
        ("generate", {"logit_bias": {str(2**40): 1.0}}, True),
        ("stream", {"logit_bias": {str(vocab): 1.0}}, True),
        ("chat", {"logit_bias": {str(vocab + 1): 1.0}}, True),
        ("generate_batch", {"logit_bias": {str(vocab + 1): 1.0}}, True),
        ("engine", {"logit_bias": {str(vocab + 1): 1.0}}, True),
        ("engine", {"prompt_ids": [3, vocab]}, True),
        ("engine", {"prompt_ids": [3] * 5000}, True),
        ("load", {"max_context": 10**9, "check_tensors": False}, False),
        ("prefill", {"ids": [3, vocab + 7]}, True),
        ("prefill", {"ids": [3, -1]}, True),
        ("prefill", {"ids": [3, 2**40]}, True),
        ("prefill", {"ids": []}, True),
        # Under the worker's 4 GiB address-space cap: refused before allocating, never an abort.
        ("prefill", {"n": 3_000_000, "all_logits": True, "context": 10**9}, True),
        ("inspect_prefill", {"n": 100_000, "select": ["model.layers.0.attention.pattern"], "context": 10**9}, True),
        ("trace", {"n": 60_000, "select": ["model.layers"], "context": 10**9}, True),
        ("truncate", {"to": 10**6}, True),
        ("truncate", {"to": -1}, True),
        ("generate", {"max_tokens": -3}, True),
        ("generate", {"temperature": float("nan")}, True),
        ("generate", {"top_p": 7.0}, True),
        ("generate", {"seed": -5}, True),
        ("generate", {"logprobs": 10**9, "max_tokens": 2}, False),
        ("generate", {"max_tokens": 2**63 - 1, "context": 8}, False),
        ("unembed", {"shape": [3, 65]}, True),
        ("unembed", {"shape": [0, 64]}, False),
    ]
    for op, args, must_reject in fixed:
        yield Case("api", f"{op} {json.dumps(args)[:60]}", {"kind": "call", "path": str(model), "op": op, "args": args},
                   must_reject)
    for _ in range(n_random):
        op = rng.choice(["generate", "stream", "prefill", "decode", "truncate"])
        value = rng.choice(HUGE + [0, 1, vocab - 1, vocab, vocab + 1])
        args = {"generate": {"max_tokens": value, "context": 8},
                "stream": {"top_k": value, "max_tokens": 2},
                "prefill": {"ids": [3, value]},
                "decode": {"ids": [value]},
                "truncate": {"to": value}}[op]
        yield Case("api", f"random {op} {json.dumps(args)[:60]}",
                   {"kind": "call", "path": str(model), "op": op, "args": args})


def thread_cases(rng, scratch, n_random):
    """Several Python threads making mixed calls on one runtime: they must finish (a deadlock is
    a hang) and raise nothing but typed errors."""
    model = tiny_with_tokenizer(scratch)
    for i in range(max(2, n_random // 5)):
        seed = rng.randrange(2**31)
        yield Case("threads", f"seed {seed}",
                   {"kind": "threads", "path": str(model), "seed": seed, "threads": rng.choice([2, 3, 4]), "calls": 12})


def tiny_with_tokenizer(scratch):
    """The tiny Llama with a word-level tokenizer (`t0` … `t511`), made once per scratch dir."""
    dest = scratch / "tiny-tok"
    if not dest.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers

        shutil.copytree(TINY / "llama", dest)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(dest / "tokenizer.json"))
    return dest
