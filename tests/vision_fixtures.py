"""Tiny vision-language models (Gemma 3 with SigLIP, LLaVA-1.5 with CLIP, Idefics3 and SmolVLM
with SigLIP on split images) and transformers' reference outputs for them, for
tests/test_vision.py and tests/test_vision_split.py.

The checkpoints are not stored (weights stay out of git): every float32 weight is drawn from
numpy's PCG64 generator with a fixed seed, in the order of the names the checkpoint holds, so a
test rebuilds the directory without torch (`materialise`), as tests/shared_expert_fixtures.py
does. What is stored, in tests/data/vision/<case>/: `config.json` and `preprocessor_config.json`
as transformers saved them, `weights.json` (names, shapes, seed, SHA-256 of the draw),
`reference.safetensors` / `reference.json` computed by transformers from the rebuilt weights;
and, shared, a small word-level `tokenizer.json` with the image tokens and a chat template.

    python tests/vision_fixtures.py [case ...]   (needs torch and transformers 5.x)
    python tests/vision_fixtures.py gemma3-gguf  (and the gguf package)

`gemma3-gguf` writes `reference-gguf-{f32,q8_0}.safetensors`: transformers on the weights the
GGUF language model and mmproj files hold (`file_weights` reads them back and de-quantizes them:
the converter's F16 projector matrix, Q8_0 blocks), the reference the GGUF tests compare with.

The split cases (`idefics3`, `smolvlm`) run transformers' own processor for their ids and pixel
values, so they also need torchvision and Pillow (transformers' default, torchvision, image
processors: docs/images.md); their references hold `{one,two,chat}_{ids,pixel_values}` beside
the outputs. `idefics3-gguf` / `smolvlm-gguf` write only the Q8_0 reference: the F32 files hold
the drawn weights exactly. `_check_mmproj(path, outtype, case)` compares `write_mmproj`'s file
with the one `convert_hf_to_gguf.py --mmproj --outtype {f32,q8_0}` writes from `materialise(case)`
(llama-cpp-python's sdist, vendor/llama.cpp, with its own gguf-py on PYTHONPATH).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from fixture_writers import digest, draw

DATA = Path(__file__).resolve().parent / "data" / "vision"
VOCAB = 512
BOI, EOI, SOFT, LLAVA_IMAGE, SOT, EOT = 500, 501, 502, 503, 504, 505
SPECIAL = {0: "<pad>", 1: "<bos>", 2: "<eos>", 3: "<unk>", BOI: "<start_of_image>", EOI: "<end_of_image>",
           SOFT: "<image_soft_token>", LLAVA_IMAGE: "<image>", SOT: "<start_of_turn>", EOT: "<end_of_turn>"}
WORDS = ["\n\n", "\n", " ", "user", "model", "Describe", "the", "image", "What", "is", "this", "?", ".", ",",
         "a", "cat", "dog", "red", "blue", "picture", "Here", "it", "and", "of", "in"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ image_token }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # name: seed, placeholder text the chat template writes
    "gemma3": (51, "<start_of_image>"),
    "llava": (52, "<image>"),
}
# Idefics3's layout: an image split into tiles plus the whole image, each tile's tokens framed by
# `<fake_token_around_image>` and named `<row_r_col_c>` (tests/test_vision_split.py). Their
# reference ids and pixels are transformers' processor's own, not written out here.
SPLIT_CASES = {
    "idefics3": (53, "<image>"),
    "smolvlm": (54, "<image>"),
}
ALL_CASES = {**CASES, **SPLIT_CASES}
# The split families' own tokens (the tiny models split an image into at most 2 x 2 tiles), at
# ids no other token of the tiny tokenizer takes.
SPLIT_SPECIAL = {480: "<fake_token_around_image>", 481: "<global-img>", 482: "<end_of_utterance>",
                 483: "<row_1_col_1>", 484: "<row_1_col_2>", 485: "<row_2_col_1>", 486: "<row_2_col_2>"}
SPLIT_TOKENS_PER_TILE = 16


def _is_norm(name):
    return name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight", "layrnorm.weight",
                          "layer_norm1.weight", "layer_norm2.weight", "mm_soft_emb_norm.weight"))


def weights(case):
    """The checkpoint's tensors as `weights.json` says (`fixture_writers.draw`: norms 1 + 0.1·N(0, 1),
    the rest 0.1·N(0, 1)), and the SHA-256 recorded for them."""
    return draw(DATA / case, _is_norm)


def specials(case=None) -> dict:
    """The special tokens of `case`'s tokenizer (id -> text)."""
    return SPECIAL | (SPLIT_SPECIAL if case in SPLIT_CASES else {})


def tokenizer_json(case=None) -> str:
    """A word-level tokenizer: the special tokens at their ids, the words after them."""
    special = specials(case)
    vocab = {tok: i for i, tok in special.items()}
    for i, w in enumerate(WORDS):
        vocab[w] = 4 + i
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in sorted(special.items())]
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\n\\n|\\n| |[A-Za-z]+|[^A-Za-z\\s]"},
                          "behavior": "Isolated", "invert": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}}},
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    })


def tokenizer_config(case) -> dict:
    return {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE.replace("{{ image_token }}", ALL_CASES[case][1])}


def materialise(case, dest, tensors=None):
    """Writes the checkpoint directory of `case` (config, processor config, tokenizer, weights) at
    `dest`; `tensors` replaces the drawn weights (the reference scripts' GGUF-held weights)."""
    from safetensors.numpy import save_file

    if tensors is None:
        tensors, sha = weights(case)
        if digest(tensors) != sha:
            raise RuntimeError(f"{case}: numpy drew other weights than the reference was computed from")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(DATA / case / name, dest / name)
    (dest / "tokenizer.json").write_text(tokenizer_json(case))
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(case)))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def reference(case):
    """transformers' outputs for `case`."""
    from safetensors.numpy import load_file

    return load_file(str(DATA / case / "reference.safetensors"))


def draw_images() -> list:
    """Two PNG images (bytes), drawn from a seeded generator: 40 x 50 and 32 x 32."""
    from PIL import Image

    rng = np.random.default_rng(3900)
    out = []
    for h, w in ((40, 50), (32, 32)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def word_ids(text: str) -> list:
    """`text` in the tiny tokenizer's ids (words and special tokens, no BOS)."""
    import re

    vocab = {t: i for i, t in SPECIAL.items()} | {w: 4 + i for i, w in enumerate(WORDS)}
    specials = "|".join(re.escape(t) for t in SPECIAL.values())
    return [vocab.get(p, 3) for p in re.findall(f"{specials}|\\n\\n|\\n| |[A-Za-z]+|[^A-Za-z\\s]", text)]


def image_text(case, tokens: int) -> str:
    """One image's expansion as transformers' processor writes it."""
    if case == "gemma3":
        return "\n\n<start_of_image>" + "<image_soft_token>" * tokens + "<end_of_image>\n\n"
    return "<image>" * tokens


def _configs(case):
    import transformers

    if case == "gemma3":
        text = transformers.Gemma3TextConfig(**TEXT, head_dim=32, sliding_window=24, query_pre_attn_scalar=32,
                                             layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                             initializer_range=0.1)
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=32, patch_size=4,
                                                 layer_norm_eps=1e-6, vision_use_head=False)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                                           boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT)
        proc = transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32})
        return config, "Gemma3ForConditionalGeneration", proc, 16
    text = transformers.LlamaConfig(**TEXT, tie_word_embeddings=False)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=LLAVA_IMAGE,
                                      image_seq_length=16, vision_feature_layer=-2,
                                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    proc = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return config, "LlavaForConditionalGeneration", proc, 16


def _load(case, tensors=None):
    """transformers' model of `case` (float32, eager attention) on `tensors` (default: the drawn ones)."""
    import tempfile

    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(transformers, _configs(case)[1]).from_pretrained(materialise(case, tmp, tensors),
                                                                         dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def _prompts(case, tokens):
    """The ids the references run: one image, two images (each with its own block), and the chat
    the tests send through the processor glue (the template's text, expanded)."""
    one = [1] + word_ids("Describe the picture" + image_text(case, tokens) + "What is this ?")
    two = [1] + word_ids("a" + image_text(case, tokens) + "and" + image_text(case, tokens) + "red ?")
    chat = [1] + word_ids("<start_of_turn>user\n" + image_text(case, tokens) + "What is this ?<end_of_turn>\n"
                          "<start_of_turn>model\n")
    return one, two, chat


def _outputs(case, model, pixels, tokens, chat=True):
    """What the tests compare: logits of the prompts, every point of the one-image prompt
    (`one.<point>`), its greedy continuation."""
    import torch

    one, two, chat_ids = _prompts(case, tokens)
    lm = model.model.language_model
    vt = model.model.vision_tower
    obs = {}
    hooks = [lm.register_forward_pre_hook(
        lambda _m, a, kw: obs.__setitem__("model.embed_tokens", kw["inputs_embeds"][0].detach().numpy().copy()),
        with_kwargs=True)]
    for i, layer in enumerate(lm.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: obs.__setitem__(
            f"model.layers.{i}.output", (out[0] if isinstance(out, tuple) else out)[0].detach().numpy().copy())))
    for i, layer in enumerate(getattr(vt, "vision_model", vt).encoder.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: obs.__setitem__(
            f"vision.layers.{i}.output", (out[0] if isinstance(out, tuple) else out)[0].detach().numpy().copy())))
    def projector_hook(_m, a, out):
        obs["vision.output"] = a[0][0].detach().numpy().copy()
        obs["vision.projector.output"] = out[0].detach().numpy().copy()

    hooks.append(model.model.multi_modal_projector.register_forward_hook(projector_hook))

    def run(ids, pv):
        kw = {}
        if case == "gemma3":
            kw["token_type_ids"] = (torch.tensor(ids) == SOFT).long()[None]
        with torch.no_grad():
            return model(input_ids=torch.tensor(ids)[None], pixel_values=pv, use_cache=False, **kw).logits[0].numpy()

    out = {"one_logits": run(one, pixels[:1])}
    out.update({f"one.{k}": v for k, v in obs.items()})
    for h in hooks:
        h.remove()
    out["two_logits"] = run(two, pixels)
    if chat:
        out["chat_logits"] = run(chat_ids, pixels[1:])
    kw = {"token_type_ids": (torch.tensor(one) == SOFT).long()[None]} if case == "gemma3" else {}
    with torch.no_grad():
        gen = model.generate(input_ids=torch.tensor(one)[None], pixel_values=pixels[:1], max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    out["one_greedy"] = gen[0, len(one):].numpy().astype(np.int64)
    return out


def _build(case):
    import tempfile

    import torch
    import transformers
    from PIL import Image
    from safetensors.numpy import load_file, save_file

    config, model_name, proc, tokens = _configs(case)
    seed = ALL_CASES[case][0]
    dest = DATA / case
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        getattr(transformers, model_name)(config).save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        shutil.copy(Path(tmp) / "config.json", dest / "config.json")
    proc.save_pretrained(str(dest))
    spec = {"seed": seed, "tensors": [[n, list(saved[n].shape)] for n in sorted(saved)], "sha256": ""}
    (dest / "weights.json").write_text(json.dumps(spec) + "\n")
    tensors, _ = weights(case)
    spec["sha256"] = digest(tensors)
    (dest / "weights.json").write_text(json.dumps(spec) + "\n")
    model = _load(case)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in draw_images()]
    pixels = proc(images=images, return_tensors="pt")["pixel_values"].float()
    one, two, chat = _prompts(case, tokens)
    out = {"pixel_values": pixels.numpy(), "one_ids": np.array(one, np.int64), "two_ids": np.array(two, np.int64),
           "chat_ids": np.array(chat, np.int64)}
    out.update(_outputs(case, model, pixels, tokens))
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(dest / "reference.safetensors"))
    meta = {"case": case, "architecture": model_name,
            "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, float32",
            "tokens_per_image": tokens, "keys": sorted(out)}
    (dest / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(case, "->", dest, sorted(out))


# -- Idefics3 / SmolVLM: images split into tiles ---------------------------------------------------

# The prompts the split references run, as text for transformers' processor: one image, two images,
# and the chat template's rendering of one user turn with an image (which brings its own `<bos>`).
SPLIT_PROMPTS = {
    "one": ("Describe the picture<image>What is this ?", [0], True),
    "two": ("a<image>and<image>red ?", [0, 1], True),
    "chat": ("<bos><start_of_turn>user\n<image>What is this ?<end_of_turn>\n<start_of_turn>model\n", [1], False),
}


def _split_configs(case):
    """The config and image processor of a split case: SigLIP 32 x 32 tiles of 8 x 8 patches,
    pixel shuffle by 2 (16 tokens a tile), images resized to a longest edge of 64 (2 x 2 tiles)."""
    import transformers as tf

    smol = case == "smolvlm"
    text = tf.LlamaConfig(**TEXT, tie_word_embeddings=False)
    vision = (tf.SmolVLMVisionConfig if smol else tf.Idefics3VisionConfig)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=4,
        layer_norm_eps=1e-6)
    config = (tf.SmolVLMConfig if smol else tf.Idefics3Config)(
        text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2, image_token_id=LLAVA_IMAGE)
    proc = (tf.SmolVLMImageProcessor if smol else tf.Idefics3ImageProcessor)(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    arch = "SmolVLMForConditionalGeneration" if smol else "Idefics3ForConditionalGeneration"
    return config, arch, proc


def _split_processor(case, directory):
    """transformers' processor of the checkpoint at `directory`. Both cases use Idefics3Processor:
    SmolVLMProcessor lays an image's tokens out the same way (`get_image_prompt_string`) but needs
    the num2words package and a video processor."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(directory))
    ip = tf.AutoImageProcessor.from_pretrained(str(directory))
    return tf.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=SPLIT_TOKENS_PER_TILE)


def split_inputs(case, directory):
    """`{prompt: (ids, pixel_values [1, tiles, 3, 32, 32], pixel_attention_mask)}` as transformers'
    processor makes them from the two drawn images."""
    from PIL import Image

    proc = _split_processor(case, directory)
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in draw_images()]
    out = {}
    for key, (text, which, specials_added) in SPLIT_PROMPTS.items():
        enc = proc(text=[text], images=[[images[i] for i in which]], return_tensors="pt",
                   add_special_tokens=specials_added)
        out[key] = (enc["input_ids"][0], enc["pixel_values"].float(), enc["pixel_attention_mask"])
    return out


def _split_outputs(model, inputs, chat=True):
    """As `_outputs`, for a split case: every point of the one-image prompt with the tiles' rows
    stacked in order (`[tiles · rows, width]`, as candlewick returns them)."""
    import torch

    m = model.model
    obs = {}
    hooks = [m.text_model.register_forward_pre_hook(
        lambda _m, a, kw: obs.__setitem__("model.embed_tokens", kw["inputs_embeds"][0].detach().numpy().copy()),
        with_kwargs=True)]
    for i, layer in enumerate(m.text_model.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: obs.__setitem__(
            f"model.layers.{i}.output", (out[0] if isinstance(out, tuple) else out)[0].detach().numpy().copy())))

    def stacked(t):
        return t.detach().reshape(-1, t.shape[-1]).numpy().copy()

    for i, layer in enumerate(m.vision_model.encoder.layers):
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: obs.__setitem__(
            f"vision.layers.{i}.output", stacked(out[0] if isinstance(out, tuple) else out))))

    def connector_hook(_m, a, out):
        obs["vision.output"] = stacked(a[0])
        obs["vision.projector.output"] = stacked(out)

    hooks.append(m.connector.register_forward_hook(connector_hook))

    def run(key):
        ids, pv, mask = inputs[key]
        with torch.no_grad():
            return model(input_ids=ids[None], pixel_values=pv, pixel_attention_mask=mask,
                         use_cache=False).logits[0].numpy()

    out = {"one_logits": run("one")}
    out.update({f"one.{k}": v for k, v in obs.items()})
    for h in hooks:
        h.remove()
    out["two_logits"] = run("two")
    if chat:
        out["chat_logits"] = run("chat")
    ids, pv, mask = inputs["one"]
    with torch.no_grad():
        gen = model.generate(input_ids=ids[None], pixel_values=pv, pixel_attention_mask=mask, max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out["one_greedy"] = gen[0, len(ids):].numpy().astype(np.int64)
    return out


def _load_split(case, tensors=None):
    """transformers' model of a split case (float32, eager attention) on `tensors`."""
    import tempfile

    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(transformers, _split_configs(case)[1]).from_pretrained(materialise(case, tmp, tensors),
                                                                               dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def _build_split(case):
    import tempfile

    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    config, model_name, proc = _split_configs(case)
    dest = DATA / case
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        getattr(transformers, model_name)(config).save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        shutil.copy(Path(tmp) / "config.json", dest / "config.json")
    proc.save_pretrained(str(dest))
    spec = {"seed": ALL_CASES[case][0], "tensors": [[n, list(saved[n].shape)] for n in sorted(saved)], "sha256": ""}
    (dest / "weights.json").write_text(json.dumps(spec) + "\n")
    tensors, _ = weights(case)
    spec["sha256"] = digest(tensors)
    (dest / "weights.json").write_text(json.dumps(spec) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        inputs = split_inputs(case, materialise(case, tmp))
    out = {}
    for key, (ids, pv, _) in inputs.items():
        out[f"{key}_ids"] = ids.numpy().astype(np.int64)
        out[f"{key}_pixel_values"] = pv.numpy()
    out.update(_split_outputs(_load_split(case), inputs))
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(dest / "reference.safetensors"))
    meta = {"case": case, "architecture": model_name,
            "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, float32",
            "processor": "Idefics3Processor (image_seq_len 16) over " + type(proc).__name__,
            "tokens_per_tile": SPLIT_TOKENS_PER_TILE,
            "tiles": {k: int(v[1].shape[1]) for k, v in inputs.items()}, "keys": sorted(out)}
    (dest / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(case, "->", dest, meta["tiles"], sorted(out))


# -- GGUF: the language model (tests/gguf_convert.py) and llama.cpp's mmproj ---------------------

TEXT_ARCH = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM"), "llava": ("llama", "LlamaForCausalLM"),
             "idefics3": ("llama", "LlamaForCausalLM"), "smolvlm": ("llama", "LlamaForCausalLM")}


def _text_name(case, name):
    """The language model's name of a checkpoint tensor (`model.…`, `lm_head.…`), or None for the
    vision tower's and the projector's."""
    if case in SPLIT_CASES:
        if name.startswith("model.text_model."):
            return "model." + name[len("model.text_model."):]
        return name if name.startswith("lm_head.") else None
    return name[len("language_model."):] if name.startswith("language_model.") else None


def _text_dir(case, src, dest):
    """The language model of `src` as a text checkpoint (config, `model.*` and `lm_head.*`
    tensors) for tests/gguf_convert.py, which converts text models."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((Path(src) / "config.json").read_text())
    model_type, arch = TEXT_ARCH[case]
    text = {**cfg["text_config"], "model_type": model_type, "architectures": [arch]}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(text))
    t = load_file(str(Path(src) / "model.safetensors"))
    save_file({_text_name(case, k): v for k, v in t.items() if _text_name(case, k)}, str(dest / "model.safetensors"))
    return dest


def _vocab(w, cfg, case=None):
    """Departure (as tests/gguf_convert.py's): the tiny tokenizer is word-level, which the
    converter cannot write; a SentencePiece-style list of its tokens is, the special ones named
    as the checkpoint's (llama.cpp and candlewick find `<image_soft_token>` / `<image>` by name)."""
    special = specials(case)
    names = dict(special) | {4 + i: f"<w{i}>" for i in range(len(WORDS))}
    n = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([names.get(i, f"<t{i}>") for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([3 if i in special else 1 for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_mmproj(case, src, dest, outtype="f32"):
    """llama.cpp's mmproj GGUF of the tiny checkpoint at `src`, key for key and tensor for tensor
    as llama.cpp's converters write it (checked against their own output by `_check_mmproj`):

    - Gemma 3: `convert_hf_to_gguf.py --mmproj` (conversion/gemma.py's `Gemma3VisionModel`): the
      soft-embedding norm + 1, the input projection in F16, 2-D encoder weights in `outtype`;
    - Idefics3 / SmolVLM: `convert_hf_to_gguf.py --mmproj` (conversion/smolvlm.py's
      `SmolVLMModel`): the embeddings in F32, the other 2-D weights and the projection
      `mm.model.fc` in `outtype`;
    - LLaVA-1.5: `tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py --llava-projector
      --clip-model-is-vision --use-f32` (the current converter takes no CLIP encoder): only the
      layers up to the one the projector reads, no post-LayerNorm, CLIP's fc1 named `ffn_down`
      and fc2 `ffn_up`, the patch embedding and the projector matrices in F16 (`outtype` f32 only)."""
    import gguf

    cfg = json.loads((Path(src) / "config.json").read_text())
    v = cfg["vision_config"]
    tensors, _ = weights(case)
    w = gguf.GGUFWriter(str(dest), "clip")
    if case != "llava":
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])
        w.add_bool("clip.has_vision_encoder", True)
        w.add_uint32("clip.vision.projection_dim", cfg["text_config"]["hidden_size"])
        sizes = (("image_size", v["image_size"]), ("patch_size", v["patch_size"]),
                 ("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                 ("block_count", v["num_hidden_layers"]), ("attention.head_count", v["num_attention_heads"]))
        for key, value in sizes:
            w.add_uint32(f"clip.vision.{key}", value)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        if case == "gemma3":
            w.add_string("clip.projector_type", "gemma3")
            w.add_float32("clip.vision.attention.layer_norm_epsilon", v.get("layer_norm_eps", 1e-6))
            w.add_bool("clip.use_gelu", True)
            side = int(cfg["mm_tokens_per_image"] ** 0.5)
            w.add_uint32("clip.vision.projector.scale_factor", (v["image_size"] // v["patch_size"]) // side)
        else:
            # conversion/smolvlm.py's `SmolVLMModel`: the processor's longest edge goes along.
            pre = json.loads((Path(src) / "preprocessor_config.json").read_text())
            w.add_string("clip.projector_type", "idefics3")
            w.add_float32("clip.vision.attention.layer_norm_epsilon", v.get("layer_norm_eps", 1e-5))
            w.add_uint32("clip.vision.projector.scale_factor", cfg.get("scale_factor", 2))
            w.add_bool("clip.use_gelu", True)
            w.add_uint32("clip.vision.preproc_image_size", pre.get("size", {}).get("longest_edge", v["image_size"]))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    else:
        assert outtype == "f32", "the LLaVA converter writes f32 (--use-f32) or f16"
        for key in ("has_text_encoder", "has_vision_encoder", "has_llava_projector"):
            w.add_bool(f"clip.{key}", key != "has_text_encoder")
        w.add_file_type(0)
        w.add_name(Path(src).name)
        w.add_description("image encoder for LLaVA")
        w.add_string("clip.projector_type", "mlp")
        for key, value in (("image_size", v["image_size"]), ("patch_size", v["patch_size"]),
                           ("embedding_length", v["hidden_size"]), ("feed_forward_length", v["intermediate_size"]),
                           ("projection_dim", v["projection_dim"]), ("attention.head_count", v["num_attention_heads"])):
            w.add_uint32(f"clip.vision.{key}", value)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", v["layer_norm_eps"])
        w.add_uint32("clip.vision.block_count", v["num_hidden_layers"] - 1)
        # The converter's defaults (OpenAI CLIP's): it reads no processor for a vision-only CLIP.
        w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
        w.add_bool("clip.use_gelu", v["hidden_act"] == "gelu")
    for name, _, t, dtype in _mmproj_tensors(case, tensors, v["num_hidden_layers"], outtype):
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, np.float32), dtype), raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _mmproj_tensors(case, tensors, layers, outtype):
    """The mmproj's tensors: (GGUF name, Hugging Face name, the array written, its type)."""
    import gguf

    T = gguf.GGMLQuantizationType
    q = {"f32": T.F32, "q8_0": T.Q8_0}[outtype]
    proj = "multi_modal_projector."
    if case in SPLIT_CASES:
        tower = "model.vision_model."
        layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
                 "self_attn.k_proj": "attn_k", "self_attn.out_proj": "attn_out", "self_attn.q_proj": "attn_q",
                 "self_attn.v_proj": "attn_v"}
        out = [("mm.model.fc.weight", "model.connector.modality_projection.proj.weight", None, q),
               ("v.patch_embd.bias", tower + "embeddings.patch_embedding.bias", None, T.F32),
               ("v.patch_embd.weight", tower + "embeddings.patch_embedding.weight", None, T.F32),
               ("v.position_embd.weight", tower + "embeddings.position_embedding.weight", None, T.F32)]
        end = [("v.post_ln.bias", tower + "post_layernorm.bias", None, T.F32),
               ("v.post_ln.weight", tower + "post_layernorm.weight", None, T.F32)]
    elif case == "gemma3":
        layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
                 "self_attn.k_proj": "attn_k", "self_attn.out_proj": "attn_out", "self_attn.q_proj": "attn_q",
                 "self_attn.v_proj": "attn_v"}
        out = [("mm.input_projection.weight", proj + "mm_input_projection_weight", None, T.F16),
               ("mm.soft_emb_norm.weight", proj + "mm_soft_emb_norm.weight", np.float32(1), T.F32),
               ("v.patch_embd.bias", "vision_tower.embeddings.patch_embedding.bias", None, T.F32),
               ("v.patch_embd.weight", "vision_tower.embeddings.patch_embedding.weight", None, T.F32),
               ("v.position_embd.weight", "vision_tower.embeddings.position_embedding.weight", None, T.F32)]
        end = [("v.post_ln.bias", "vision_tower.post_layernorm.bias", None, T.F32),
               ("v.post_ln.weight", "vision_tower.post_layernorm.weight", None, T.F32)]
    else:
        # The legacy converter's own renaming (fc1 → ffn_down); its last layer is dropped.
        layer = {"layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up",
                 "self_attn.k_proj": "attn_k", "self_attn.out_proj": "attn_out", "self_attn.q_proj": "attn_q",
                 "self_attn.v_proj": "attn_v"}
        layers -= 1
        out = [(f"mm.{k}.{kind}", f"{proj}linear_{k // 2 + 1}.{kind}", None, T.F16 if kind == "weight" else T.F32)
               for k in (0, 2) for kind in ("bias", "weight")]
        out += [("v.class_embd", "vision_tower.embeddings.class_embedding", None, T.F32),
                ("v.patch_embd.weight", "vision_tower.embeddings.patch_embedding.weight", None, T.F16),
                ("v.position_embd.weight", "vision_tower.embeddings.position_embedding.weight", None, T.F32),
                ("v.pre_ln.weight", "vision_tower.pre_layrnorm.weight", None, T.F32),
                ("v.pre_ln.bias", "vision_tower.pre_layrnorm.bias", None, T.F32)]
        end = []
    for i in range(layers):
        for hf, gg in layer.items():
            for kind in ("bias", "weight"):
                name = (f"model.vision_model.encoder.layers.{i}.{hf}.{kind}" if case in SPLIT_CASES
                        else f"vision_tower.encoder.layers.{i}.{hf}.{kind}")
                out.append((f"v.blk.{i}.{gg}.{kind}", name, None, q if tensors[name].ndim == 2 else T.F32))
    out += end
    # Gemma's soft-embedding norm is stored with its 1 added, as the converter does.
    return [(g, h, tensors[h] if add is None else tensors[h] + add, dtype) for g, h, add, dtype in out]


def file_weights(case, lm, mmproj):
    """The checkpoint's tensors (Hugging Face names) as the GGUF files `lm` and `mmproj` hold them:
    read back with the `gguf` package and de-quantized (the F16 projector matrices, Q8_0 blocks),
    the converters' transforms undone (Gemma's norms, stored in F32 with 1 added, are checked and
    given back as drawn; Llama's q/k rows are put back in Hugging Face's order). Tensors the files
    do not hold (LLaVA's last CLIP layer and post-LayerNorm, which its outputs never read) stay
    as drawn."""
    import gguf

    import gguf_convert

    tensors, _ = weights(case)
    cfg = json.loads((DATA / case / "config.json").read_text())
    text = cfg["text_config"]
    def read(path):
        return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}

    files = {**read(lm), **read(mmproj)}
    held = {h: (g, written) for g, h, written, _ in
            _mmproj_tensors(case, tensors, cfg["vision_config"]["num_hidden_layers"], "f32")}
    arch = gguf_convert.ARCH[TEXT_ARCH[case][0]]
    names = gguf.get_tensor_name_map(gguf_convert._arch_enum(arch), text["num_hidden_layers"])
    rows = {}  # file row -> Hugging Face row, for the permuted q/k
    for hname, t in tensors.items():
        short = _text_name(case, hname)
        if short is None:
            continue
        gname = names.get_name(short, try_suffixes=(".weight", ".bias"))
        if case == "gemma3" and hname.endswith("norm.weight"):
            t = t + np.float32(1)
        if case != "gemma3" and hname.endswith(("q_proj.weight", "k_proj.weight")):
            kv = text["num_attention_heads"] if "q_proj" in hname else text["num_key_value_heads"]
            rows[hname] = gguf_convert._permute(np.arange(len(t))[:, None], text["num_attention_heads"], kv).ravel()
            t = t[rows[hname]]
        held[hname] = (gname, t)
    assert len(files) == len(held), (sorted(files), sorted(held))
    out = dict(tensors)
    for hname, (gname, written) in held.items():
        got = files[gname].reshape(written.shape)
        if hname in rows:
            back = np.empty_like(got)
            back[rows[hname]] = got
            got = back
        elif not np.array_equal(written, tensors[hname]):  # stored with Gemma's 1 added, in F32
            assert np.array_equal(got, written), f"{gname}: the file holds another value than the converter wrote"
            got = tensors[hname]
        out[hname] = np.ascontiguousarray(got, np.float32)
    return out


def gguf_reference(case, outtype):
    """transformers' outputs on the weights the GGUF files of `outtype` hold (`_build_gguf`). The
    split cases' F32 files hold the drawn weights exactly (their converter stores every matrix
    in F32, `_build_gguf` checks it), so their reference is the checkpoint's own."""
    from safetensors.numpy import load_file

    if case in SPLIT_CASES and outtype == "f32":
        return reference(case)
    return load_file(str(DATA / case / f"reference-gguf-{outtype}.safetensors"))


def _build_gguf(case):
    """`reference-gguf-{f32,q8_0}.safetensors`: transformers run on `file_weights` of the files
    `write_gguf` writes, so the reference holds what the files hold (llama.cpp's converter stores
    the projector matrix in F16 whatever `--outtype`, llama.cpp issue 13025)."""
    import tempfile

    import torch
    import transformers
    from safetensors.numpy import save_file

    ref = reference(case)
    split = case in SPLIT_CASES
    if split:
        # transformers' processor's ids and pixels, as the reference stored them (every tile whole).
        inputs = {k: (torch.from_numpy(ref[f"{k}_ids"]), torch.from_numpy(ref[f"{k}_pixel_values"]),
                      torch.ones(ref[f"{k}_pixel_values"].shape[:2] + ref[f"{k}_pixel_values"].shape[3:],
                                 dtype=torch.int64)) for k in SPLIT_PROMPTS}
    else:
        pixels = torch.from_numpy(ref["pixel_values"])
        tokens = json.loads((DATA / case / "reference.json").read_text())["tokens_per_image"]
    for outtype in ("f32", "q8_0"):
        with tempfile.TemporaryDirectory() as tmp:
            lm, mmproj = write_gguf(case, materialise(case, Path(tmp) / "hf"), Path(tmp) / "gguf", outtype)
            tensors = file_weights(case, lm, mmproj)
        drawn, _ = weights(case)
        changed = sorted(k for k in drawn if not np.array_equal(drawn[k], tensors[k]))
        if split and outtype == "f32":
            assert not changed, f"{case}: the F32 files hold other weights than the drawn ones: {changed}"
            print(case, outtype, "hold the drawn weights: reference.safetensors is their reference")
            continue
        if split:
            out = _split_outputs(_load_split(case, tensors), inputs, chat=False)
        else:
            out = _outputs(case, _load(case, tensors), pixels, tokens, chat=False)
        if outtype != "f32":
            out = {k: out[k] for k in ("one_logits", "two_logits")}
        dest = DATA / case / f"reference-gguf-{outtype}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(dest),
                  metadata={"reference": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                                         f"eager attention, float32, on the weights the {outtype} GGUF files hold",
                            "rounded": ",".join(changed) if len(changed) < 4 else f"{len(changed)} tensors"})
        print(case, outtype, "->", dest, f"{len(changed)} tensors differ from the drawn ones:", changed[:4])


def write_gguf(case, src, dest, outtype="f32"):
    """`(language model GGUF, mmproj GGUF)` of the checkpoint at `src`, written under `dest`."""
    import gguf_convert

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    text = _text_dir(case, src, dest / "text")
    keep = gguf_convert._minimal_vocab
    gguf_convert._minimal_vocab = lambda w, cfg: _vocab(w, cfg, case)
    try:
        lm = gguf_convert.convert(text, dest / f"model-{outtype}.gguf", outtype=outtype)
    finally:
        gguf_convert._minimal_vocab = keep
    # LLaVA's converter writes no Q8_0: its mmproj stays float32 beside a Q8_0 language model.
    mm = "f32" if case == "llava" else outtype
    return lm, write_mmproj(case, src, dest / f"mmproj-{mm}.gguf", mm)


def _check_mmproj(converted, outtype, case="gemma3"):
    """Our mmproj equals llama.cpp's converter's (`converted`) in every key and tensor. (LLaVA:
    the legacy converter needs transformers 4, whose `CLIPVisionModel` has `.vision_model`, and
    a CLIP directory and projector file cut from the checkpoint as `llava_surgery` does.)"""
    import tempfile

    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        src = materialise(case, Path(tmp) / "clip")
        ours = gguf.GGUFReader(str(write_mmproj(case, src, Path(tmp) / "m.gguf", outtype)))
        theirs = gguf.GGUFReader(str(converted))
        # The converter names the file after its folder (and counts those keys in GGUF.kv_count).
        skip = {"general.name", "general.size_label", "GGUF.kv_count"}
        keys = lambda r: {k: (f.types, [f.parts[i].tolist() for i in f.data]) for k, f in r.fields.items()
                          if k not in skip}
        a, b = keys(ours), keys(theirs)
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        ta = {t.name: (t.tensor_type, bytes(t.data)) for t in ours.tensors}
        tb = {t.name: (t.tensor_type, bytes(t.data)) for t in theirs.tensors}
        assert ta == tb, [k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k)]
    print("mmproj", outtype, "equals the converter's")


if __name__ == "__main__":
    for name in sys.argv[1:] or ALL_CASES:
        if name.endswith("-gguf"):
            _build_gguf(name[: -len("-gguf")])
        elif name in SPLIT_CASES:
            _build_split(name)
        else:
            _build(name)
