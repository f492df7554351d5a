"""The gateway on a real GPU worker (not part of pytest; needs an NVIDIA GPU and a CUDA build of
llama-server). Run:

    python tests/bench/real_gpu.py --binary PATH [--out docs/bench_gpu.md]
        [--calibration docs/calibration/h200-demo1b.json]

``tests/bench/gpu_run.sh`` runs it (and the GPU tests) on this project's lent GPU machine.

Model: random weights with Llama-3.2-1B's layer sizes, f16 (``workers.demo_model.GPU_BENCH_SHAPE``,
about 1.9 GB), written to ``--model`` when missing. Fleet: one worker on GPU 0, ``--slots``
slots × 4,096 tokens, started by the gateway as it starts any GPU worker.

1. Gateway overhead, measured as ``tests/bench/real_bench.py`` measures it on CPU workers:
   the TTFT of ``--n`` direct and ``--n`` gateway streams of 4 tokens, interleaved, with the
   kernel's placement and then with the gateway alone on CPU 0 (the worker and this client on
   the others: on a GPU server the model computes on the GPU, the gateway has cores to itself).
2. Throughput at saturation: ``--clients`` streaming clients × 4 requests × 400 tokens, direct
   (spread by the client) vs through the gateway, best of 2 alternating rounds each; NVML is
   sampled every 0.25 s meanwhile (peak utilisation, power, memory used, temperature).
3. ``llama-gateway calibrate --gpu 0`` on the same model and binary (``--calibration``), and on
   a random-weight model with Llama-3.1-8B's layer sizes in Q4_0
   (``workers.demo_model.LLAMA8B_Q4_SHAPE``, about 3.9 GB; ``--calibration-8b``): the
   simulator profile of this GPU for the model of its published-figure profiles, then
   ``llama-gateway simulate --gpus 4`` with that profile.

Speed is measured, never asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.real_bench import overhead, overhead_pinned, pct, saturation  # noqa: E402
from tests.conftest import base_config, free_port, start_gateway  # noqa: E402
from workers.demo_model import GPU_BENCH_SHAPE, LLAMA8B_Q4_SHAPE, write_demo_model  # noqa: E402
from workers.gpu import read_gpu_stats  # noqa: E402


class NvmlSampler:
    """NVML samples of GPU ``index`` every ``interval_s`` seconds while running."""

    def __init__(self, index: int = 0, interval_s: float = 0.25):
        self.index, self.interval_s = index, interval_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = read_gpu_stats().get(self.index)
            if s is not None:
                self.samples.append(s)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "NvmlSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="a CUDA build of llama-server")
    ap.add_argument("--model", default="/tmp/llama-gateway-gpu-bench/demo-1b-f16.gguf")
    ap.add_argument("--out", default="docs/bench_gpu.md")
    ap.add_argument("--calibration", default="docs/calibration/gpu-demo1b.json")
    ap.add_argument("--calibration-8b", default="docs/calibration/gpu-llama8b-q4.json")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--n", type=int, default=300, help="streams per side for the TTFT")
    ap.add_argument("--smoke", action="store_true",
                    help="check this script on a machine without a GPU: a CPU worker of the "
                         "demo model, few requests; measures nothing worth reporting")
    a = ap.parse_args()
    if a.smoke:
        from workers.demo_model import ensure_demo_model
        a.model, a.n, a.clients, a.slots = str(ensure_demo_model()), 10, 2, 2

    model = Path(a.model)
    if not model.exists():
        t0 = time.perf_counter()
        write_demo_model(model, shape=GPU_BENCH_SHAPE)
        print(f"model written in {time.perf_counter() - t0:.1f} s: {model.stat().st_size:,} bytes",
              flush=True)
    tmp = Path("/tmp/llama-gateway-gpu-bench")
    tmp.mkdir(exist_ok=True)
    gpu = read_gpu_stats().get(0)
    gpu_name = gpu.name if gpu else "no GPU (--smoke)"
    cfg = base_config(free_port(), llama_server={"binary": a.binary,
                                                 "backend": "cpu" if a.smoke else "cuda"})
    cfg["models"] = [{"name": "gpu1b", "path": str(model), "slots": a.slots, "context": 4096,
                      **({"cpu": 1} if a.smoke else {"gpus": [0]})}]
    lines = [f"### Gateway overhead on one GPU worker ({gpu_name}, random-weight model with "
             f"Llama-3.2-1B's layer sizes, f16, {a.slots} slots × 4,096 tokens, same run)", ""]
    t0 = time.perf_counter()
    gw = start_gateway(tmp, cfg, wait=False)
    try:
        gw.wait_ready(timeout=300)
        print(f"worker ready in {time.perf_counter() - t0:.1f} s", flush=True)
        d, g = overhead(gw, n=a.n, model="gpu1b", n_predict=4)
        print(f"TTFT p50 direct {ms(pct(d, 50))} gateway {ms(pct(g, 50))} ms", flush=True)
        pinned = overhead_pinned(gw, n=a.n, model="gpu1b", n_predict=4)
        if pinned:
            print(f"pinned: TTFT p50 direct {ms(pct(pinned[0], 50))} gateway "
                  f"{ms(pct(pinned[1], 50))} ms", flush=True)
        with NvmlSampler() as nv:
            sat = saturation(gw, clients=a.clients, per_client=4, model="gpu1b",
                             n_predict=40 if a.smoke else 400)
        print(f"saturation direct {sat['direct']:,.0f} gateway {sat['gateway']:,.0f} tokens/s",
              flush=True)
    finally:
        gw.stop()
    lines += ["| measure | direct to llama-server | through gateway | difference |",
              "|---|---:|---:|---:|"]
    for label, (dd, gg) in (("kernel's placement", (d, g)),
                            *((("gateway alone on CPU 0", pinned),) if pinned else ())):
        for q in (50, 99):
            lines.append(f"| TTFT p{q} (ms), {a.n} streams of 4 tokens each side, {label} | "
                         f"{ms(pct(dd, q))} | {ms(pct(gg, q))} | "
                         f"{(pct(gg, q) - pct(dd, q)) * 1000:+.2f} |")
    lines += [f"| saturated throughput (tokens/s), {a.clients} streaming clients × 4 × 400 "
              f"tokens | {sat['direct']:,.0f} | {sat['gateway']:,.0f} | "
              f"{sat['gateway'] / sat['direct'] * 100:.1f} % of direct |",
              f"| dropped keep-alive connections seen by the clients (retried) | "
              f"{sat['dropped'].get('direct', 0)} | {sat['dropped'].get('gateway', 0)} | |", ""]
    if nv.samples:
        peak = max(s.util_percent for s in nv.samples)
        lines += [f"NVML during the saturation rounds ({len(nv.samples)} samples, "
                  "`workers.gpu.read_gpu_stats`): peak utilisation "
                  f"{peak} %, peak power {max(s.power_w for s in nv.samples):.0f} W, memory used "
                  f"{max(s.memory_used_bytes for s in nv.samples) / 2**30:.1f} of "
                  f"{nv.samples[0].memory_total_bytes / 2**30:.1f} GiB, peak temperature "
                  f"{max(s.temperature_c for s in nv.samples)} °C.", ""]

    _write(a.out, lines)

    model8b = Path(a.model).with_name("demo-8b-q4_0.gguf")
    if not a.smoke and not model8b.exists():
        t0 = time.perf_counter()
        write_demo_model(model8b, shape=LLAMA8B_Q4_SHAPE)
        print(f"8B model written in {time.perf_counter() - t0:.1f} s", flush=True)
    for label, path, out in (("the same model (1B f16)", model, a.calibration),
                             ("Llama-3.1-8B's layer sizes, Q4_0", model if a.smoke else model8b,
                              a.calibration_8b)):
        cal = [sys.executable, "-m", "gateway", "calibrate", *(() if a.smoke else ("--gpu", "0")),
               "--binary", a.binary, "--model", str(path), "--slots", "8", "--context", "4096",
               "--repeats", "1" if a.smoke else "3", "--name", f"{gpu_name}, random {label}",
               "--out", out]
        t0 = time.perf_counter()
        r = subprocess.run(cal, cwd=ROOT, capture_output=True, text=True, timeout=600)
        print(f"calibrated {label} in {time.perf_counter() - t0:.1f} s: rc {r.returncode}",
              flush=True)
        lines += [f"### `llama-gateway calibrate --gpu 0`, {label}", "", "```",
                  r.stdout.strip() or r.stderr.strip()[-2000:], "```", ""]
        _write(a.out, lines)
    if r.returncode == 0:
        sim = [sys.executable, "-m", "gateway", "simulate", "--gpus", "4",
               "--duration", "25" if a.smoke else "60", "--profile", a.calibration_8b]
        s = subprocess.run(sim, cwd=ROOT, capture_output=True, text=True, timeout=600)
        lines += ["### `llama-gateway simulate --gpus 4 --duration 60` with the 8B profile", "",
                  s.stdout.strip() or s.stderr.strip()[-2000:], ""]
    sys.stdout.write(_write(a.out, lines))
    return 0


def _write(path: str, lines: list[str]) -> str:
    """Write the report so far (a run cut short keeps what it measured); returns it."""
    md = "\n".join(lines) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
