"""Added TTFT of two gateway code trees, measured in one run (not part of pytest).

Each tree (a checkout, e.g. ``git worktree add /tmp/base <commit>``) runs its own gateway with
one real worker (demo model, 2 slots, ``-t 1``); the script alternates, request by request,
direct-to-worker and through-the-gateway streams of 16 tokens for every tree, so machine load
hits all series alike. It prints, per tree, TTFT p50 direct, through the gateway, and the
difference (ms), and the gateway process's CPU time (user + system, from /proc via psutil)
over the measured rounds divided by their requests (ms; includes its background polling of the
worker). Speed is measured, never asserted.

``--pin workers`` puts the workers on the last CPU and this script and the gateways on the
others, as on a GPU server, where the gateway does not share its cores with the model's compute.
``--pin gateway`` puts the gateways alone on the first CPU and the workers and this script (the
client) on the others, as on a GPU server whose clients are other machines: nothing else runs
on the gateway's core between its requests. The default (``none``) leaves placement to the
kernel: on a small CPU-only machine the gateway then competes with the worker's threads and the
client.

``--templated`` sends ``/api/generate`` without ``raw``, so the gateway renders the prompt with
the model's chat template (``/apply-template``, or a shape learned by
``gateway.template_shapes``); direct requests get the worker's own render of the same chat,
fetched once, so both sides compute the same prompt.

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/overhead_ab.py /tmp/base . [-n 300] [--pin workers|gateway] [--templated]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import base_config, free_port, worker_key  # noqa: E402


def ttft(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> float:
    t0, first = time.perf_counter(), None
    with client.stream("POST", url, json=body, headers=headers or {}) as r:
        for line in r.iter_lines():
            if line and first is None:
                first = time.perf_counter() - t0
    return first


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def pin(pid: int | None, cpus: list[int]) -> None:
    """Every thread of process ``pid`` (None: this one) on ``cpus``: affinity is per thread on
    Linux, and a process's threads started before the call keep their own."""
    proc = psutil.Process(pid)
    for t in proc.threads():
        try:
            os.sched_setaffinity(t.id, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def start(root: Path, tmp: Path, i: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = base_config(port)
    cfg["models"][0].update({"slots": 2, "cpu": 1})
    path = tmp / f"gateway-{i}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "-c", str(path)], cwd=root,
                            stdout=open(tmp / f"gateway-{i}.log", "wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def ready_worker(url: str, timeout_s: float = 300) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ws = httpx.get(url + "/gateway/api/workers", timeout=2).json()["workers"]
            ready = [w for w in ws if w.get("state") == "ready"]
            if ready:
                return ready[0]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"no ready worker behind {url}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--pin", choices=("none", "workers", "gateway"), default="none",
                    help="workers: workers on the last CPU, the rest elsewhere; "
                         "gateway: gateways on the first CPU, the rest elsewhere")
    ap.add_argument("--templated", action="store_true",
                    help="/api/generate through the chat template (no raw); direct gets the "
                         "worker's render of the same chat")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="overhead-ab-"))
    gws = [start(root.resolve(), tmp, i) for i, root in enumerate(a.trees)]
    gbody = {"model": "demo", "prompt": "hello there", "raw": not a.templated,
             "options": {"num_predict": 16}}
    dbody = {"prompt": "hello there", "n_predict": 16, "stream": True}
    cpus = sorted(psutil.Process().cpu_affinity())
    if a.pin != "none" and len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    try:
        targets = []
        for proc, url in gws:
            w = ready_worker(url)
            if a.pin == "workers":
                masks = ((w["pid"], cpus[-1:]), (proc.pid, cpus[:-1]), (None, cpus[:-1]))
            elif a.pin == "gateway":
                masks = ((w["pid"], cpus[1:]), (proc.pid, cpus[:1]), (None, cpus[1:]))
            else:
                masks = ()
            for pid, mask in masks:
                pin(pid, mask)
            if a.templated:
                dbody["prompt"] = httpx.post(
                    f"http://127.0.0.1:{w['port']}/apply-template", timeout=30,
                    headers={"Authorization": f"Bearer {worker_key(w['pid'])}"},
                    json={"messages": [{"role": "user", "content": "hello there"}]}).json()["prompt"]
            targets.append((f"http://127.0.0.1:{w['port']}/completion",
                            {"Authorization": f"Bearer {worker_key(w['pid'])}"},
                            url + "/api/generate"))
        res = [([], []) for _ in targets]
        cpu = [0.0 for _ in targets]
        with httpx.Client(timeout=60) as c:
            for i in range(a.n + 30):  # 30 warm-up rounds; order alternates every round
                if i == 30:
                    cpu = [_cpu_s(proc.pid) for proc, _ in gws]
                order = list(enumerate(targets))
                for k, (durl, key, gurl) in (order if i % 2 else order[::-1]):
                    d, g = ttft(c, durl, dbody, key), ttft(c, gurl, gbody)
                    if i >= 30:
                        res[k][0].append(d)
                        res[k][1].append(g)
        cpu = [_cpu_s(proc.pid) - c0 for (proc, _), c0 in zip(gws, cpu)]
        print("| tree | TTFT p50 direct (ms) | TTFT p50 gateway (ms) | added (ms) | gateway CPU per request (ms) |")
        print("|---|---:|---:|---:|---:|")
        for root, (d, g), c_s in zip(a.trees, res, cpu):
            md, mg = statistics.median(d) * 1e3, statistics.median(g) * 1e3
            print(f"| `{root}` | {md:.3f} | {mg:.3f} | {mg - md:+.3f} | {c_s / a.n * 1e3:.3f} |")
    finally:
        for proc, _ in gws:
            proc.terminate()
        for proc, _ in gws:
            proc.wait(30)


if __name__ == "__main__":
    main()
