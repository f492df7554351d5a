"""Spare worker connections on and off, same run (``llama_server.spare_connections``).

Two gateways, identical but for ``spare_connections``, each with one real CPU worker
(2 slots, ``-t 1``):

1. Added TTFT: 400 rounds of four requests, interleaved: direct to gateway A's worker, through
   A (spares on), direct to B's worker, through B (spares off); each a streamed 16-token
   ``/api/generate`` raw (``/completion`` direct), timed to the first line.
2. Saturation: ``real_bench.saturation`` (8 streaming clients, direct and through the gateway
   in alternating rounds) on A and B in turn, ``--rounds`` times each (A B, B A, …).

Run: ``flock /tmp/bench.lock .venv/bin/python tests/bench/spare_ab.py``. Not part of the test
suite; numbers on a shared 2-core machine move with any other load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import pct, saturation, ttft_stream  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway, worker_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="spare-ab-"))
    gws = {}
    for label, spare in (("on", True), ("off", False)):
        cfg = base_config(free_port(), log={"level": "warning", "format": "json"},
                          llama_server={"threads": 1, "spare_connections": spare})
        cfg["models"][0]["cpu"] = 1
        gws[label] = start_gateway(tmp, cfg)
    try:
        body = {"prompt": "hello there", "n_predict": 16, "stream": True}
        gbody = {"model": "demo", "prompt": "hello there", "raw": True,
                 "options": {"num_predict": 16}}
        direct = {}
        for label, gw in gws.items():
            w = gw.workers()[0]
            direct[label] = (f"http://127.0.0.1:{w['port']}/completion",
                             {"Authorization": f"Bearer {worker_key(w['pid'])}"})
        ttft = {(k, s): [] for k in gws for s in ("direct", "gateway")}
        with httpx.Client(timeout=60) as c:
            for _ in range(a.requests):
                for label, gw in gws.items():
                    url, key = direct[label]
                    ttft[(label, "direct")].append(ttft_stream(c, url, body, key)[0])
                    ttft[(label, "gateway")].append(
                        ttft_stream(c, gw.url + "/api/generate", gbody)[0])
        sat = {k: [] for k in gws}
        for r in range(a.rounds):
            for label in (("on", "off") if r % 2 == 0 else ("off", "on")):
                s = saturation(gws[label])
                sat[label].append((s["direct"], s["gateway"]))
    finally:
        for gw in gws.values():
            gw.stop()
    print(f"TTFT, {a.requests} requests per series, interleaved; saturation, {a.rounds} rounds each")
    print("| spare connections | TTFT p50 direct | TTFT p50 gateway | added p50 | added p99 | "
          "saturation gateway ÷ direct per round | mean |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for label in gws:
        d, g = ttft[(label, "direct")], ttft[(label, "gateway")]
        ratios = [gw_ / di for di, gw_ in sat[label]]
        print(f"| {label} | {pct(d, 50) * 1e3:.2f} ms | {pct(g, 50) * 1e3:.2f} ms | "
              f"{(pct(g, 50) - pct(d, 50)) * 1e3:+.2f} ms | {(pct(g, 99) - pct(d, 99)) * 1e3:+.2f} ms | "
              f"{', '.join(f'{x:.3f}' for x in ratios)} | {sum(ratios) / len(ratios):.3f} |")


if __name__ == "__main__":
    main()
