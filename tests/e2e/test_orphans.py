"""No llama-server outlives the gateway (field case 14): SIGKILL of the gateway while its
workers load and while they serve; the next start on the same address is clean."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from tests.conftest import (base_config, free_port, llama_server_pids, orphaned, pid_alive,
                            start_gateway)

pytestmark = pytest.mark.slow


def _children_gone(pids: set[int], timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_sigkill_gateway_while_loading_and_serving_leaves_no_worker(tmp_path):
    before = llama_server_pids()
    port = free_port()
    cfg = base_config(port)
    # 1: while the workers load
    gw = start_gateway(tmp_path, cfg, wait=False)
    pids: set[int] = set()
    ws: list[dict] = []
    end = time.monotonic() + 20
    while len(pids) < 2 and time.monotonic() < end:
        ws = gw.workers()  # one snapshot: pids and states seen together (the demo loads fast)
        pids = {w["pid"] for w in ws if w["pid"]}
        time.sleep(0.01)
    assert len(pids) == 2 and any(w["state"] == "starting" for w in ws), ws
    gw.proc.kill()
    gw.proc.wait()
    assert _children_gone(pids), "llama-server survived a SIGKILLed gateway (loading)"
    # 2: next start on the same address is clean, then SIGKILL while serving
    gw = start_gateway(tmp_path, cfg)
    pids = {w["pid"] for w in gw.workers()}
    body = {"model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 3000}}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=body, timeout=60)
                for _ in range(4)]
        end = time.monotonic() + 20
        while sum(w["busy"] for w in gw.workers()) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        gw.proc.kill()
        gw.proc.wait()
        for f in futs:  # clients see a broken connection, not a hang
            with pytest.raises(httpx.HTTPError):
                f.result(timeout=30)
    assert _children_gone(pids), "llama-server survived a SIGKILLed gateway (serving)"
    gw = start_gateway(tmp_path, cfg)
    ws = gw.workers()
    assert all(w["state"] == "ready" for w in ws)
    r = httpx.post(gw.url + "/api/generate", json={**body, "stream": False,
                                                   "options": {"num_predict": 4}}, timeout=60)
    assert r.status_code == 200
    assert "gateway.stale_worker_reaped" not in gw.log_path.read_text()  # nothing was left
    gw.stop()
    assert _children_gone({w["pid"] for w in ws})
    assert orphaned(llama_server_pids() - before) == set()  # other tests' workers aside


def test_a_second_gateway_on_a_live_gateways_address_refuses_and_leaves_its_workers(
        tmp_path, gateway_factory):
    """A second ``serve`` on the address a running gateway listens on must not take that
    gateway's workers for stale ones (their pid files are in run/<host>_<port>/): it exits 2
    with a one-line reason, and the running gateway keeps its workers and keeps serving."""
    import subprocess
    import sys

    gw = gateway_factory(base_config(free_port()))
    pids = {w["pid"] for w in gw.workers()}
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "-c", str(gw.cfg_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"listen: 127.0.0.1:{gw.port} is already in use" in r.stderr
    assert "Traceback" not in r.stderr and "stale_killed" not in r.stdout + r.stderr
    assert all(pid_alive(p) for p in pids)
    assert {w["pid"] for w in gw.workers()} == pids
    body = {"model": "demo", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(gw.url + "/api/generate", json=body, timeout=60).json()["done"] is True
