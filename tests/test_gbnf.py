"""GBNF grammars (issue 42, item 4): llama.cpp's own `grammars/*.gbnf` (tests/data/gbnf) load as
`grammar=`, detected or with `grammar_format="gbnf"`, and constrain a sampled generation on the
tiny llama checkpoint given a byte-level vocabulary; the CLI's `--grammar-file` and the server's
`grammar` field take them too.

Each output is checked by llguidance's Python matcher, built apart from the runtime from the same
tokenizer file: the generated ids must all be accepted by the grammar. The same check refuses the
unconstrained output of the same seed, so it can fail."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import candlewick as cw
from candlewick.grammar import is_gbnf, to_lark

from conftest import TINY

GBNF = sorted((Path(__file__).parent / "data" / "gbnf").glob("*.gbnf"))
CORPUS = [p.read_text(encoding="utf-8") for p in GBNF] + [
    "The quick brown fox jumps over the lazy dog. 1 + 2 * (3 - 4) / 5 = -0.6\n",
    '{"name": "candlewick", "list": [1, 2.5, true, false, null], "nested": {"a": "b"}}\n',
    "e4 e5 Nf3 Nc6 Bb5 a6 O-O\n- item one\n- item two\nint main() { return 0; }\n",
    "日本語のテキスト、ひらがな、カタカナ。\n",
]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """The tiny llama checkpoint (vocabulary 512) with a byte-level BPE tokenizer trained to 512
    entries on the grammars themselves, so any text can be written and the grammars' symbols
    are single tokens. Returns (directory, tokenizer.json path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Ids 0, 1, 2: the checkpoint's unk, bos and eos (config.json).
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == 512
    dest = tmp_path_factory.mktemp("tiny-bytes") / "llama"
    shutil.copytree(TINY / "llama", dest)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return dest, dest / "tokenizer.json"


@pytest.fixture(scope="module")
def rt(byte_model):
    return cw.ModelRuntime.load(byte_model[0], device="cpu")


@pytest.fixture(scope="module")
def accepts(byte_model):
    """`accepts(lark, ids)`: whether llguidance's Python matcher takes every id of `ids` under
    the grammar (a prefix of a sentence of it, or a whole one ended by eos)."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(str(byte_model[1]), n_vocab=512, eos_token=2)

    def check(lark: str, ids: list) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, lark, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(list(ids)) and not matcher.is_error()

    return check


def test_every_file_is_detected_as_gbnf_and_lark_is_not():
    assert len(GBNF) == 8, [p.name for p in GBNF]  # llama.cpp 0.3.36's grammars/
    for path in GBNF:
        assert is_gbnf(path.read_text(encoding="utf-8")), path.name
    assert not is_gbnf('start: "yes" | "no"\n')
    assert to_lark('start: "yes"\n') == 'start: "yes"\n'


@pytest.mark.parametrize("path", GBNF, ids=lambda p: p.stem)
def test_gbnf_file_constrains_a_sampled_generation(rt, accepts, path):
    text = path.read_text(encoding="utf-8")
    lark = to_lark(text)
    constrained = {}
    for seed in (1, 2):
        r = rt.generate("x", max_tokens=24, temperature=1.0, seed=seed, grammar=text)
        assert r.token_ids, path.name
        assert accepts(lark, r.token_ids), (path.name, seed, r.text)
        constrained[seed] = r.token_ids
    # The explicit format gives the same output as detection.
    again = rt.generate("x", max_tokens=24, temperature=1.0, seed=1, grammar=text, grammar_format="gbnf")
    assert again.token_ids == constrained[1]
    # Without the grammar the random model writes bytes the grammar refuses: the check can fail.
    free = rt.generate("x", max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    assert not accepts(lark, free.token_ids), (path.name, free.text)


def test_json_gbnf_output_parses_when_it_stops(rt):
    text = (GBNF[0].parent / "json.gbnf").read_text(encoding="utf-8")
    for seed in range(1, 6):
        r = rt.generate("x", max_tokens=48, temperature=1.0, seed=seed, grammar=text)
        if r.finish_reason in ("stop", "eos"):
            json.loads(r.text)


def test_bad_grammars_are_refused_before_any_step(rt):
    with pytest.raises(cw.GenerationOptionError, match="grammar: GBNF grammar"):
        rt.generate("x", max_tokens=4, grammar='root ::= "a" (')
    with pytest.raises(cw.GenerationOptionError, match="grammar_format"):
        rt.generate("x", max_tokens=4, grammar='root ::= "a"', grammar_format="ebnf")
    with pytest.raises(cw.GenerationOptionError, match="needs a grammar"):
        rt.generate("x", max_tokens=4, grammar_format="gbnf")
    # GBNF text read as Lark is a Lark error, not silently converted.
    with pytest.raises(cw.GenerationOptionError, match="Lark grammar"):
        rt.generate("x", max_tokens=4, grammar='root ::= "a"', grammar_format="lark")


def test_engine_takes_gbnf(rt, accepts):
    text = (GBNF[0].parent / "arithmetic.gbnf").read_text(encoding="utf-8")
    engine = cw.Engine(rt, max_batch_size=2)
    try:
        r = engine.submit("x", max_tokens=16, temperature=1.0, seed=3, grammar=text).wait()
        assert accepts(to_lark(text), r.token_ids), r.text
    finally:
        engine.close()


def test_cli_grammar_file(byte_model, accepts):
    path = GBNF[0].parent / "list.gbnf"
    out = subprocess.run([sys.executable, "-m", "candlewick", "generate", "x", "--model", str(byte_model[0]),
                          "--grammar-file", str(path), "-n", "12", "--temp", "1.0", "--seed", "4", "--device", "cpu",
                          "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("- "), out.stdout
