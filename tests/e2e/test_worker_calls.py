"""Side calls of ``/api/generate`` (``/apply-template``, ``/tokenize``) on real workers
(gateway/worker_calls.py; field cases 1, 2, 11 and 15).

* While one of two workers is restarted through the admin API, or frozen with SIGSTOP,
  ``/api/generate`` (not raw, streamed and not) keeps succeeding: its side calls go only to
  workers in rotation, and a side call that times out is retried on the other worker.
* With the queue full, a ``/api/generate`` gets Ollama's 503 at once and never reaches the
  worker's ``/apply-template`` (the gateway's debug log names every side call with its
  request id; a control request shows the log does name them).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import stat
import threading
import time

import httpx
import pytest

from gateway.api.errors import BUSY_MESSAGE
from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import model
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "admin-token-side-calls"


def generate(url: str, i: int, stream: bool, timeout: float = 120) -> tuple[bool, str]:
    """One non-raw ``/api/generate``; (ok, what came back). ok: 200, no error line, and a last
    line that is ``done`` with a non-empty ``context`` (the final ``/tokenize``)."""
    body = {"model": "demo", "prompt": f"say something about the number {i}", "stream": stream,
            "options": {"num_predict": 8}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=timeout) as r:
        text = r.read().decode()
    if r.status_code != 200:
        return False, f"{r.status_code} {text}"
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else {}
    ok = (not any("error" in line for line in lines) and last.get("done") is True
          and isinstance(last.get("context"), list) and len(last["context"]) > 0)
    return ok, text[-400:]


def _load(url: str, stop: threading.Event, results: list, n_threads: int = 4) -> list:
    """Threads that send non-raw generations (alternately streamed and not) until ``stop``."""
    def loop(k):
        i = 0
        while not stop.is_set():
            results.append(generate(url, k * 1000 + i, stream=bool(i % 2)))
            i += 1
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    return threads


def slow_exit_binary(tmp_path) -> str:
    """A wrapper around the real llama-server that, on SIGTERM, stops llama-server (its port
    closes at once) but exits itself only 3 s later: the stretch a real llama-server can take
    between SIGTERM and its exit (or the SIGKILL after ``stop_grace_s``), made long enough that
    requests arrive while the stopping worker's process is still there."""
    real = ensure_llama_server()
    wrapper = tmp_path / "slow-exit-llama-server"
    wrapper.write_text(f"#!/bin/sh\n'{real}' \"$@\" &\nchild=$!\n"
                       "trap 'kill -TERM $child; wait $child; sleep 3; exit 0' TERM\n"
                       "wait $child\nexit $?\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_generate_succeeds_while_a_worker_restarts_through_the_admin_api(tmp_path,
                                                                         gateway_factory):
    gw = gateway_factory(base_config(free_port(), admin={"token": ADMIN_TOKEN},
                                     shutdown={"drain_s": 10},
                                     llama_server={"binary": slow_exit_binary(tmp_path),
                                                   "threads": 1}),
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    victim = gw.workers()[0]
    stop, results = threading.Event(), []
    threads = _load(gw.url, stop, results)
    try:
        time.sleep(1.0)
        before = len(results)
        r = httpx.post(f"{gw.url}/gateway/api/admin/workers/{victim['id']}/restart",
                       headers=gw.headers, timeout=180)
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "ready" and r.json()["pid"] != victim["pid"]
        during = len(results) - before
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    bad = [text for ok, text in results if not ok]
    assert not bad, f"{len(bad)} of {len(results)} failed, e.g. {bad[:3]}"
    assert during >= 8, f"only {during} requests ran during the restart"


def test_generate_succeeds_while_a_worker_is_frozen(gateway_factory):
    """SIGSTOP: the frozen worker still counts as ready until liveness notices (2 probes of
    ``liveness_timeout_s``), so side calls that land on it time out and are retried on the
    other worker; then the supervisor restarts it (SIGKILL after the grace)."""
    gw = gateway_factory(base_config(free_port(), llama_server={
        "threads": 1, "liveness_interval_s": 1, "liveness_timeout_s": 2, "stop_grace_s": 2}))
    victim = gw.workers()[0]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(generate, gw.url, i, i % 2 == 0) for i in range(8)]
            results = [f.result() for f in futs]
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    bad = [text for ok, text in results if not ok]
    assert not bad, f"{len(bad)} of 8 failed, e.g. {bad[:3]}"
    assert all("127.0.0.1" not in text for _, text in results)
    ws = gw.wait_ready(timeout=90)
    assert next(w for w in ws if w["id"] == victim["id"])["pid"] != victim["pid"]


def _side_calls(log_path, request_id: str) -> list[str]:
    """Paths of the side calls the gateway log names for ``request_id`` (debug
    ``worker_call.done`` and warning ``worker_call.failed``)."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") in ("worker_call.done", "worker_call.failed") \
                and ev.get("request_id") == request_id:
            out.append(ev.get("path"))
    return out


def test_overflow_generate_is_refused_at_once_without_a_side_call(gateway_factory):
    cfg = base_config(free_port(), models=[model("demo", cpu=1, slots=2, context=4096)],
                      queue={"max_pending": 2, "retry_after_s": 3},
                      log={"level": "debug", "format": "json"})
    gw = gateway_factory(cfg)
    long = {"model": "demo", "prompt": "tell me a long story", "raw": True, "stream": False,
            "options": {"num_predict": 1500, "temperature": 1.0}}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=long, timeout=300)
                for _ in range(4)]
        end = time.monotonic() + 30
        while gw.status()["queue"]["depth"] < 2:  # 2 running, 2 queued: the queue is full
            assert time.monotonic() < end, gw.status()
            time.sleep(0.05)
        body = {"model": "demo", "prompt": "hello", "stream": False}
        t0 = time.monotonic()
        probe = httpx.post(gw.url + "/api/generate", json=body, timeout=60,
                           headers={"X-Request-ID": "overflow-probe"})
        took = time.monotonic() - t0
        full_after = gw.status()["queue"]["depth"] == 2
        longs = [f.result() for f in futs]
    assert full_after  # the queue was still full when the probe was answered
    assert probe.status_code == 503, probe.text
    assert probe.json() == {"error": BUSY_MESSAGE} and probe.headers["Retry-After"] == "3"
    assert took < 0.5, took
    assert [r.status_code for r in longs] == [200] * 4
    control = httpx.post(gw.url + "/api/generate", json=body, timeout=120,
                         headers={"X-Request-ID": "overflow-control"})
    assert control.status_code == 200, control.text
    time.sleep(0.3)  # the log is written by the gateway process
    assert "/apply-template" in _side_calls(gw.log_path, "overflow-control")
    assert _side_calls(gw.log_path, "overflow-probe") == []
    # At log level debug the workers run at llama-server's default verbosity: their per-request
    # info lines (here, a slot launching a task) reach the gateway's log.
    assert '"worker.output"' in gw.log_path.read_text()
    assert "launch_slot_" in gw.log_path.read_text()


def test_a_full_queue_refuses_long_prompts_and_embed_truncation_before_any_side_call(
        gateway_factory):
    """A prompt longer than the slot context in bytes (``/api/generate``, ``/api/chat``, ``/v1``)
    is counted by a worker's ``/tokenize``, and so is an ``/api/embed`` input to truncate; with
    the queue full they get admission's 503 at once instead. The workers are frozen (SIGSTOP), so
    a side call could only time out (``liveness_timeout_s`` per try): a fast 503 and no side call
    in the log show none was made. A control with room in the queue shows the side call is
    made and logged with its request id."""
    cfg = base_config(free_port(), models=[model("demo", cpu=1, slots=1, context=256),
                                           model("embed", embeddings=True, cpu=1, slots=1,
                                                 context=256)],
                      queue={"max_pending": 1, "retry_after_s": 3, "timeout_s": 20},
                      llama_server={"threads": 1, "liveness_interval_s": 120,
                                    "liveness_timeout_s": 5},
                      log={"level": "debug", "format": "json"})
    gw = gateway_factory(cfg)
    workers = gw.workers()
    # 405 bytes: more than 256, so only a worker's /tokenize can tell whether it fits 256 tokens
    # (it does not: 256), and less than the scheduler's estimate refuses up front (about 620
    # with the demo tokenizer's 1.93 bytes per token).
    long = "lorem ipsum dolor sit amet " * 15
    probes = {
        "probe-generate": ("/api/generate", {"model": "demo", "prompt": long, "raw": True,
                                             "stream": False}),
        "probe-chat": ("/api/chat", {"model": "demo", "stream": False,
                                     "messages": [{"role": "user", "content": long}]}),
        "probe-v1": ("/v1/chat/completions", {"model": "demo",
                                              "messages": [{"role": "user", "content": long}]}),
        "probe-embed": ("/api/embed", {"model": "embed", "input": long}),
    }
    short = {"model": "demo", "prompt": "hi", "raw": True, "stream": False,
             "options": {"num_predict": 4}}
    # Once before the freeze: the gateway asks each model's /props once (capabilities).
    assert httpx.post(gw.url + "/api/generate", json=short, timeout=60).status_code == 200
    assert httpx.post(gw.url + "/api/embed", json={"model": "embed", "input": "hi"},
                      timeout=60).status_code == 200
    answers = {}
    with cf.ThreadPoolExecutor(3) as ex:
        for w in workers:
            os.kill(w["pid"], signal.SIGSTOP)
        try:
            fillers = [ex.submit(httpx.post, gw.url + "/api/generate", json=short, timeout=120),
                       ex.submit(httpx.post, gw.url + "/api/embed", timeout=120,
                                 json={"model": "embed", "input": "hi"})]
            end = time.monotonic() + 10
            while sum(w["busy"] for w in gw.workers()) < 2:  # both slots leased (frozen)
                assert time.monotonic() < end, gw.status()
                time.sleep(0.05)
            fillers.append(ex.submit(httpx.post, gw.url + "/api/generate", json=short,
                                     timeout=120))
            while gw.status()["queue"]["depth"] < 1:  # the queue (1) is full
                assert time.monotonic() < end, gw.status()
                time.sleep(0.05)
            for rid, (path, body) in probes.items():
                t0 = time.monotonic()
                r = httpx.post(gw.url + path, json=body, timeout=60, headers={"X-Request-ID": rid})
                answers[rid] = (r, time.monotonic() - t0)
            full = gw.status()["queue"]["depth"] == 1  # still full after the probes
        finally:
            for w in workers:
                os.kill(w["pid"], signal.SIGCONT)
        assert [f.result().status_code for f in fillers] == [200] * 3
    assert full, {rid: (r.status_code, round(took, 3)) for rid, (r, took) in answers.items()}
    for rid, (r, took) in answers.items():
        assert r.status_code == 503 and r.headers["Retry-After"] == "3", (rid, r.text)
        assert took < 0.5, (rid, took)
        if rid == "probe-v1":
            assert r.json()["error"]["message"] == BUSY_MESSAGE
        else:
            assert r.json() == {"error": BUSY_MESSAGE}
    control = httpx.post(gw.url + "/api/generate", json=probes["probe-generate"][1], timeout=60,
                         headers={"X-Request-ID": "control-generate"})
    err = control.json()["error"]  # the exact count (no "about"): /tokenize answered
    assert control.status_code == 400 and "context length" in err and "about" not in err, err
    embed = httpx.post(gw.url + "/api/embed", json=probes["probe-embed"][1], timeout=60,
                       headers={"X-Request-ID": "control-embed"})
    assert embed.status_code == 200 and len(embed.json()["embeddings"]) == 1
    time.sleep(0.3)  # the log is written by the gateway process
    assert _side_calls(gw.log_path, "control-generate") == ["/tokenize"]
    assert _side_calls(gw.log_path, "control-embed") == ["/tokenize"]
    for rid in probes:
        assert _side_calls(gw.log_path, rid) == [], rid


def test_a_worker_without_a_side_call_endpoint_gives_502_not_404(tmp_path, gateway_factory):
    """A fresh tester's find: a worker whose llama-server lacks a side-call route (here the
    FAKE of tests/fakes in ``marker`` mode, which serves ``/completion`` and ``/apply-template``
    but not ``/tokenize``, which ``/api/generate`` without ``raw`` asks for its ``context``)
    made ``/api/generate`` answer 404 ``404: Not Found``, which Ollama clients read as "model
    not found". The side call's error is a 502 that names the endpoint, and logged. That
    ``/tokenize`` is the last step of an answer already generated: the answer then ends with
    its done object without ``context`` (``generate.context_failed``), streamed or not,
    rather than an error in its place (another fresh tester's find: a finished stream ended
    with an error line when the only worker that could tokenize it crashed)."""
    from tests.fakes import fake_binary
    binary = fake_binary(tmp_path, "marker", first_only=False)
    cfg = base_config(free_port(), llama_server={"binary": str(binary)},
                      models=[{"name": "demo", "path": "builtin:demo", "slots": 1,
                               "context": 512, "cpu": 1}])
    gw = gateway_factory(cfg)
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "hi",
                                                   "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True and r.json()["response"] and "context" not in r.json()
    with httpx.stream("POST", gw.url + "/api/generate", timeout=30,
                      json={"model": "demo", "prompt": "hi"}) as s:
        lines = [json.loads(x) for x in s.iter_lines() if x.strip()]
    assert s.status_code == 200 and lines[-1]["done"] is True and "context" not in lines[-1]
    assert not [x for x in lines if "error" in x], lines
    events = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
    assert [e for e in events if e["event"] == "worker_call.unsupported"]
    failed = [e for e in events if e["event"] == "generate.context_failed"]
    assert len(failed) == 2 and failed[0]["error"] == (
        "the workers of model 'demo:latest' do not serve /tokenize (HTTP 404 from "
        "llama-server); the gateway needs a llama-server build with it"), failed
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "hi", "raw": True,
                                                   "stream": False,
                                                   "options": {"num_predict": 3}}, timeout=30)
    assert r.status_code == 200 and r.json()["done"] is True  # its /completion still works


def test_generate_finishing_on_a_drained_only_worker_keeps_its_final_line(gateway_factory):
    """A generate whose model's only worker the operator drains while it runs still gets its
    ``done`` line with ``context``: the last side call (``/tokenize``) goes to the request's
    own worker, drained but running, instead of failing for want of a worker in rotation
    (the stream ended with an "every worker … is drained" error line, and the non-streamed
    answer was a 503 after the whole generation; a fresh tester's find)."""
    cfg = base_config(free_port(), admin={"token": ADMIN_TOKEN},
                      models=[{"name": "demo", "path": "builtin:demo", "slots": 2,
                               "context": 4096, "cpu": 1}])
    gw = gateway_factory(cfg)
    drain = gw.url + "/gateway/api/admin/workers/demo-cpu0/drain"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"model": "demo", "prompt": "x", "options": {"num_predict": 400}}
    out: dict = {}

    def streamed():
        with httpx.stream("POST", gw.url + "/api/generate", json=body, timeout=120) as r:
            out["stream"] = [json.loads(ln) for ln in r.iter_lines() if ln]

    def whole():
        out["whole"] = httpx.post(gw.url + "/api/generate", json={**body, "stream": False},
                                  timeout=120)

    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(streamed), ex.submit(whole)]
        end = time.monotonic() + 30
        while gw.workers()[0]["busy"] < 2:
            assert time.monotonic() < end, gw.workers()
            time.sleep(0.02)
        assert httpx.post(drain, headers=admin, timeout=10).status_code == 200
        for f in futs:
            f.result(120)
    last = out["stream"][-1]
    assert last.get("done") is True and last["eval_count"] == 400, last
    assert isinstance(last["context"], list) and len(last["context"]) > 400, last
    w = out["whole"]
    assert w.status_code == 200 and w.json()["done"] is True, w.text
    assert len(w.json()["context"]) > 400
    r = httpx.post(gw.url + "/api/generate", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 503 and "drained" in r.json()["error"]  # nothing new while drained
