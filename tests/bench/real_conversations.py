"""Prefix affinity on real llama-server workers with multi-turn chats (not part of pytest).

Many conversations that share one system prompt are carried on turn by turn through the
gateway, each turn sending the whole history back (as chat clients do), under
``least_loaded`` with prefix affinity, without it, and ``round_robin`` (and with
``--affinity-wait MS``, least_loaded with affinity and the affinity wait of delay scheduling,
``scheduler.affinity_wait_ms_per_1k_tokens``). Cached prompt tokens are counted by the workers
themselves (``llamacpp:prompt_tokens_cached_total``, the difference over the run), prompt
tokens by the answers' ``prompt_eval_count``; "moves" counts the turns served by another
worker than the conversation's previous turn, and TTFT is the gateway's time to first token
(queueing included), both from the gateway's ``request.done`` log events.

The demo model's KV is 512 bytes per token (2 layers × 4 KV heads × 16 dims × K and V × f16),
so llama-server's default 8 GiB host prompt cache (``--cache-ram 8192``) holds 16.7 M of its
tokens: every history fits on every worker and placement cannot matter. ``--cache-ram 32``
gives it the 65,536 tokens that the default 8 GiB holds of Llama-3.1-8B (32 layers × 8 KV
heads × 128 dims × 2 × 2 bytes = 128 KiB per token), which is the regime a GPU server is in,
and is the default here (``--cache-ram 32 8192`` runs both).

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/real_conversations.py
[--conversations 56] [--turns 8] [--slots 2] [--clients 4] [--affinity-wait 50]
[--out docs/bench_conversations.md]``
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import cached_total  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()
SYSTEM = "You are a helpful assistant for the operators of a GPU cluster. "


def conversations(n: int, turns: int, seed: int) -> list[list[str]]:
    """``n`` conversations × ``turns`` user messages of ~250 bytes (random words)."""
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(40)) + f" ({c}.{t})"
             for t in range(turns)] for c in range(n)]


def turn_stats(log_path: Path) -> dict:
    """From the gateway's JSON ``request.done`` log events of the chat turns: ``moves``, the
    turns served by another worker than their conversation's previous turn, of ``turns`` turns
    after a first one; ``ttft_p50`` / ``ttft_p99``, the gateway's time to first token (ms,
    queueing included)."""
    where: dict[tuple[int, int], str] = {}
    ttft: list[float] = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        m = re.fullmatch(r"conv(\d+)-turn(\d+)", str(ev.get("request_id", "")))
        if ev.get("event") == "request.done" and m:
            where[int(m[1]), int(m[2])] = ev.get("worker")
            if ev.get("ttft_ms") is not None:
                ttft.append(ev["ttft_ms"])
    pairs = [(w, where[c, t - 1]) for (c, t), w in where.items() if (c, t - 1) in where]
    ttft.sort()
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    return {"moves": sum(a != b for a, b in pairs), "turns": len(pairs),
            "ttft_p50": pct(0.5), "ttft_p99": pct(0.99)}


def run(tmp: Path, policy: str, affinity: bool, cache_ram_mib: int, convs: list[list[str]],
        clients: int, num_predict: int, system: str, slots: int = 2,
        affinity_wait: float = 0.0) -> dict:
    """One gateway, 2 workers × ``slots`` slots; every conversation's turn t is sent after its turn
    t - 1 was answered, all conversations' turn t (in a shuffled order) before any turn t + 1,
    by ``clients`` clients. (In a fixed order round-robin would send every conversation to the
    same worker each round whenever the count is even.)"""
    cfg = base_config(free_port(), scheduler={"policy": policy, "prefix_affinity": affinity,
                                              "affinity_wait_ms_per_1k_tokens": affinity_wait})
    cfg["log"] = {"level": "info", "format": "json"}  # request.done events, for the moves
    cfg["models"][0].update(slots=slots, context=2048, args=["--cache-ram", str(cache_ram_mib)])
    gw = start_gateway(tmp, cfg)
    history = [[{"role": "system", "content": system}] for _ in convs]
    prompt = out = 0
    try:
        before = cached_total(gw)
        t0 = time.perf_counter()
        rng = random.Random(7)
        with cf.ThreadPoolExecutor(clients) as ex, httpx.Client(timeout=300) as c:
            for t in range(len(convs[0])):
                order = list(range(len(convs)))
                rng.shuffle(order)  # users answer at their own pace: each round in a new order
                def turn(i: int) -> dict:
                    msgs = history[i] + [{"role": "user", "content": convs[i][t]}]
                    r = c.post(gw.url + "/api/chat", json={
                        "model": "demo", "messages": msgs, "stream": False,
                        "options": {"num_predict": num_predict, "seed": i * 100 + t}},
                        headers={"X-Request-ID": f"conv{i}-turn{t}"})
                    r.raise_for_status()
                    body = r.json()
                    history[i] = msgs + [body["message"]]
                    return body
                for body in ex.map(turn, order):
                    prompt += body["prompt_eval_count"]
                    out += body["eval_count"]
        wall = time.perf_counter() - t0
        cached = cached_total(gw) - before
    finally:
        gw.stop()
    return {"cached": cached, "prompt": prompt, "out": out, "wall": wall,
            **turn_stats(gw.log_path)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=56)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2, help="slots per worker")
    ap.add_argument("--num-predict", type=int, default=24)
    ap.add_argument("--cache-ram", type=int, nargs="+", default=[32])
    ap.add_argument("--system-repeat", type=int, default=3,
                    help="copies of the 64-byte system sentence (3: about 100 tokens)")
    ap.add_argument("--affinity-wait", type=float, nargs="*", default=[],
                    help="also least_loaded + affinity with these affinity waits (ms per 1,000 tokens)")
    ap.add_argument("--out", default="docs/bench_conversations.md")
    a = ap.parse_args()
    tmp = Path("/tmp/llama-gateway-bench")
    tmp.mkdir(exist_ok=True)
    convs = conversations(a.conversations, a.turns, seed=11)
    lines = [f"### Multi-turn chats on real workers (2 workers × {a.slots} slots × 2048 tokens, demo model; "
             f"{a.conversations} conversations × {a.turns} turns sharing one system prompt of "
             f"{len(SYSTEM) * a.system_repeat} bytes, "
             f"{a.clients} clients, {a.num_predict} tokens per answer)", "",
             "| `--cache-ram` (MiB) | policy | cached prompt tokens | prompt tokens | cached ÷ round-robin's | "
             "tokens/s (prompt + generated) | ÷ least-loaded without affinity | moves | "
             "TTFT p50 / p99 ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for ram in a.cache_ram:
        res = {}
        runs = [("least_loaded + affinity", "least_loaded", True, 0.0)]
        runs += [(f"least_loaded + affinity, wait {w:g} ms/1k tokens", "least_loaded", True, w)
                 for w in a.affinity_wait]
        runs += [("least_loaded, no affinity", "least_loaded", False, 0.0),
                 ("round_robin", "round_robin", False, 0.0)]
        for label, pol, aff, wait in runs:
            res[label] = run(tmp, pol, aff, ram, convs, a.clients, a.num_predict,
                             SYSTEM * a.system_repeat, a.slots, wait)
        rr = res["round_robin"]["cached"]
        base = res["least_loaded, no affinity"]
        base_tps = (base["prompt"] + base["out"]) / base["wall"]
        for label, r in res.items():
            tps = (r["prompt"] + r["out"]) / r["wall"]
            lines.append(f"| {ram} | {label} | {r['cached']:,.0f} | {r['prompt']:,} | "
                         f"{r['cached'] / rr:.2f}× | {tps:,.0f} | {tps / base_tps:.2f} | "
                         f"{r['moves']} of {r['turns']} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} |")
    md = "\n".join(lines) + "\n"
    Path(a.out).write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
