"""The child process of the fuzzer: runs one input at a time and reports how it ended.

Reads one JSON request per line on stdin, answers one JSON line on stdout. A request that kills
this process (an abort) or never answers (a hang) is classified by the parent, which starts a
new worker for the next input. The parent caps this process's address space
(RLIMIT_AS), so a huge allocation fails here instead of taking the machine down.
"""

import json
import math
import sys


def classify_exception(cw, e):
    """typed: a CandlewickError subclass (InternalError excepted: a caught bug); else untyped."""
    if isinstance(e, cw.InternalError):
        return "internal"
    if isinstance(e, cw.CandlewickError):
        return "typed"
    return "untyped"


def run_load(cw, req):
    """Loads an artifact; if it loads, prefills a few tokens and checks the logits are finite."""
    try:
        rt = cw.ModelRuntime.load(req["path"], device="cpu", dtype=req.get("dtype"))
    except BaseException as e:  # noqa: BLE001 - PanicException is a BaseException
        return {"result": classify_exception(cw, e), "error": f"{type(e).__name__}: {e}"[:400]}
    try:
        vocab = rt.model_info["vocab_size"]
        ids = [i % vocab for i in (1, 2, 3, 5, 7)]
        logits = rt.prefill(ids, all_logits=True).wait().logits
        logits2 = rt.decode([ids[0]]).wait().logits
        finite = all(math.isfinite(float(x)) for x in (logits.sum(), logits2.sum()))
        # After a successful step the session must still be usable from scratch.
        rt.session.reset()
        rt.prefill(ids[:2]).wait()
    except BaseException as e:  # noqa: BLE001
        kind = classify_exception(cw, e)
        # A file that loads and then fails its first step was accepted when it should not have been.
        return {"result": "corrupt" if kind != "typed" else "accepted-then-typed", "error": f"{type(e).__name__}: {e}"[:400]}
    if not finite:
        return {"result": "corrupt", "error": "non-finite logits"}
    return {"result": "accepted"}


_TOKENIZERS = {}


def run_template(cw, req):
    """Renders a chat template through a GGUF model's tokenizer (loaded once per worker)."""
    try:
        if req["path"] not in _TOKENIZERS:
            _TOKENIZERS[req["path"]] = cw.ModelRuntime.load(req["path"], device="cpu").tokenizer
        tok = _TOKENIZERS[req["path"]]
    except BaseException as e:  # noqa: BLE001
        return {"result": "setup-failed", "error": f"{type(e).__name__}: {e}"[:400]}
    try:
        out = tok.apply_chat_template(req["messages"], chat_template=req["template"])
    except BaseException as e:  # noqa: BLE001
        return {"result": classify_exception(cw, e), "error": f"{type(e).__name__}: {e}"[:400]}
    return {"result": "accepted", "length": len(out)}


def main():
    import candlewick as cw

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["kind"] == "load":
            res = run_load(cw, req)
        elif req["kind"] == "template":
            res = run_template(cw, req)
        else:
            res = {"result": "untyped", "error": f"unknown request kind {req['kind']}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
