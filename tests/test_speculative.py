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
    with pytest.raises(cw.GenerationOptionError, match="at most 64"):
        rt.generate([5, 6, 7], max_tokens=2, prompt_lookup_num_tokens=65)


def test_the_engine_speculates_for_a_request_running_alone(rt):
    """Alone, a request's steps check its guesses; beside others, its steps are batched. Either
    way its greedy output is the plain run's (a guess refused while alone leaves a pending token
    that the next batched step must feed first)."""
    prompts = [repetitive(s) for s in range(3)]
    want = [run(rt, p, temperature=0.0)[0].token_ids for p in prompts]
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_lookup_num_tokens=8)
    with cw.Engine(rt) as engine:
        alone = engine.submit(prompts[0], **greedy).wait()
        assert alone.token_ids == want[0]
        assert alone.usage["draft_tokens"] > 0
        # One starts alone and speculates, the others join mid-way and batch with it.
        first = engine.submit(prompts[1], **greedy)
        next(iter(first))
        rest = [engine.submit(p, **greedy) for p in prompts[1:]]
        assert first.wait().token_ids == want[1]
        assert [r.wait().token_ids for r in rest] == want[1:]


# --- A draft model (issue 27, item 5) ---------------------------------------------------------


def scaled_copy(src, dest, scale):
    """The tiny checkpoint with its output projection times `scale`: the same ranking of tokens,
    a sharper distribution (a confident draft, or a target whose samples repeat)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    weights = load_file(str(src / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * np.float32(scale)
    save_file(weights, str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="module")
def pair(tiny_with_tokenizer, tmp_path_factory):
    """A target and a draft that agree on the ranking of tokens but not on their probabilities:
    the draft is sharper, so its guesses are confident and some are refused."""
    root = tmp_path_factory.mktemp("draft")
    target = scaled_copy(tiny_with_tokenizer, root / "target", TARGET_SCALE)
    draft = scaled_copy(tiny_with_tokenizer, root / "draft", DRAFT_SCALE)
    return target, draft


TARGET_SCALE, DRAFT_SCALE = 4.0, 16.0


@pytest.fixture(scope="module")
def speculative(pair):
    target, draft = pair
    return cw.ModelRuntime.load(target, device="cpu", draft_model=draft)


@pytest.fixture(scope="module")
def plain(pair):
    return cw.ModelRuntime.load(pair[0], device="cpu")


@pytest.mark.parametrize("seed", range(3))
def test_draft_model_greedy_output_is_the_plain_runs(speculative, plain, pair, seed):
    prompt = np.random.default_rng(seed).integers(3, 512, size=12).tolist()
    want, want_held = run(plain, prompt, temperature=0.0)
    got, got_held = run(speculative, prompt, temperature=0.0)
    assert got.token_ids == want.token_ids and got.text == want.text
    np.testing.assert_allclose([t["logprob"] for t in got.logprobs], [t["logprob"] for t in want.logprobs],
                               rtol=0, atol=1e-4)
    assert got_held == want_held
    assert got.usage["accepted_draft_tokens"] > 0
    # Off when asked, and the draft model is named in model_info.
    off, _ = run(speculative, prompt, temperature=0.0, num_draft_tokens=0)
    assert off.token_ids == want.token_ids and off.usage.get("draft_tokens", 0) == 0
    assert speculative.model_info["draft_model"] == str(pair[1])
    assert plain.model_info["draft_model"] is None


def test_draft_model_sampling_keeps_the_distribution(speculative, plain):
    """The standard acceptance rule: over many seeds, the first two sampled tokens follow the
    model's own joint distribution (computed exactly from its logits), though drafts are both
    accepted and refused along the way."""

    prompt = np.random.default_rng(5).integers(3, 512, size=10).tolist()
    top_k = 6
    options = dict(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0, repetition_penalty=1.0)

    def top(logits):
        ids = np.argsort(-logits, kind="stable")[:top_k]
        p = np.exp(logits[ids] - logits[ids].max())
        return ids, p / p.sum()

    # The exact joint distribution of (t1, t2) under the plain model.
    plain.session.reset()
    first = plain.prefill(prompt).wait().logits[-1].astype(np.float64)
    exact = {}
    for a, pa in zip(*top(first)):
        plain.session.reset()
        second = plain.prefill(prompt + [int(a)]).wait().logits[-1].astype(np.float64)
        for b, pb in zip(*top(second)):
            exact[(int(a), int(b))] = pa * pb
    n = 2000
    counts = dict.fromkeys(exact, 0)
    drafted = accepted = 0
    for seed in range(n):
        r = speculative.generate(prompt, max_tokens=2, ignore_eos=True, seed=seed, **options)
        counts[tuple(r.token_ids)] += 1  # a pair outside the support is a KeyError: a failure
        drafted += r.usage.get("draft_tokens", 0)
        accepted += r.usage.get("accepted_draft_tokens", 0)
    # Both branches of the rule ran.
    assert 0.05 * n < accepted < drafted - 0.05 * n, (drafted, accepted)
    # Pearson's chi-square over the cells expected at least 5 times, the rest pooled.
    cells = [(n * p, counts[k]) for k, p in exact.items()]
    big = [(e, o) for e, o in cells if e >= 5]
    rest = [(e, o) for e, o in cells if e < 5]
    if rest:
        big.append((sum(e for e, _ in rest), sum(o for _, o in rest)))
    chi2 = sum((o - e) ** 2 / e for e, o in big)
    dof = len(big) - 1
    # Upper tail of chi-square by the Wilson-Hilferty approximation; fails at p < 1e-3.
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / (2 / (9 * dof)) ** 0.5
    assert z < 3.09, (chi2, dof, counts)


def test_draft_model_must_share_the_tokenizer(tiny_with_tokenizer, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_with_tokenizer, other)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(cw.InvalidOptionError, match="cannot draft for this model: token 0"):
        cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu", draft_model=other)


def test_num_draft_tokens_is_checked(speculative):
    with pytest.raises(cw.GenerationOptionError, match="num_draft_tokens must be at most 64"):
        speculative.generate([5, 6, 7], max_tokens=2, num_draft_tokens=65)
    with pytest.raises(cw.GenerationOptionError, match="num_draft_tokens"):
        speculative.generate_batch([[5, 6, 7]], max_tokens=2, num_draft_tokens=4)
