"""Prefix affinity on real llama-server workers with many shared system prompts (not part of
pytest).

The simulator's working-set sweep (README "Routing quality") predicts that affinity's gain
over round-robin depends on the working set W (the tokens of the system prompts in use)
against one worker's cache C (its slots plus its host prompt cache): with W ≤ C every worker
ends up holding every prompt and placement hardly matters; with C < W ≤ fleet × C,
round-robin makes every worker cycle through all W while affinity gives each worker its own
share. This bench checks that prediction on real workers, counted by their own
``llamacpp:prompt_tokens_cached_total`` (the difference over the run).

Workload: ``--prompts`` system prompts of ~``--words`` random words each (distinct from the
first sentence on), each request one of them (equal popularity, or Zipf with ``--zipf 1``)
plus a short distinct user message, ``/api/chat`` non-streamed with ``--num-predict`` tokens;
``--requests`` requests in a fixed seeded order, sent by ``--clients`` closed-loop clients.
Fleet: ``--workers`` (2) CPU workers × ``--slots`` slots × 2048 tokens, ``-t 1``,
``--cache-ram`` MiB of host prompt cache each (the demo model's KV is 512 bytes per token, so
2 MiB ≈ 4,096 tokens). More workers than cores is fair while ``--clients`` ≤ cores: no more
requests run at once than there are cores, whatever the policy.
Policies: least_loaded with prefix affinity (the default), least_loaded without it,
round_robin; each on a fresh gateway and fresh workers.

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/real_shared_prompts.py
[--prompts 8 24 48] [--cache-ram 2] [--clients 2] [--out docs/bench_shared_prompts.md]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import cached_total  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()

POLICIES = [("least_loaded + affinity", "least_loaded", True),
            ("least_loaded, no affinity", "least_loaded", False),
            ("round_robin", "round_robin", False)]


def workload(n_prompts: int, words: int, n_requests: int, zipf_s: float, seed: int = 5):
    """(system prompts, [(prompt index, user message)] × ``n_requests``), seeded."""
    rng = random.Random(seed)
    systems = [f"You are assistant number {k}. " + " ".join(rng.choices(WORDS, k=words))
               for k in range(n_prompts)]
    weights = [1 / (k + 1) ** zipf_s for k in range(n_prompts)]
    reqs = [(rng.choices(range(n_prompts), weights)[0],
             f"question {i}: " + " ".join(rng.choices(WORDS, k=10))) for i in range(n_requests)]
    return systems, reqs


def run(tmp: Path, policy: str, affinity: bool, systems, reqs, slots: int, cache_ram: int,
        clients: int, num_predict: int, workers: int = 2) -> dict:
    """One fresh gateway with ``workers`` workers; ``reqs`` taken in order by ``clients`` clients.
    Returns cached (workers' count), prompt (answers' ``prompt_eval_count`` summed), out and
    wall (s)."""
    cfg = base_config(free_port(), scheduler={"policy": policy, "prefix_affinity": affinity},
                      log={"level": "warning", "format": "json"})
    cfg["models"][0].update(slots=slots, context=2048, cpu=workers,
                            args=["--cache-ram", str(cache_ram)])
    gw = start_gateway(tmp, cfg)
    todo = iter(reqs)
    lock = threading.Lock()
    try:
        before = cached_total(gw)
        t0 = time.perf_counter()

        def client(c: httpx.Client) -> tuple[int, int]:
            prompt = out = 0
            while True:
                with lock:
                    nxt = next(todo, None)
                if nxt is None:
                    return prompt, out
                k, user = nxt
                r = c.post(gw.url + "/api/chat", json={
                    "model": "demo", "stream": False, "options": {"num_predict": num_predict},
                    "messages": [{"role": "system", "content": systems[k]},
                                 {"role": "user", "content": user}]})
                r.raise_for_status()
                body = r.json()
                prompt += body["prompt_eval_count"]
                out += body["eval_count"]

        with httpx.Client(timeout=300) as c, cf.ThreadPoolExecutor(clients) as ex:
            parts = list(ex.map(lambda _: client(c), range(clients)))
        wall = time.perf_counter() - t0
        cached = cached_total(gw) - before
    finally:
        gw.stop()
    return {"cached": cached, "prompt": sum(p for p, _ in parts),
            "out": sum(o for _, o in parts), "wall": wall}


def rows(n: int, runs: dict[str, list[dict]]) -> list[str]:
    """Table rows for ``n`` prompts: cached and prompt tokens summed over the repeats; tokens/s
    and its ratio to least-loaded without affinity as the median, with the range when there are
    several runs (ratios pair each run with the baseline's run of the same round)."""
    def tps(r):
        return (r["prompt"] + r["out"]) / r["wall"]

    def fmt(xs, spec):
        med = statistics.median(xs)
        return (f"{med:{spec}}" if len(xs) == 1
                else f"{med:{spec}} ({min(xs):{spec}}–{max(xs):{spec}})")

    rr_cached = sum(r["cached"] for r in runs["round_robin"])
    base = runs["least_loaded, no affinity"]
    out = []
    for label, rs in runs.items():
        cached, prompt = sum(r["cached"] for r in rs), sum(r["prompt"] for r in rs)
        out.append(f"| {n} | {label} | {cached:,.0f} | {prompt:,} | {cached / prompt:.3f} | "
                   f"{cached / rr_cached:.2f}× | {fmt([tps(r) for r in rs], ',.0f')} | "
                   f"{fmt([tps(r) / tps(b) for r, b in zip(rs, base)], '.2f')} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 24, 48])
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--zipf", type=float, default=0.0, help="popularity exponent (0 = equal)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2,
                    help="CPU workers (-t 1 each; more than the cores is fine while at most "
                         "--clients requests run at once)")
    ap.add_argument("--cache-ram", type=int, default=2, help="MiB of host prompt cache per worker")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--num-predict", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per policy, interleaved; tokens/s reported as median (range)")
    ap.add_argument("--out", default="docs/bench_shared_prompts.md")
    a = ap.parse_args()
    tmp = Path("/tmp/llama-gateway-bench")
    tmp.mkdir(exist_ok=True)
    lines = [f"### Shared system prompts on real workers ({a.workers} workers × {a.slots} slots, "
             f"`--cache-ram {a.cache_ram}`, {a.requests} requests, {a.clients} clients, "
             f"popularity {'equal' if not a.zipf else f'Zipf {a.zipf:g}'}, "
             f"{a.num_predict} tokens per answer, {a.repeats} run(s) per policy)", "",
             "| system prompts | policy | cached prompt tokens | prompt tokens | cached / prompt | "
             "÷ round-robin's | tokens/s (prompt + generated) | ÷ least-loaded without affinity |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n in a.prompts:
        systems, reqs = workload(n, a.words, a.requests, a.zipf)
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in POLICIES}
        for _ in range(a.repeats):  # policies interleaved, so drift on the machine hits all
            for label, pol, aff in POLICIES:
                runs[label].append(run(tmp, pol, aff, systems, reqs, a.slots, a.cache_ram,
                                       a.clients, a.num_predict, a.workers))
        lines += rows(n, runs)
        sys.stdout.write("\n".join(lines[-len(POLICIES):]) + "\n")
        sys.stdout.flush()
    md = "\n".join(lines) + "\n"
    Path(a.out).write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
