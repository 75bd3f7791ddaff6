"""Run by test_ray_serve.py inside a private network namespace (only the loopback): a local Ray
instance, two candlewick replicas under Ray Serve, 16 concurrent requests over both, one
replica's process killed, and requests answered again once Ray has replaced it.
Prints one JSON line with what it saw."""

import json
import os
import signal
import sys
import threading
import time
import urllib.request

import ray
from ray import serve

from candlewick.serve.ray import application

MODEL, PORT = sys.argv[1], int(sys.argv[2])
URL = f"http://127.0.0.1:{PORT}/v1/completions"


def ask(i, timeout=120):
    body = json.dumps({"prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0.0}).encode()
    req = urllib.request.Request(URL, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, int(r.headers["X-Candlewick-Replica"]), json.loads(r.read())


def replicas_running():
    app = serve.status().applications.get("default")
    if app is None:
        return 0
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values())


ray.init(include_dashboard=False, num_cpus=4, logging_level="ERROR")
serve.start(http_options={"host": "127.0.0.1", "port": PORT})
serve.run(application(MODEL, replicas=2, num_cpus=1), route_prefix="/")

seen = {}
threads = [threading.Thread(target=lambda i=i: seen.__setitem__(i, ask(i))) for i in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=300)
answered = sum(1 for s, _, b in seen.values() if s == 200 and b["choices"][0]["text"] is not None)
pids = sorted({pid for _, pid, _ in seen.values()})

os.kill(pids[0], signal.SIGKILL)
deadline = time.time() + 180
replaced, after = False, None
while time.time() < deadline:
    time.sleep(1)
    if replicas_running() == 2:
        try:
            after = [ask(100 + k, timeout=60) for k in range(4)]
            replaced = all(s == 200 for s, _, _ in after)
        except OSError:
            replaced = False
        if replaced:
            break
print(json.dumps({"answered": answered, "replicas_seen": len(pids), "replaced": replaced,
                  "after": sorted({pid for _, pid, _ in after or []})}))
serve.shutdown()
ray.shutdown()
