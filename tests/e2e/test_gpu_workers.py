"""The gateway on real GPU workers: a CUDA llama-server per NVIDIA GPU, checked through NVML.

Runs only on a machine with an NVIDIA GPU (NVML finds one) and a CUDA build of llama-server
(``$LLAMA_SERVER``, ``llama-server`` on PATH, or the gateway's cached CUDA build; its
``--list-devices`` must name a CUDA device); elsewhere (CI, the developers' machines) it skips
saying which is missing. This project's lent GPU machine runs it (``tests/bench/gpu_run.sh``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import base_config, free_port, start_gateway, stop_and_check_no_worker_left
from workers import gpu, provision


GPUS = gpu.detect_gpus()


def _cuda_llama_server() -> Path | None:
    """A llama-server that lists a CUDA device, or None."""
    try:
        path = provision.find_llama_server(backend="cuda")
    except provision.ProvisionError:
        return None
    if path is None:
        return None
    out = subprocess.run([str(path), "--list-devices"], capture_output=True, text=True, timeout=60)
    return path if "CUDA0" in out.stdout + out.stderr else None


CUDA_SERVER = _cuda_llama_server() if GPUS else None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU here (NVML finds none)"),
              pytest.mark.skipif(bool(GPUS) and CUDA_SERVER is None,
                                 reason="no CUDA llama-server here (none lists a CUDA device)")]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def test_one_cuda_worker_per_gpu_serves_and_reports_its_gpu(tmp_path):
    import pynvml

    cfg = base_config(free_port(), llama_server={"binary": str(CUDA_SERVER), "backend": "cuda"})
    cfg["models"][0].update(gpus="auto", slots=4, context=2048)
    del cfg["models"][0]["cpu"]
    gw = start_gateway(tmp_path, cfg, wait=False)
    try:
        workers = gw.wait_ready(timeout=180, n=len(GPUS))
        by_gpu = {tuple(w["gpus"]): w for w in workers}
        assert sorted(by_gpu) == [(i,) for i in GPUS], workers
        for i in GPUS:
            w = by_gpu[(i,)]
            env = _environ(w["pid"])
            assert env["CUDA_VISIBLE_DEVICES"] == str(i) and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            # the model is on that GPU: NVML lists the worker among its compute processes
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            on_gpu = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
            assert w["pid"] in on_gpu, (w["pid"], on_gpu)
            assert w["gpu"]["name"] == gpu.read_gpu_stats()[i].name
            assert w["gpu"]["memory_total_bytes"] >= 1 << 30

        client = ollama.Client(host=gw.url)
        r = client.generate(model="demo", prompt="once upon a time", options={"num_predict": 24})
        assert r.done and r.done_reason == "length" and r.eval_count == 24

        ps = httpx.get(gw.url + "/api/ps", timeout=10).json()["models"]
        assert [m["name"] for m in ps] == ["demo:latest"] and ps[0]["size_vram"] > 0, ps
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        for i in GPUS:
            total = [ln for ln in metrics.splitlines()
                     if ln.startswith("llama_gateway_gpu_memory_total_bytes{") and f'gpu="{i}"' in ln]
            assert len(total) == 1 and float(total[0].rsplit(" ", 1)[1]) >= 1 << 30, total
    finally:
        stop_and_check_no_worker_left(gw)
