"""Speculative decoding by prompt lookup (issue 27): draft tokens copied from earlier in the
context, checked by the model in one step; output and sampling distribution unchanged."""

import numpy as np
import pytest

import candlewick as cw


@pytest.fixture
def rt(tiny_with_tokenizer):
    return cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")


def repetitive(seed, n=60):
    """A prompt that repeats itself, so lookups find drafts (and a tiny model often copies)."""
    part = np.random.default_rng(seed).integers(3, 512, size=n // 3).tolist()
    return part + part + part[: n // 6]


def run(rt, prompt, **options):
    rt.session.reset()
    r = rt.generate(prompt, max_tokens=40, ignore_eos=True, logprobs=True, **options)
    tokens_held = list(rt.session.snapshot().tokens)
    rt.session.reset()
    return r, tokens_held


@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_is_the_plain_runs(rt, seed):
    plain, held = run(rt, repetitive(seed), temperature=0.0)
    fast, fast_held = run(rt, repetitive(seed), temperature=0.0, prompt_lookup_num_tokens=8)
    assert fast.token_ids == plain.token_ids
    assert fast.text == plain.text
    # Every token's log-probability is the model's at its position, whichever step computed it.
    np.testing.assert_allclose([t["logprob"] for t in fast.logprobs], [t["logprob"] for t in plain.logprobs],
                               rtol=0, atol=1e-4)
    # The session holds what the plain run's holds: no rejected draft token is left behind.
    assert fast_held == held
    assert fast.usage["draft_tokens"] > 0


def test_drafts_are_accepted_when_the_output_copies(rt):
    # Find a prompt the tiny model continues by copying, so accepted drafts save steps.
    best = max((run(rt, repetitive(s), temperature=0.0, prompt_lookup_num_tokens=8)[0] for s in range(8)),
               key=lambda r: r.usage.get("accepted_draft_tokens", 0))
    assert best.usage["accepted_draft_tokens"] > 0


def test_sampled_output_has_the_same_distribution(rt):
    """With one seed a speculative run samples every token from the same distribution as the
    plain run, in the same order, so the outputs agree; over many seeds, so do their statistics."""
    prompt = repetitive(11)
    same = 0
    firsts = {"plain": [], "fast": []}
    for seed in range(40):
        plain, _ = run(rt, prompt, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        fast, _ = run(rt, prompt, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed,
                      prompt_lookup_num_tokens=6)
        same += plain.token_ids == fast.token_ids
        firsts["plain"] += plain.token_ids[:10]
        firsts["fast"] += fast.token_ids[:10]
    # Rows computed in one step or one at a time differ by float rounding only: an equal draw
    # almost always picks the same token.
    assert same >= 38
    assert np.mean(firsts["plain"]) == pytest.approx(np.mean(firsts["fast"]), rel=0.05)


def test_stream_and_chat_take_it_and_stop_strings_still_cut(rt):
    prompt = repetitive(3)
    plain, _ = run(rt, prompt, temperature=0.0)
    stop = plain.text.split(" ")[5]
    rt.session.reset()
    pieces = list(rt.stream(prompt, max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop,
                            prompt_lookup_num_tokens=8))
    rt.session.reset()
    want = rt.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop)
    assert "".join(pieces) == want.text


def test_refused_where_it_is_not_supported(rt):
    with pytest.raises(cw.GenerationOptionError, match="prompt_lookup_num_tokens"):
        rt.generate_batch([[5, 6, 7]], max_tokens=2, prompt_lookup_num_tokens=4)
    with cw.Engine(rt) as engine, pytest.raises(cw.GenerationOptionError, match="prompt_lookup_num_tokens"):
        engine.submit([5, 6, 7], max_tokens=2, prompt_lookup_num_tokens=4)
    with pytest.raises(cw.GenerationOptionError, match="at most 64"):
        rt.generate([5, 6, 7], max_tokens=2, prompt_lookup_num_tokens=65)
