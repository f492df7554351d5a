"""Routing policies on real llama-server workers (CPU here), beside the simulator's prediction
of the same runs (not part of pytest; run by hand, under the benchmark lock):

    flock /tmp/bench.lock python tests/bench/real_policies.py --clients 12   # all; merges into --json
    flock /tmp/bench.lock python tests/bench/real_policies.py --policies 1,2   # some (see --help)
    python tests/bench/real_policies.py --report        # the tables of --json again
    python tests/bench/real_policies.py --resim         # simulator side again (new profile)

Workload: a closed loop of ``--clients`` streaming clients for ``--duration`` seconds, each
sending its next ``/api/generate`` (raw prompt of a few tokens, ``num_predict`` uniform in
20..400; the demo model never stops early on such a prompt) when the previous one ends.
Fleet: 2 CPU workers × ``--slots`` slots, ``-t 1`` each. Policies: ``POLICY_RUNS`` of
``gateway/simulator/report.py`` (the same labels as the simulated comparison) without the
oracle, each run's options given to the real gateway as ``scheduler.policy``,
``prefix_affinity`` and ``affinity_wait_ms_per_1k_tokens``; the Ollama-like baseline is ONE
worker with the same total slots (2 × ``--slots``), ``-t 1``, behind the gateway's FIFO queue
(policy ``pack``; one worker makes every policy the same): one runner on one core, as the
simulator's baseline is one runner on GPU 0.

Measured at the client: TTFT (request sent → first NDJSON chunk with text), e2e (→ last
chunk), generated tokens from each response's ``eval_count``; tokens/s counts tokens inside
[warm-up, duration], spreading each request's tokens evenly between its first and last chunk.
The simulator runs the same closed loop (``gateway.simulator.workload.ClosedLoop``, prompt
lengths from the real responses' ``prompt_eval_count``) with the profile of ``--profile``.
CPU seconds of the workers, the gateway process and this load generator are read with psutil:
on this 2-core machine the gateway and the clients take CPU from the two ``-t 1`` workers,
which the simulator does not model.
"""

import argparse
import concurrent.futures as cf
import json
import random
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.simulator.engine import Result, simulate  # noqa: E402
from gateway.simulator.report import POLICY_RUNS  # noqa: E402
from gateway.simulator.worker import GpuProfile  # noqa: E402
from gateway.simulator.workload import ClosedLoop  # noqa: E402
from tests.bench.real_bench import pct  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402

RUNS = [r for r in POLICY_RUNS if r[1] != "oracle"]
OUT_LEN = (20, 400)


def one_request(c: httpx.Client, url: str, prompt: str, n: int, t0: float) -> dict:
    body = {"model": "demo", "prompt": prompt, "raw": True, "stream": True,
            "options": {"num_predict": n}}
    sent = time.perf_counter()
    first = last = None
    with c.stream("POST", url + "/api/generate", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            msg = json.loads(line)
            if first is None and msg.get("response"):
                first = time.perf_counter()
            last = msg
    end = time.perf_counter()
    return {"sent": sent - t0, "first": (first or end) - t0, "end": end - t0,
            "tokens": last.get("eval_count", 0), "prompt": last.get("prompt_eval_count", 0),
            "asked": n}


def closed_loop(url: str, clients: int, duration: float, seed: int = 7) -> list[dict]:
    """``clients`` threads, each one request at a time until ``duration`` s have passed."""
    t0 = time.perf_counter()

    def client(cid: int) -> list[dict]:
        rng = random.Random(seed * 1000 + cid)
        recs, i = [], 0
        with httpx.Client(timeout=600) as c:
            while time.perf_counter() - t0 < duration:
                recs.append(one_request(c, url, f"story {cid} {i}", rng.randint(*OUT_LEN), t0))
                i += 1
        return recs

    with cf.ThreadPoolExecutor(clients) as ex:
        return [r for rs in ex.map(client, range(clients)) for r in rs]


def window_tokens(recs: list[dict], lo: float, hi: float) -> float:
    """Tokens generated inside [lo, hi], each request's spread evenly over first..end."""
    tot = 0.0
    for r in recs:
        span = r["end"] - r["first"]
        if span <= 0:
            tot += r["tokens"] if lo <= r["end"] <= hi else 0
            continue
        tot += r["tokens"] * max(0.0, min(hi, r["end"]) - max(lo, r["first"])) / span
    return tot


def cpu_s(procs: list[psutil.Process]) -> float:
    tot = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            tot += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return tot


def real_run(tmp: Path, policy: str, kw: dict, slots: int, clients: int, duration: float,
             warmup: float) -> dict:
    cfg = base_config(free_port(), scheduler={
        "policy": policy, "prefix_affinity": kw.get("affinity", True),
        "affinity_wait_ms_per_1k_tokens": kw.get("affinity_wait_ms_per_1k_tokens", 0.0)})
    cfg["models"][0].update(slots=slots, context=2048)
    if kw.get("single_runner"):
        cfg["models"][0].update(cpu=1, slots=2 * slots)
    gw = start_gateway(tmp, cfg)
    try:
        workers = [psutil.Process(w["pid"]) for w in gw.workers()]
        groups = {"workers": workers, "gateway": [psutil.Process(gw.proc.pid)],
                  "clients": [psutil.Process()]}
        before = {k: cpu_s(v) for k, v in groups.items()}
        t0 = time.perf_counter()
        recs = closed_loop(gw.url, clients, duration)
        wall = time.perf_counter() - t0
        cores = {k: (cpu_s(v) - before[k]) / wall for k, v in groups.items()}
    finally:
        gw.stop()
    short = sum(1 for r in recs if r["tokens"] != r["asked"])
    meas = [r for r in recs if r["sent"] >= warmup]
    return {"throughput": window_tokens(recs, warmup, duration) / (duration - warmup),
            "ttft": [r["first"] - r["sent"] for r in meas],
            "e2e": [r["end"] - r["sent"] for r in meas], "requests": len(recs),
            "short_outputs": short, "prompt_range": [min(r["prompt"] for r in recs),
                                                    max(r["prompt"] for r in recs)],
            "cores": cores, "wall_s": wall}


def sim_run(profile: GpuProfile, policy: str, kw: dict, slots: int, clients: int,
            duration: float, warmup: float, prompt_range: tuple[int, int]) -> dict:
    single = kw.get("single_runner", False)
    res: Result = simulate(ClosedLoop(clients, duration, prompt_len=tuple(prompt_range),
                                      out_len=OUT_LEN, seed=7),
                           n_workers=2, profile=profile, slots=2 * slots if single else slots,
                           n_ctx=2048, policy=policy, warmup_s=warmup, **kw)
    return {"throughput": res.throughput, "ttft": res.ttft, "e2e": res.e2e,
            "requests": res.completed}


def summary(r: dict) -> dict:
    return {"tokens_s": r["throughput"], "ttft_p50": pct(r["ttft"], 50),
            "ttft_p99": pct(r["ttft"], 99), "e2e_p99": pct(r["e2e"], 99)}


def report(doc: dict) -> str:
    runs = doc["runs"]
    s = doc["settings"]
    head = (f"{s['clients']} closed-loop streaming clients, {s['duration']:.0f} s per run "
            f"(first {s['warmup']:.0f} s not counted), outputs uniform {OUT_LEN[0]}..{OUT_LEN[1]} "
            f"tokens, raw prompts of a few tokens; 2 CPU workers × {s['slots']} slots, -t 1 each; "
            f"simulator profile `{s['profile']}`")
    out = [f"#### Real workers: policies ({head})", "",
           "| policy | tokens/s | TTFT p50 ms | TTFT p99 ms | e2e p99 s | requests | "
           "CPU cores: workers / gateway / clients | tokens per worker CPU-second |",
           "|---|---:|---:|---:|---:|---:|---|---:|"]
    for label, _, _ in RUNS:
        if label not in runs:
            continue
        r = runs[label]["real"]
        c = r["cores"]
        out.append(f"| {label} | {r['tokens_s']:,.0f} | {r['ttft_p50'] * 1000:.1f} | "
                   f"{r['ttft_p99'] * 1000:.1f} | {r['e2e_p99']:.2f} | {r['requests']} | "
                   f"{c['workers']:.2f} / {c['gateway']:.2f} / {c['clients']:.2f} | "
                   f"{r['tokens_s'] / c['workers']:,.0f} |")
    out += ["", "#### Simulator vs real (same workload; ratio = sim / real; CPU-share ratio = "
            "sim tokens/s × the workers' measured CPU cores per worker / real)", "",
            "| policy | tokens/s real | sim | ratio | CPU-share ratio | TTFT p50 ms real | sim | "
            "ratio | TTFT p99 ms real | sim | ratio | e2e p99 s real | sim | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, _, kw in RUNS:
        if label not in runs:
            continue
        r, m = runs[label]["real"], runs[label]["sim"]
        share = r["cores"]["workers"] / (1 if kw.get("single_runner") else 2)
        cells = []
        for k, scale, fmt in (("tokens_s", 1, ",.0f"), ("ttft_p50", 1000, ".1f"),
                              ("ttft_p99", 1000, ".1f"), ("e2e_p99", 1, ".2f")):
            ratio = m[k] / r[k] if r[k] else float("nan")
            cells += [f"{r[k] * scale:{fmt}}", f"{m[k] * scale:{fmt}}", f"{ratio:.2f}"]
            if k == "tokens_s":
                cells.append(f"{m[k] * share / r[k]:.2f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="all",
                    help="indices into RUNS (" + ", ".join(f"{i}: {r[0]}" for i, r in
                                                          enumerate(RUNS)) + ") or 'all'")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--duration", type=float, default=45.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--profile", default="docs/calibration/cpu-demo.json")
    ap.add_argument("--json", default=None,
                    help="results file (default docs/calibration/real_policies_c{clients}.json); "
                         "runs are merged into it by policy label")
    ap.add_argument("--report", action="store_true", help="only print the tables of --json")
    ap.add_argument("--resim", action="store_true",
                    help="redo only the simulator side of the runs in --json (e.g. after a new "
                         "calibration), then print the tables")
    a = ap.parse_args()
    path = Path(a.json or f"docs/calibration/real_policies_c{a.clients}.json")
    settings = {"clients": a.clients, "slots": a.slots, "duration": a.duration,
                "warmup": a.warmup, "profile": a.profile}
    doc = json.loads(path.read_text()) if path.exists() else {}
    if a.report or a.resim:
        a.clients, a.slots, a.duration, a.warmup = (doc["settings"][k] for k in
                                                    ("clients", "slots", "duration", "warmup"))
    elif doc.get("settings") != settings:
        doc = {"settings": settings, "runs": {}}  # other settings: start a new file
    if a.resim:
        profile = GpuProfile.from_json(a.profile)
        doc["settings"]["profile"] = a.profile
        for label, pol, kw in RUNS:
            if label in doc["runs"]:
                sim = sim_run(profile, pol, kw, a.slots, a.clients, a.duration, a.warmup,
                              doc["runs"][label]["real"]["prompt_range"])
                doc["runs"][label]["sim"] = {**summary(sim), "requests": sim["requests"]}
        path.write_text(json.dumps(doc, indent=1) + "\n")
    elif not a.report:
        profile = GpuProfile.from_json(a.profile)
        tmp = Path("/tmp/llama-gateway-bench")
        tmp.mkdir(exist_ok=True)
        idx = range(len(RUNS)) if a.policies == "all" else [int(x) for x in a.policies.split(",")]
        for i in idx:
            label, pol, kw = RUNS[i]
            real = real_run(tmp, pol, kw, a.slots, a.clients, a.duration, a.warmup)
            sim = sim_run(profile, pol, kw, a.slots, a.clients, a.duration, a.warmup,
                          real["prompt_range"])
            doc["runs"][label] = {
                "real": {**summary(real), **{k: real[k] for k in ("requests", "short_outputs",
                                                                  "prompt_range", "cores",
                                                                  "wall_s")}},
                "sim": {**summary(sim), "requests": sim["requests"]}}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1) + "\n")
            sys.stdout.write(f"{label}: {json.dumps(doc['runs'][label])}\n")
            sys.stdout.flush()
    sys.stdout.write(report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
