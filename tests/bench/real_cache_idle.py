"""Real llama-server workers (CPU here): ``--cache-idle-slots`` (llama-server's default) vs
``--no-cache-idle-slots``, on multi-turn conversations through the gateway.

The simulator (``tests/bench/cache_idle_slots.py``) says the eager copies of idle slots cost
worker time and buy no cached tokens; the copy cost cannot be measured on a CPU (the "GPU ↔ host"
copy is a memcpy here), but whether cached tokens change can: counted by the workers' own
``llamacpp:prompt_tokens_cached_total``. To make the host cache matter with the tiny demo
model (512 bytes of KV per token) each worker gets ``--cache-ram 2`` (about 4,096 tokens).

Workload: ``--chats`` conversations, each starting with one of 6 system prompts (~250 tokens)
and going ``--turns`` turns (each turn's prompt repeats the conversation so far), run by
``--clients`` concurrent clients with ``/api/chat`` (non-streamed, 24 tokens per answer).
Fleet: 2 CPU workers × 4 slots, ``-t 1``. Policies: this scheduler and round-robin.

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/real_cache_idle.py``. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import cached_total  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def chat(c, url, system, turns, rng):
    msgs = [{"role": "system", "content": system}]
    prompt_tokens = 0
    for _ in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=12))})
        r = c.post(url + "/api/chat", json={"model": "demo", "messages": msgs, "stream": False,
                                            "options": {"num_predict": 24}})
        r.raise_for_status()
        body = r.json()
        prompt_tokens += body["prompt_eval_count"]
        msgs.append(body["message"])
    return prompt_tokens


def run(tmp, policy, idle, chats, turns, clients):
    args = ["--cache-ram", "2"] + ([] if idle else ["--no-cache-idle-slots"])
    cfg = base_config(free_port(), scheduler={"policy": policy},
                      log={"level": "warning", "format": "json"})
    cfg["models"][0].update(slots=4, context=2048, args=args)
    gw = start_gateway(tmp, cfg)
    try:
        rng = random.Random(11)
        systems = [f"You are assistant number {k}. " + " ".join(rng.choices(WORDS, k=220))
                   for k in range(6)]
        jobs = [(rng.choice(systems), random.Random(100 + i)) for i in range(chats)]
        before = cached_total(gw)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(clients) as ex, httpx.Client(timeout=300) as c:
            prompt = sum(ex.map(lambda j: chat(c, gw.url, j[0], turns, j[1]), jobs))
        wall = time.perf_counter() - t0
        return cached_total(gw) - before, prompt, wall
    finally:
        gw.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chats", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cache-idle-"))
    print(f"{a.chats} conversations × {a.turns} turns, {a.clients} clients; 2 workers × 4 slots, "
          "--cache-ram 2")
    print("| policy | idle slots saved | cached prompt tokens | prompt tokens (responses) | "
          "cached / prompt | wall s |")
    print("|---|---|---:|---:|---:|---:|")
    for policy in ("least_loaded", "round_robin"):
        for idle in (True, False):
            cached, prompt, wall = run(tmp, policy, idle, a.chats, a.turns, a.clients)
            print(f"| {policy} | {'yes (default)' if idle else 'no'} | {cached:,.0f} | {prompt:,} | "
                  f"{cached / prompt:.3f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
