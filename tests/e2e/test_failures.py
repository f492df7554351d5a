"""Worker and gateway failures on real processes (issue 2, field cases 12 and 14)."""

import concurrent.futures as cf
import json
import os
import signal
import time

import httpx
import pytest

from tests.conftest import base_config, free_port, pid_alive, start_gateway
from tests.fakes import fake_binary, slow_start_binary
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow

REQ = {"model": "demo", "prompt": "x", "raw": True, "stream": False,
       "options": {"num_predict": 400}}


def test_kill_worker_under_load_restarts_and_serves(gateway_factory):
    gw = gateway_factory()
    victim = gw.workers()[0]
    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=REQ, timeout=120)
                for _ in range(6)]
        time.sleep(0.3)
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result() for f in futs]
    # every request got an answer: complete, or a clear JSON error (no hang)
    for r in results:
        assert r.status_code in (200, 502, 500), r.text
        assert "done" in r.json() or "error" in r.json()
    ws = gw.wait_ready(timeout=60)
    again = next(w for w in ws if w["id"] == victim["id"])
    assert again["pid"] != victim["pid"] and again["restarts"] >= 1
    # it serves again: 4 concurrent requests use both workers' slots
    with cf.ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(lambda _: httpx.post(gw.url + "/api/generate", json=REQ, timeout=120),
                         range(4)))
    assert [r.status_code for r in rs] == [200] * 4
    direct = httpx.post(f"http://127.0.0.1:{again['port']}/completion",
                        json={"prompt": "x", "n_predict": 2}, timeout=30)
    assert direct.status_code == 401  # nobody reaches a worker without its per-start key


def test_a_workers_loading_503_never_reaches_a_client(tmp_path, gateway_factory):
    """Field case 12 with llama-server's own loading answer. The one worker is a FAKE
    (``loading`` mode): for 2 s every path, ``/health`` included, answers 503 ``Loading model``
    as llama-server does while it loads; then ``/health`` is 200 but its first 2 completions
    still answer that 503 (a worker that says it is ready too early). Requests sent meanwhile,
    streamed and not (``/api/generate`` with ``raw``: the FAKE answers ``/completion`` only),
    wait or are retried: every one gets 200 and its tokens, and none sees "Loading model"."""
    binary = fake_binary(tmp_path, "loading", first_only=False,
                         extra="--fake-loading-s 2 --fake-loading-completions 2")
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1},
                      models=[{"name": "demo", "path": "builtin:demo", "slots": 2,
                               "context": 2048, "cpu": 1}])
    gw = gateway_factory(cfg, wait=False)
    t0 = time.monotonic()
    assert {w["state"] for w in gw.workers()} == {"starting"}

    def one(i: int) -> tuple[int, str]:
        r = httpx.post(gw.url + "/api/generate", timeout=60, json={
            **REQ, "stream": i % 2 == 0, "options": {"num_predict": 4}})
        return r.status_code, r.text

    with cf.ThreadPoolExecutor(6) as ex:
        rs = list(ex.map(one, range(6)))
    assert [s for s, _ in rs] == [200] * 6, rs
    assert not any("Loading model" in t for _, t in rs), rs
    assert all("tok" in t for _, t in rs), rs  # the FAKE's tokens, not an empty answer
    assert time.monotonic() - t0 > 2  # they were sent while it loaded
    (w,) = gw.workers()
    assert w["state"] == "ready" and w["restarts"] == 0
    events = [json.loads(line) for line in gw.log_path.read_text().splitlines()
              if line.startswith("{")]
    retried = [e for e in events if e["event"] == "upstream.retry"]
    assert [e["reason"] for e in retried] == ["Loading model"] * 2, retried  # both 503s retried


def test_kill_gateway_leaves_no_worker(tmp_path):
    gw = start_gateway(tmp_path, base_config(free_port()))
    pids = [w["pid"] for w in gw.workers()]
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    gw.proc.kill()
    gw.proc.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)


def test_requests_during_worker_load_wait_without_503(tmp_path, gateway_factory):
    """Field case 12. The binary is a wrapper that sleeps 3 s before exec'ing the real
    llama-server, so the workers are loading while the requests arrive."""
    wrapper, _ = slow_start_binary(tmp_path, str(ensure_llama_server()), 3)
    cfg = base_config(free_port(), llama_server={"binary": str(wrapper), "threads": 1})
    gw = gateway_factory(cfg, wait=False)
    states = {w["state"] for w in gw.workers()}
    assert states == {"starting"}
    with cf.ThreadPoolExecutor(6) as ex:
        rs = list(ex.map(lambda _: httpx.post(gw.url + "/api/generate", timeout=120, json={
            **REQ, "options": {"num_predict": 8}}), range(6)))
    assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
    assert all(r.json()["done"] is True for r in rs)
