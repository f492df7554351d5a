"""Added TTFT of the gateway for several worker setups in one run (not part of pytest).

Each case starts a gateway with one worker and measures, as ``tests/bench/real_bench.py`` does,
``--n`` direct and ``--n`` gateway streams of 4 tokens, interleaved (``real_bench.overhead``),
then as many with the gateway alone on CPU 0 (``real_bench.overhead_pinned``), and the gateway
process's CPU time (user + system, psutil) per gateway request over both rounds (it includes
the gateway's background polling of the worker). Cases:

- ``cpu:SLOTS``: a CPU worker (``-t 1``) of the demo model (or of ``--cpu-model``);
- ``gpu:SLOTS``: a worker on GPU 0 of ``--model`` (needs a CUDA llama-server, ``--binary``).

Run: ``python tests/bench/overhead_probe.py --binary PATH --model M.gguf cpu:2 gpu:16 gpu:2``.
It separates what the worker's kind and slot count add to the gateway's overhead from what
the machine and its Python add. Speed is measured, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import overhead, overhead_pinned, pct  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402
from workers.demo_model import ensure_demo_model  # noqa: E402


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="cpu:SLOTS or gpu:SLOTS")
    ap.add_argument("--binary", default=None, help="llama-server (a CUDA build for gpu cases)")
    ap.add_argument("--model", default=None, help="GGUF file of the gpu cases")
    ap.add_argument("--cpu-model", default=None, help="GGUF file of the cpu cases (default: demo)")
    ap.add_argument("--n", type=int, default=300, help="streams per side and round")
    a = ap.parse_args()
    tmp = Path("/tmp/llama-gateway-overhead-probe")
    tmp.mkdir(exist_ok=True)
    print("| case | TTFT p50 direct (ms) | gateway (ms) | added (ms) | added, gateway alone on "
          "CPU 0 (ms) | gateway CPU per request (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in a.cases:
        kind, slots = case.split(":")
        ls = {"binary": a.binary} if a.binary else {}
        if kind == "gpu":
            ls["backend"] = "cuda"
            model = {"path": a.model, "gpus": [0]}
        else:
            model = {"path": a.cpu_model or str(ensure_demo_model()), "cpu": 1}
        cfg = base_config(free_port(), llama_server=ls)
        cfg["models"] = [{"name": "m", "slots": int(slots), "context": 4096, **model}]
        gw = start_gateway(tmp, cfg, wait=False)
        try:
            gw.wait_ready(timeout=300)
            c0 = cpu_s(gw.proc.pid)
            d, g = overhead(gw, n=a.n, model="m", n_predict=4)
            pinned = overhead_pinned(gw, n=a.n, model="m", n_predict=4)
            per_req = (cpu_s(gw.proc.pid) - c0) / (2 * a.n) * 1000
        finally:
            gw.stop()
        added = (pct(g, 50) - pct(d, 50)) * 1000
        added_pinned = (pct(pinned[1], 50) - pct(pinned[0], 50)) * 1000 if pinned else float("nan")
        print(f"| {case} | {pct(d, 50) * 1000:.3f} | {pct(g, 50) * 1000:.3f} | {added:+.3f} | "
              f"{added_pinned:+.3f} | {per_req:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
