"""Simulated: llama-server's ``--cache-idle-slots`` (its default) vs ``--no-cache-idle-slots``.

With the default, every idle slot's sequence is copied to the host prompt cache each time a
new task starts (pinned build, tools/server/server-context.cpp, ``cache_idle_slots``); without
it a slot's sequence is saved only when a task takes that slot for a different prompt. The
copies stall the worker (``gateway.simulator.worker``), so the question is what the eager
copies buy in cached prompt tokens and what they cost in TTFT and tokens/s, with this
scheduler (least_loaded + prefix affinity) and with round-robin.

Run: ``.venv/bin/python tests/bench/cache_idle_slots.py [--gpus 4] [--duration 120]
[--profile rtx6000ada-llama8b-q4]``. Not part of the test suite (measured, never asserted).
The GPU ↔ host copy rate is the profile's ``host_copy_bytes_per_s`` (an assumption for GPUs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.simulator.engine import simulate  # noqa: E402
from gateway.simulator.report import N_CTX, scenarios  # noqa: E402
from gateway.simulator.worker import resolve_profile  # noqa: E402


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--profile", default="rtx6000ada-llama8b-q4")
    args = ap.parse_args()
    prof = resolve_profile(args.profile)
    print(f"{args.gpus} simulated GPUs, profile {prof.name}, {args.duration:g} s per run; "
          f"host copies at {prof.host_copy_bytes_per_s / 1e9:g} GB/s")
    print("| scenario | policy | idle slots saved | tokens/s | TTFT p50 s | TTFT p99 s | "
          "cached prompt tokens | cache hit ratio | copy s per worker |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, make, slots, warm in scenarios(args.duration)[2:]:  # the two caching scenarios
        for label, pol, kw in (("gateway", "least_loaded", {"affinity": True}),
                               ("round_robin", "round_robin", {})):
            for idle in (True, False):
                r = simulate(make(args.gpus), n_workers=args.gpus, profile=prof, slots=slots,
                             n_ctx=N_CTX, policy=pol, warmup_s=warm, cache_idle_slots=idle, **kw)
                print(f"| {name} | {label} | {'yes (default)' if idle else 'no'} | "
                      f"{r.throughput:,.0f} | {pct(r.ttft, 50):.3f} | {pct(r.ttft, 99):.3f} | "
                      f"{r.cached_tokens:,} | {r.cached_ratio:.3f} | {r.copy_s / args.gpus:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
