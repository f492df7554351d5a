"""Relay capacity: streamed tokens per second per gateway CPU-second (issue 4 benchmark).

The upstream is ``tests/fakes/firehose_llama_server.py``, a FAKE llama-server that sends a
pre-recorded SSE stream faster than the gateway can relay it (a real CPU llama-server tops out
near 10,000 tokens/s here, too slow to load the relay). The gateway runs unchanged on it.
We count tokens the client received and the gateway process's CPU time (user + system,
psutil) over the same interval, for ``/v1/chat/completions`` (SSE pass-through) and
``/api/chat`` (SSE → NDJSON translation).

Run: ``.venv/bin/python tests/bench/relay_bench.py [--streams 8] [--tokens 20000] [--rounds 3]``
Not part of the test suite (speed is measured, never asserted).
"""

from __future__ import annotations

import argparse
import asyncio
import stat
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import base_config, free_port, start_gateway  # noqa: E402


async def one(session, url, body, sep: bytes) -> int:
    n = 0
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for chunk in r.content.iter_any():
            n += chunk.count(sep)
    return n


async def run(gw_url: str, route: str, streams: int, tokens: int) -> int:
    if route == "/v1/chat/completions":
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": tokens, "stream": True}
        sep = b"\n\n"
    else:
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_predict": tokens}}
        sep = b"\n"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        counts = await asyncio.gather(*(one(s, gw_url + route, body, sep) for _ in range(streams)))
    return sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events-per-write", type=int, default=0,
                    help="upstream events per write: 0 = 64 KiB blocks, 1 = one per token")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    wrapper = tmp / "firehose-llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec '{sys.executable}' "
                       f"'{ROOT / 'tests/fakes/firehose_llama_server.py'}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    cfg = base_config(free_port(), llama_server={"binary": str(wrapper)},
                      log={"level": "warning", "format": "json"})
    cfg["models"][0].update({"cpu": 1, "slots": args.streams, "context": 65536})
    cfg["timeouts"] = {"inter_token_s": 60}
    gw = start_gateway(tmp, cfg, env={"FIREHOSE_EVENTS_PER_WRITE": str(args.events_per_write)})
    proc = psutil.Process(gw.proc.pid)
    rows = []
    try:
        for route in ("/v1/chat/completions", "/api/chat"):
            best = None
            for _ in range(args.rounds):
                c0, t0 = proc.cpu_times(), time.perf_counter()
                n = asyncio.run(run(gw.url, route, args.streams, args.tokens))
                c1, wall = proc.cpu_times(), time.perf_counter() - t0
                cpu = (c1.user - c0.user) + (c1.system - c0.system)
                rate = n / cpu if cpu else float("inf")
                if best is None or rate > best[0]:
                    best = (rate, n, cpu, wall)
            rows.append((route, *best))
    finally:
        gw.stop()
    print(f"streams={args.streams} tokens/stream={args.tokens} rounds={args.rounds} "
          f"upstream events/write={args.events_per_write or '64 KiB blocks'} (best round)")
    print("| route | tokens relayed | gateway CPU s | wall s | tokens / gateway CPU-s | tokens/s wall |")
    print("|---|---:|---:|---:|---:|---:|")
    for route, rate, n, cpu, wall in rows:
        print(f"| `{route}` | {n:,} | {cpu:.2f} | {wall:.2f} | {rate:,.0f} | {n / wall:,.0f} |")


if __name__ == "__main__":
    main()
