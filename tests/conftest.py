"""Shared fixtures: a real gateway process on a real llama-server binary and the demo GGUF.

``gateway_proc(config_dict)`` writes a YAML config, starts ``python -m gateway serve`` on a
free port, waits until every worker is ready and yields a ``GatewayProc``. Teardown stops it
(SIGTERM) and asserts that no llama-server it started is left running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def llama_server_pids() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                exe = os.readlink(d / "exe")
            except OSError:
                continue
            if exe.endswith("llama-server"):
                out.add(int(d.name))
    return out


def long_stream(url: str, stop=None) -> int:
    """Stream an ``/api/generate`` of 60,000 tokens (raw prompt ``x``) from the gateway at
    ``url`` until it ends or the ``threading.Event`` ``stop`` is set; keeps a slot busy (a
    drain waiting, a worker occupied). Needs a context that holds it, or the worker ends it
    early. Returns the lines read."""
    n = 0
    with httpx.stream("POST", url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": "x", "raw": True,
            "options": {"num_predict": 60000}}) as r:
        for _ in r.iter_lines():
            n += 1
            if stop is not None and stop.is_set():
                break
    return n


def orphaned(pids: set[int]) -> set[int]:
    """Those of ``pids`` (llama-server processes) whose parent is not a running gateway
    (``gateway serve``): what a gateway left behind. Workers of gateways that other tests run
    at the same time keep their gateway as parent and are not counted."""
    out = set()
    for pid in pids:
        try:
            parent = psutil.Process(pid).parent()
            cmd = " ".join(parent.cmdline()) if parent is not None else ""
        except psutil.Error:
            continue  # gone meanwhile
        if "gateway serve" not in cmd:
            out.add(pid)
    return out


async def wait_health(session, url: str, tries: int = 300) -> None:
    """Wait (0.1 s a try) until ``url``'s ``/health`` answers 200, e.g. a llama-server a test
    started itself; ``session`` is an aiohttp ClientSession."""
    import aiohttp

    for _ in range(tries):
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url}/health not 200 after {tries} tries")


def worker_key(pid: int) -> str:
    """The per-start API key, read from the worker's environment (same user only)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for kv in env:
        if kv.startswith(b"LLAMA_API_KEY="):
            return kv.split(b"=", 1)[1].decode()
    raise KeyError("LLAMA_API_KEY")


class GatewayProc:
    def __init__(self, proc: subprocess.Popen, port: int, cfg_path: Path, log_path: Path,
                 headers: dict | None = None):
        self.proc, self.port, self.cfg_path, self.log_path = proc, port, cfg_path, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.headers = headers or {}  # e.g. an admin API key when auth is configured

    def status(self) -> dict:
        """``GET /gateway/api/workers`` (workers and queue)."""
        return httpx.get(self.url + "/gateway/api/workers", headers=self.headers, timeout=5).json()

    def workers(self) -> list[dict]:
        return self.status()["workers"]

    def wait_ready(self, timeout: float = 120, n: int | None = None) -> list[dict]:
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                ws = self.workers()
                last = ws
                if ws and all(w["state"] == "ready" for w in ws) and (n is None or len(ws) == n):
                    return ws
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"workers not ready: {last}\n{self.log_tail()}")

    def slots(self, worker: dict) -> list[dict]:
        """A worker's own ``/slots``, asked directly with its per-start key."""
        r = httpx.get(f"http://127.0.0.1:{worker['port']}/slots",
                      headers={"Authorization": f"Bearer {worker_key(worker['pid'])}"}, timeout=5)
        r.raise_for_status()
        return r.json()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def base_config(port: int, **over) -> dict:
    cfg = {
        "listen": f"127.0.0.1:{port}",
        "llama_server": {"threads": 1, "restart_backoff_initial_s": 0.2},
        "log": {"level": "info", "format": "json"},
        "models": [{"name": "demo", "path": "builtin:demo", "slots": 2, "context": 2048,
                    "cpu": 2}],
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def start_gateway(tmp_path: Path, cfg: dict, wait: bool = True, env: dict | None = None,
                  headers: dict | None = None) -> GatewayProc:
    port = int(cfg["listen"].rsplit(":", 1)[1])
    cfg_path = tmp_path / f"gateway-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / f"gateway-{port}.log"
    logf = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "-c", str(cfg_path)],
                            cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    gp = GatewayProc(proc, port, cfg_path, log_path, headers)
    end = time.monotonic() + 600  # first run on a fresh machine may build llama-server
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}:\n{gp.log_tail()}")
        try:
            httpx.get(gp.url + "/", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    if wait:
        gp.wait_ready()
    return gp


def stop_and_check_no_worker_left(gp: GatewayProc) -> None:
    """SIGTERM the gateway; it must exit cleanly and leave none of its llama-servers running."""
    pids = set()
    try:
        pids = {w["pid"] for w in gp.workers() if w.get("pid")}
    except Exception:
        pass
    rc = gp.stop()
    assert rc in (0, -9, 137), f"gateway exit status {rc}\n{gp.log_tail()}"
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "llama-server left running after gateway stop"


@pytest.fixture
def gateway_factory(tmp_path):
    started: list[GatewayProc] = []

    def factory(cfg: dict | None = None, wait: bool = True, headers: dict | None = None,
                **over) -> GatewayProc:
        cfg = cfg or base_config(free_port(), **over)
        gp = start_gateway(tmp_path, cfg, wait=wait, headers=headers)
        started.append(gp)
        return gp

    yield factory
    for gp in started:
        stop_and_check_no_worker_left(gp)


@pytest.fixture
def gateway(gateway_factory):
    """The default test gateway: 2 CPU workers × 2 slots of the demo model."""
    return gateway_factory()


@pytest.fixture(scope="module")
def module_gateway_factory(tmp_path_factory):
    """Like ``gateway_factory`` but module-scoped: one gateway shared by a test file.

    ``factory(cfg)`` starts ``cfg`` (a ``base_config(...)`` dict) and waits for its workers;
    teardown stops every gateway it started and checks that no worker is left running.
    """
    tmp_path = tmp_path_factory.mktemp("gw")
    started: list[GatewayProc] = []

    def factory(cfg: dict) -> GatewayProc:
        gp = start_gateway(tmp_path, cfg)
        started.append(gp)
        return gp

    yield factory
    for gp in started:
        stop_and_check_no_worker_left(gp)
