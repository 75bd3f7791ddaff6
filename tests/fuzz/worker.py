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


def is_typed(cw, e):
    """A candlewick error (InternalError excepted), or Python's TypeError for an argument of the
    wrong type; a bare ValueError or OverflowError is not typed."""
    return (isinstance(e, cw.CandlewickError) and not isinstance(e, cw.InternalError)) or type(e) is TypeError


def call(cw, rt, op, args):
    """One API call of the `api` fuzz family."""
    n = args.get("n")
    ids = args.get("ids", [3 + i % 500 for i in range(n)] if n else None)
    sampling = {k: v for k, v in args.items()
                if k not in ("n", "to", "ids", "select", "all_logits", "shape", "prompt_ids")}
    if "logit_bias" in sampling:
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    prompt = "t3 t4 t5"
    if op == "generate":
        return rt.generate(prompt, **sampling)
    if op == "stream":
        return list(rt.stream(prompt, **sampling))
    if op == "chat":
        return rt.chat([{"role": "user", "content": prompt}], chat_template="{{ messages[0]['content'] }}", **sampling)
    if op == "generate_batch":
        return rt.generate_batch([prompt, "t6 t7"], **sampling)
    if op == "engine":
        with cw.Engine(rt) as engine:
            return engine.submit(args.get("prompt_ids", prompt), **sampling).wait()
    if op == "prefill":
        return rt.prefill(ids, all_logits=bool(args.get("all_logits"))).wait()
    if op == "decode":
        return rt.decode(ids).wait()
    if op == "inspect_prefill":
        return rt.inspect_prefill(ids, cw.ObservationRequest.select(args["select"]))
    if op == "trace":
        return rt.trace(ids, cw.ObservationRequest.select(args["select"]))
    if op == "truncate":
        return rt.session.truncate(args["to"])
    if op == "unembed":
        import numpy as np

        return rt.unembed(np.zeros(args["shape"], dtype=np.float32))
    raise ValueError(f"unknown op {op}")


def run_call(cw, req):
    """Loads the model and makes one hostile call: a failure must be typed and leave the session
    as it was; success is `accepted`."""
    args = dict(req["args"])
    context = args.pop("context", 64)
    op = req["op"]
    try:
        if op == "load":
            cw.ModelRuntime.load(req["path"], device="cpu", **args)
            return {"result": "accepted"}
        rt = cw.ModelRuntime.load(req["path"], device="cpu", max_context=context)
        rt.prefill([3, 4, 5]).wait()
    except BaseException as e:  # noqa: BLE001
        return {"result": "typed" if is_typed(cw, e) else classify_exception(cw, e),
                "error": f"{type(e).__name__}: {e}"[:400]}
    before = (rt.session.position, rt.cached_tokens())
    try:
        call(cw, rt, op, args)
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"[:400]
        if not is_typed(cw, e):
            return {"result": classify_exception(cw, e) if isinstance(e, cw.InternalError) else "untyped", "error": error}
        if (rt.session.position, rt.cached_tokens()) != before:
            return {"result": "corrupt", "error": f"the session moved on a failed call: {error}"}
        return {"result": "typed", "error": error}
    return {"result": "accepted"}


def run_threads(cw, req):
    """Threads making mixed calls on one runtime; the parent's timeout turns a deadlock into a hang."""
    import random
    import threading

    rt = cw.ModelRuntime.load(req["path"], device="cpu", max_context=256)
    errors = []

    def worker(seed):
        rnd = random.Random(seed)
        for _ in range(req["calls"]):
            op = rnd.choice(["generate", "stream", "prefill", "decode", "trace", "fork", "snapshot", "reset", "read",
                             "truncate"])
            try:
                if op == "generate":
                    rt.generate("t3 t4 t5", max_tokens=4, temperature=0.0)
                elif op == "stream":
                    for _ in rt.stream("t8 t9", max_tokens=4, temperature=0.0):
                        pass
                elif op == "prefill":
                    rt.prefill([3, 4, 5, 6]).wait()
                elif op == "decode":
                    rt.decode([7]).wait()
                elif op == "trace":
                    rt.trace([3, 4, 5])
                elif op == "fork":
                    rt.fork().generate("t3", max_tokens=2)
                elif op == "snapshot":
                    rt.session.restore(rt.session.snapshot())
                elif op == "reset":
                    rt.session.reset()
                elif op == "truncate":
                    rt.session.truncate(rnd.randrange(0, 8))
                else:
                    rt.session.position, rt.model_info, rt.cached_tokens()
            except BaseException as e:  # noqa: BLE001
                if not is_typed(cw, e):
                    errors.append(f"{op}: {type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=worker, args=(req["seed"] + i,)) for i in range(req["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        return {"result": "untyped", "error": "; ".join(errors[:3])}
    return {"result": "accepted"}


def run_image(cw, req):
    """Reads a (mutated) image file with `load_image`, then runs a small Gemma 3 processor over
    it: an ImageError is typed, any other exception untyped."""
    from candlewick.images import load_image, processor_for

    try:
        img = load_image(req["path"])
        processor_for("gemma3", {"size": {"height": 16, "width": 16}}, {}).preprocess([img])
    except BaseException as e:  # noqa: BLE001 - anything but ImageError is a finding
        return {"result": classify_exception(cw, e), "error": f"{type(e).__name__}: {e}"[:400]}
    return {"result": "accepted"}


def main():
    import candlewick as cw

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["kind"] == "load":
            res = run_load(cw, req)
        elif req["kind"] == "template":
            res = run_template(cw, req)
        elif req["kind"] == "call":
            res = run_call(cw, req)
        elif req["kind"] == "threads":
            res = run_threads(cw, req)
        elif req["kind"] == "image":
            res = run_image(cw, req)
        else:
            res = {"result": "untyped", "error": f"unknown request kind {req['kind']}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
