"""Watchdogs and liveness on real gateways (field cases 6, 10, 11).

Broken workers are the FAKE llama-server of tests/fakes (first spawn only; its restart and
the other worker are real llama-server processes on the demo model).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import threading
import time
from datetime import datetime

import httpx
import openai
import pytest
import yaml

from tests.conftest import base_config, free_port, long_stream, pid_alive
from tests.fakes import fake_binary, is_fake
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow


def stream_lines(url: str, body: dict, timeout: float = 60) -> tuple[int, list[dict]]:
    """POST a streaming request; returns (status, parsed NDJSON lines)."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
        return r.status_code, lines


def wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def log_events(path) -> list[dict]:
    """The gateway's JSON log lines, parsed (other lines skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_silent_worker_requests_move_elsewhere(tmp_path, gateway_factory):
    """Case 10: a worker answers /health but never replies to completions. Requests sent to
    it time out on first byte and are retried on the other worker; the silent worker is
    checked and restarted (with 1 slot, after its first stall: that request held its last
    free slot, which it never frees)."""
    binary = fake_binary(tmp_path, "silent", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "wedge_after_stalls": 2, "stop_grace_s": 2},
                      timeouts={"first_byte_s": 1.5},
                      # identical prompts would all go to their prefix's home worker; this test
                      # needs them spread so the silent worker sees 2 stalls in a row
                      scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fake = wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    body = {"model": "demo", "prompt": "hi", "raw": True, "options": {"num_predict": 16}}
    # A retry avoids the worker it stalled on, so each wave puts at most a request or two on
    # the silent worker; waves until it has stalled twice in a row and is restarted.
    for _ in range(6):
        with cf.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(stream_lines, gw.url + "/api/generate", body) for _ in range(4)]
            results = [f.result(timeout=90) for f in futs]
        for status, lines in results:
            assert status == 200 and lines[-1].get("done") is True, lines[-1:]
            assert lines[-1]["done_reason"] == "length"
        if '"worker.wedged"' in gw.log_path.read_text() or not any(
                is_fake(w["pid"]) for w in gw.workers() if w["pid"]):
            break
    assert "upstream.retry" in gw.log_path.read_text()
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == fake["id"]
                               and x["state"] == "ready" and x["pid"] != fake["pid"]), None),
                 60, "silent worker restarted")
    assert w["wedges"] >= 1 and not is_fake(w["pid"])
    # restarted because it failed the stall check (its slot never frees), not for the stalls alone
    wedged = [e for e in log_events(gw.log_path) if e.get("event") == "worker.wedged"]
    assert wedged and "every slot stayed busy with no progress" in wedged[0]["reason"], wedged
    assert not pid_alive(fake["pid"])
    st = gw.status()
    assert st["queue"]["depth"] == 0 and all(x["busy"] == 0 for x in st["workers"])


def _fake_beside_a_real_worker(tmp_path, gateway_factory, mode: str, liveness_timeout_s: float):
    """(gateway, the FAKE's worker) of two single-slot workers: the first spawn is the FAKE in
    ``mode``, the other worker and every restart real; ``first_byte_s`` 1.5, no affinity."""
    binary = fake_binary(tmp_path, mode, real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "stop_grace_s": 2,
                                                  "liveness_timeout_s": liveness_timeout_s},
                      timeouts={"first_byte_s": 1.5}, scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fake = wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    return gw, fake


def test_a_worker_that_never_schedules_requests_is_restarted_after_one_stall(tmp_path,
                                                                            gateway_factory):
    """Case 10, "mark the worker suspect" (a fresh tester's find): a worker whose ``/health``,
    ``/slots`` (every slot idle) and main loop answer but that never answers a completion (the
    FAKE ``unscheduled``; the tester put a proxy that held completions in front of
    llama-server) passed every stall check, so about every second request waited
    ``first_byte_s`` for it and was then answered by the other worker, for good. Now a request
    it never answered (the check of its stall) and one the other worker then answered (the
    suspect mark) make its check send a one-token completion, which it fails: it is
    restarted, and exactly one request waited."""
    gw, fake = _fake_beside_a_real_worker(tmp_path, gateway_factory, "unscheduled", 2)
    took = []
    for i in range(12):  # one after another: the fake gets one of the first few
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": f"seq {i}", "raw": True, "stream": True,
            "options": {"num_predict": 4}})
        took.append(time.monotonic() - t0)
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["done"] is True
    slow = [t for t in took if t >= 1.5]
    assert len(slow) == 1, took  # old code: every request placed on the fake (about half)
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == fake["id"]
                               and x["state"] == "ready" and x["pid"] != fake["pid"]), None),
                 60, "the worker restarted")
    assert w["wedges"] == 1 and not is_fake(w["pid"]) and not pid_alive(fake["pid"])
    events = log_events(gw.log_path)
    suspect = [e for e in events if e.get("event") == "worker.suspect"]
    assert [e["worker"] for e in suspect] == [fake["id"]], suspect
    (wedged,) = [e for e in events if e.get("event") == "worker.wedged"]
    assert wedged["worker"] == fake["id"]
    # found by the check of its first stall (it held the worker's only slot), whose one-token
    # completion it did not answer; the suspect mark asked for the same check
    assert "a one-token completion (POST /completion) while a slot was idle did not answer " \
           "within" in wedged["reason"], wedged
    ok = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "after", "raw": True, "stream": False,
        "options": {"num_predict": 4}})
    assert ok.status_code == 200 and ok.json()["done_reason"] == "length"


def test_every_worker_that_never_schedules_requests_is_restarted(tmp_path, gateway_factory):
    """Case 10 with every worker of the model silent the same way (both FAKE ``unscheduled``;
    their restarts are real): no retry was ever answered elsewhere, so neither was suspect, each
    stall check passed (main loop and idle ``/slots`` answer) and every request waited 3 ×
    ``first_byte_s`` for its 504, for good (a fresh tester's find with a proxy that held
    completions on both workers). Each check now sends the one-token completion: both workers
    fail it and are restarted, and the model serves again."""
    binary = fake_binary(tmp_path, "unscheduled", real=str(ensure_llama_server()), fakes=2)
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "stop_grace_s": 2, "liveness_timeout_s": 2},
                      timeouts={"first_byte_s": 1.5}, scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fakes = {w["id"]: w["pid"] for w in gw.workers()}
    assert all(is_fake(p) for p in fakes.values()), fakes
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "first", "raw": True, "stream": False,
        "options": {"num_predict": 4}})
    # its tries met the fakes (each found wedged under it: 502, not tried on a third) or
    # their restarts; a clear JSON error either way
    assert r.status_code in (200, 502, 504) and (r.status_code == 200 or "error" in r.json()), r.text
    ws = wait_for(lambda: (lambda ws: ws if all(w["state"] == "ready" and w["pid"] != fakes[w["id"]]
                                                for w in ws) else None)(gw.workers()),
                  60, "both workers restarted")
    assert all(w["wedges"] == 1 and not is_fake(w["pid"]) for w in ws), ws
    wedged = [e for e in log_events(gw.log_path) if e.get("event") == "worker.wedged"]
    assert sorted(e["worker"] for e in wedged) == sorted(fakes), wedged
    assert all("a one-token completion (POST /completion) while a slot was idle did not "
               "answer within" in e["reason"] for e in wedged), wedged
    for i in range(3):
        t0 = time.monotonic()
        ok = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": f"after {i}", "raw": True, "stream": False,
            "options": {"num_predict": 4}})
        assert ok.status_code == 200 and time.monotonic() - t0 < 1.5, ok.text


def test_a_retry_goes_to_another_worker_not_back_to_the_silent_one(tmp_path, gateway_factory):
    """Case 10, found by a fresh tester: with prefix affinity a request's retries went back to
    the silent worker it had just timed out on. Each request now needs at most one retry."""
    binary = fake_binary(tmp_path, "silent", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "wedge_after_stalls": 100},
                      timeouts={"first_byte_s": 1.0})
    gw = gateway_factory(cfg)
    wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    for i in range(4):
        rid = f"retry-{i}"
        r = httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": rid}, timeout=60,
                       json={"model": "demo", "prompt": f"seq {i}", "raw": True, "stream": False,
                             "options": {"num_predict": 4}})
        assert r.status_code == 200 and r.json()["done_reason"] == "length"
        retries = [ln for ln in gw.log_path.read_text().splitlines()
                   if '"upstream.retry"' in ln and f'"{rid}"' in ln]
        assert len(retries) <= 1, retries


def test_queue_wait_of_a_retried_request_counts_every_attempt(tmp_path, gateway_factory):
    """``queue_wait_ms`` in ``request.done`` is the time a request spent queued over all its
    attempts. Here one request queues behind another on the silent worker (the real one is
    drained), gets that worker when the other is retried away after ``first_byte_s``, is itself
    retried after ``first_byte_s`` and then finds the real worker free: its wait is the first
    attempt's (about ``first_byte_s``), not the retry's alone (about 0, as it used to log), and
    not its time on the silent worker either."""
    admin = {"Authorization": "Bearer admin-token"}
    binary = fake_binary(tmp_path, "silent", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), admin={"token": "admin-token"},
                      llama_server={"binary": str(binary), "threads": 1,
                                    "wedge_after_stalls": 100},
                      timeouts={"first_byte_s": 2.0}, scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fake = wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    real = next(w["id"] for w in gw.workers() if w["id"] != fake["id"])

    def busy(worker_id: str) -> int:
        return next(w["busy"] for w in gw.workers() if w["id"] == worker_id)

    def post(rid: str):
        return httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": rid}, timeout=60,
                          json={"model": "demo", "prompt": "hi", "raw": True, "stream": False,
                                "options": {"num_predict": 1}})

    def log_lines(event: str, rid: str) -> list[dict]:
        return [json.loads(ln) for ln in gw.log_path.read_text().splitlines()
                if f'"{event}"' in ln and f'"{rid}"' in ln]

    r = httpx.post(f"{gw.url}/gateway/api/admin/workers/{real}/drain", headers=admin, timeout=10)
    assert r.status_code == 200, r.text
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(post, "occupies-silent")
        wait_for(lambda: busy(fake["id"]) == 1, 10, "first request on the silent worker")
        second = ex.submit(post, "queued-then-retried")
        wait_for(lambda: gw.status()["queue"]["depth"] == 1, 10, "second request queued")
        # the first is retried away from the silent worker, which the second then gets
        wait_for(lambda: log_lines("upstream.retry", "occupies-silent"), 10, "first retried")
        r = httpx.post(f"{gw.url}/gateway/api/admin/workers/{real}/undrain", headers=admin,
                       timeout=10)
        assert r.status_code == 200, r.text
        assert first.result(timeout=60).status_code == 200
        assert second.result(timeout=60).status_code == 200
    retries = log_lines("upstream.retry", "queued-then-retried")
    assert [e["worker"] for e in retries] == [fake["id"]], retries
    done = wait_for(lambda: log_lines("request.done", "queued-then-retried"), 5, "request.done")
    assert done[0]["worker"] == real, done
    assert done[0]["queue_wait_ms"] >= 1000, done  # it queued behind the first request
    assert done[0]["queue_wait_ms"] <= done[0]["ms"] - 2000, done  # not its 2 s on the fake


def test_non_streamed_v1_on_a_silent_worker_is_retried_or_failed_like_a_stream(tmp_path,
                                                                              gateway_factory):
    """Case 10 for non-streamed /v1 requests: they are streamed from the worker, so the
    first-byte watchdog covers them (before, only timeouts.request_s did). A request that
    lands on the silent worker is retried on the real one after first_byte_s; with only a
    silent worker it fails with a 504 JSON after the retries instead of hanging."""
    binary = fake_binary(tmp_path, "silent", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "wedge_after_stalls": 100},
                      timeouts={"first_byte_s": 1.0}, scheduler={"prefix_affinity": False})
    gw = gateway_factory(cfg)
    wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def ask(rid: str):
        t0 = time.monotonic()
        r = client.chat.completions.create(model="demo", max_tokens=4, extra_headers={
            "X-Request-ID": rid}, messages=[{"role": "user", "content": rid}])
        return r, time.monotonic() - t0

    retried = []
    for wave in range(4):  # two at once: one of each pair goes to the other (silent) worker
        with cf.ThreadPoolExecutor(2) as ex:
            results = list(ex.map(ask, [f"ns-{wave}-{i}" for i in range(2)]))
        for r, took in results:
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
            assert took < 10
        retried = [ln for ln in gw.log_path.read_text().splitlines()
                   if '"upstream.retry"' in ln and '"ns-' in ln]
        if retried:
            break
    assert retried and "sent nothing within 1 s" in retried[0]

    (tmp_path / "all").mkdir()
    only_silent = fake_binary(tmp_path / "all", "silent", first_only=False)
    cfg = base_config(free_port(), llama_server={"binary": str(only_silent),
                                                  "wedge_after_stalls": 100},
                      timeouts={"first_byte_s": 1.0})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg)
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "hi",
                                                     "max_tokens": 4}, timeout=60)
    assert r.status_code == 504 and "sent nothing within 1 s" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10  # 3 tries of 1 s, not timeouts.request_s (3600 s)


def test_a_request_silencing_every_single_slot_worker_gets_504_and_they_recover(
        tmp_path, gateway_factory):
    """Case 10 with every worker silent, found by a fresh tester: 2 FAKE silent workers × 1
    slot (their restarts are real llama-server processes). The request stalls on one worker,
    then on the other, then (its third try, back on a worker it tried) again, and gets its 504
    JSON after about 3 × ``first_byte_s``, not a 503 at ``queue.timeout_s``. Each stall held
    its worker's last free slot, which the FAKE never frees although the gateway cancelled the
    request, so each worker is checked after that one stall (not after ``wedge_after_stalls``
    2 in a row, which one of them never reached): both fail (a busy slot, nothing moving) and
    are restarted, and a later request is answered. Before, the worker with one stall stayed
    in rotation with its slot leaked and was never checked."""
    binary = fake_binary(tmp_path, "silent", real=str(ensure_llama_server()), fakes=2)
    # liveness_timeout_s (the check's length) outlasts the 3 tries, so all 3 meet FAKEs
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "wedge_after_stalls": 2, "stop_grace_s": 2,
                                                  "liveness_timeout_s": 6},
                      timeouts={"first_byte_s": 1.5}, queue={"timeout_s": 60})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fakes = gw.workers()
    assert len(fakes) == 2 and all(is_fake(w["pid"]) for w in fakes), fakes
    body = {"model": "demo", "prompt": "hi", "raw": True, "stream": False,
            "options": {"num_predict": 4}}
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/api/generate", json=body, timeout=90)
    took = time.monotonic() - t0
    assert r.status_code == 504, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() in [{"error": f"worker {w['id']} sent nothing within 1.5 s"} for w in fakes]
    assert 4.3 <= took < 12, took  # 3 tries of 1.5 s; queue.timeout_s is 60
    for f in fakes:  # each restarted, as a real llama-server, because its check failed
        w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == f["id"]
                                   and x["state"] == "ready" and x["pid"] != f["pid"]), None),
                     60, f"worker {f['id']} restarted")
        assert w["wedges"] == 1 and not is_fake(w["pid"]) and not pid_alive(f["pid"]), w
    wedged = [e for e in log_events(gw.log_path) if e.get("event") == "worker.wedged"]
    assert sorted(e["worker"] for e in wedged) == sorted(f["id"] for f in fakes), wedged
    assert all(e["reason"].startswith("a stalled request held its last free slot and every "
                                      "slot stayed busy with no progress") for e in wedged), wedged
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "length", r.text
    assert r.json()["eval_count"] == 4 and time.monotonic() - t0 < 10
    st = gw.status()
    assert st["queue"]["depth"] == 0 and all(x["busy"] == 0 for x in st["workers"])


SHORT = {"model": "demo", "prompt": "hello", "raw": True, "stream": False,
         "options": {"num_predict": 5}}


def answered_short(gw) -> None:
    """``SHORT`` through the gateway is answered: 200, 5 tokens, ``done_reason`` length."""
    r = httpx.post(gw.url + "/api/generate", json=SHORT, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "length", r.text
    assert r.json()["eval_count"] == 5


def test_requests_that_stall_on_a_working_worker_do_not_restart_it(tmp_path, gateway_factory):
    """A request that makes a worker go silent for itself alone (the FAKE in mode ``marker``:
    silent for completions holding ``STALL-ME``, healthy otherwise) stalls on every try and
    ends with a 504 JSON in bounded time (3 tries of ``first_byte_s``). Each streak of 2
    stalls makes the gateway check the worker; it passes (its main loop answers, its slots
    free), so it is not restarted: same pid, no wedge, other requests answered, and one
    ``worker.stall_not_wedged`` event per streak. Before, the second stall restarted it."""
    binary = fake_binary(tmp_path, "marker", first_only=False)
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "wedge_after_stalls": 2,
                                                  "liveness_timeout_s": 2},
                      timeouts={"first_byte_s": 1.0})
    cfg["models"][0].update(cpu=1, slots=2)
    gw = gateway_factory(cfg)
    (w0,) = gw.workers()
    assert is_fake(w0["pid"])
    ok = SHORT
    stalled = f"worker {w0['id']} sent nothing within 1 s"
    answered_short(gw)
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/api/generate", json={**ok, "prompt": "STALL-ME"}, timeout=60)
    assert (r.status_code, r.json()) == (504, {"error": stalled}), r.text
    assert time.monotonic() - t0 < 10  # 3 tries of 1 s, not timeouts.request_s (3600 s)
    answered_short(gw)
    t0 = time.monotonic()
    with httpx.stream("POST", gw.url + "/api/generate", timeout=60,
                      json={**ok, "prompt": "STALL-ME again", "stream": True}) as r:
        assert (r.status_code, json.loads(r.read())) == (504, {"error": stalled})
    assert time.monotonic() - t0 < 10
    answered_short(gw)
    time.sleep(0.3)  # the log is written by the gateway process
    (w,) = gw.workers()
    assert (w["pid"], w["state"], w["wedges"], w["restarts"]) == (w0["pid"], "ready", 0, 0), w
    events = log_events(gw.log_path)
    kept = [e for e in events if e.get("event") == "worker.stall_not_wedged"]
    # 6 stalls: at least one streak per stalling request (an answer that ends within one
    # watchdog tick is not seen as progress, so a streak may span the answers between them)
    assert len(kept) in (2, 3), kept
    assert all(e["worker"] == w0["id"] and e["gpu"] == "cpu" and e["stalls"] == 2 for e in kept)
    assert not [e for e in events if e.get("event") == "worker.wedged"]


def stream_while(url: str, body: dict, hold_s: float) -> tuple[float, float, bool]:
    """Stream ``body`` and read it for ``hold_s`` s, then leave (close the connection).
    Returns (clock of the first line, clock of the last line read, whether it had ended)."""
    first = last = None
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        t0 = time.monotonic()
        for line in r.iter_lines():
            if not line.strip():
                continue
            last = time.monotonic()
            first = first or last
            if json.loads(line).get("done") or last - t0 >= hold_s:
                return first, last, bool(json.loads(line).get("done"))
    return first, last, True


def leak_a_slot(gw, w0: dict) -> dict:
    """Send the FAKE (mode ``marker``) worker ``w0`` a ``LEAK-ME`` request: it gets its 504
    JSON after 3 tries of ``first_byte_s`` (1 s); the slot of its first try stays busy. Returns
    that slot as the worker's ``/slots`` shows it; the gateway holds no lease there."""
    r = httpx.post(gw.url + "/api/generate", json={**SHORT, "prompt": "LEAK-ME"}, timeout=60)
    assert (r.status_code, r.json()) == (504, {"error": f"worker {w0['id']} sent nothing "
                                                        "within 1 s"}), r.text

    def one_busy():  # the slots of the later tries free within about 0.05 s of their cancel
        b = [s for s in gw.slots(w0) if s["is_processing"]]
        return b if len(b) == 1 else None

    (busy,) = wait_for(one_busy, 3, "one slot busy")
    assert gw.workers()[0]["busy"] == 0
    return busy


def test_a_leaked_slot_restarts_its_worker(tmp_path, gateway_factory):
    """Field case 10 on one slot of several: the FAKE (mode ``marker``, 2 slots) keeps the slot
    of its first ``LEAK-ME`` request busy forever, even after the gateway cancelled it, and
    serves others on its other slot. The request gets its 504 JSON after 3 tries of
    ``first_byte_s``; its stalls pass the stall check (a slot frees, work moves), so the worker
    is kept and other requests are served meanwhile. The slot stays busy with one ``id_task``
    and no request of the gateway on the worker is older, so after ``leaked_slot_s`` the
    worker is restarted as an admin restart does it (``worker.slot_leaked``; the restart is a
    real llama-server), and then it runs 2 requests at once again, longer than
    ``leaked_slot_s``, without being taken for a leak. Before, it stayed one slot short."""
    leak_s = 5.0
    binary = fake_binary(tmp_path, "marker", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={"binary": str(binary), "threads": 1,
                                                  "leaked_slot_s": leak_s, "stop_grace_s": 2,
                                                  "liveness_timeout_s": 2},
                      timeouts={"first_byte_s": 1.0})
    # context shift: the demo model's 4,096 tokens of context last about 3 s of generation;
    # the requests below run longer than leaked_slot_s
    cfg["models"][0].update(cpu=1, slots=2, context=4096, args=["--context-shift"])
    gw = gateway_factory(cfg)
    (w0,) = gw.workers()
    assert is_fake(w0["pid"])
    answered_short(gw)
    t0 = time.monotonic()
    busy = leak_a_slot(gw, w0)
    assert time.monotonic() - t0 < leak_s  # 3 tries of 1 s, before the leak is acted on
    served = 0
    while gw.workers()[0]["pid"] == w0["pid"]:  # its other slot serves until the restart
        assert time.monotonic() - t0 < 1 + leak_s + 10, "the worker was never restarted"
        answered_short(gw)
        served += 1
        time.sleep(0.2)
    assert served >= 3
    w = wait_for(lambda: next((x for x in gw.workers() if x["state"] == "ready"
                               and x["pid"] not in (None, w0["pid"])), None), 60, "restart")
    assert not is_fake(w["pid"]) and not pid_alive(w0["pid"])
    assert (w["slot_leaks"], w["restarts"], w["wedges"]) == (1, 1, 0), w
    leaked = [e for e in log_events(gw.log_path) if e.get("event") == "worker.slot_leaked"]
    assert len(leaked) == 1, leaked
    e = leaked[0]
    assert (e["worker"], e["gpu"], e["slot"], e["id_task"], e["pid"]) == (
        w0["id"], "cpu", busy["id"], busy["id_task"], w0["pid"]), e
    # unclaimed from the first try's cancel (its lease was older than the task) on; within
    # about a poll of leaked_slot_s (the event rounds it to 0.1 s)
    assert leak_s <= e["unclaimed_s"] <= leak_s + 1.5 and e["busy_s"] >= e["unclaimed_s"], e
    # both slots again, each generating for longer than leaked_slot_s
    long = {"model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 30000}}
    with cf.ThreadPoolExecutor(2) as ex:
        runs = list(ex.map(lambda _: stream_while(gw.url + "/api/generate", long, leak_s + 2),
                           range(2)))
    assert max(f for f, _, _ in runs) < min(last for _, last, _ in runs), runs  # at once
    assert not any(done for _, _, done in runs), runs
    assert all(last - f >= leak_s + 1 for f, last, _ in runs), runs
    time.sleep(0.5)
    (after,) = gw.workers()
    assert (after["pid"], after["slot_leaks"], after["restarts"]) == (w["pid"], 1, 1), after
    assert len([e for e in log_events(gw.log_path) if e.get("event") == "worker.slot_leaked"]) == 1
    answered_short(gw)


def test_leaked_slot_s_0_is_off_and_a_reload_turns_it_on(tmp_path, gateway_factory):
    """``llama_server.leaked_slot_s`` 0: a leaked slot (the FAKE as above; every spawn is the
    FAKE here) is left alone. A reload that sets it applies to the running worker without
    restarting it for the reload; the leak, tracked all along, is then acted on at once."""
    binary = fake_binary(tmp_path, "marker", first_only=False)
    cfg = base_config(free_port(), admin={"token": "t"},
                      llama_server={"binary": str(binary), "leaked_slot_s": 0,
                                    "liveness_timeout_s": 2, "stop_grace_s": 2},
                      timeouts={"first_byte_s": 1.0})
    cfg["models"][0].update(cpu=1, slots=2)
    gw = gateway_factory(cfg)
    (w0,) = gw.workers()
    busy = leak_a_slot(gw, w0)
    time.sleep(4)
    (w,) = gw.workers()
    assert (w["pid"], w["state"], w["slot_leaks"]) == (w0["pid"], "ready", 0), w
    assert [s["id_task"] for s in gw.slots(w0) if s["is_processing"]] == [busy["id_task"]]
    cfg["llama_server"]["leaked_slot_s"] = 2
    gw.cfg_path.write_text(yaml.safe_dump(cfg))
    r = httpx.post(gw.url + "/gateway/api/admin/reload", headers={"Authorization": "Bearer t"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["unchanged"] == [w0["id"]], r.text
    t0 = time.monotonic()
    w = wait_for(lambda: next((x for x in gw.workers() if x["state"] == "ready"
                               and x["pid"] not in (None, w0["pid"])), None), 30, "restart")
    assert time.monotonic() - t0 < 10 and w["slot_leaks"] == 1, w
    (e,) = [e for e in log_events(gw.log_path) if e.get("event") == "worker.slot_leaked"]
    assert (e["slot"], e["id_task"], e["leaked_slot_s"]) == (busy["id"], busy["id_task"], 2), e
    assert e["unclaimed_s"] >= 4, e  # unclaimed since the first try's cancel, before the reload


def test_a_frozen_worker_is_still_restarted_when_requests_stall_on_it(tmp_path, gateway_factory):
    """A real llama-server frozen with SIGSTOP: requests sent to it stall and are retried on
    the other worker; the check finds its main loop silent and it is restarted (the periodic
    /slots probe is slowed down here, so the stall check is what catches it). With 1 slot the
    check runs after the first stall (that request held its last free slot), not after
    ``wedge_after_stalls`` (2)."""
    cfg = base_config(free_port(), llama_server={
        "threads": 1, "liveness_interval_s": 300, "liveness_timeout_s": 2, "stop_grace_s": 1},
        timeouts={"first_byte_s": 1.0}, scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    victim = gw.workers()[0]
    body = {"model": "demo", "prompt": "hi", "raw": True, "stream": False,
            "options": {"num_predict": 4}}
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        for wave in range(8):  # two at a time: one of each pair goes to the frozen worker
            with cf.ThreadPoolExecutor(2) as ex:
                rs = list(ex.map(lambda i: httpx.post(gw.url + "/api/generate", timeout=60,
                                                      json={**body, "prompt": f"{wave} {i}"}),
                                 range(2)))
            assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
            if '"worker.wedged"' in gw.log_path.read_text():
                break
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == victim["id"]
                               and x["state"] == "ready" and x["pid"] != victim["pid"]), None),
                 60, "frozen worker restarted")
    assert w["wedges"] == 1
    wedged = [e for e in log_events(gw.log_path) if e.get("event") == "worker.wedged"]
    assert len(wedged) == 1 and wedged[0]["worker"] == victim["id"], wedged
    assert wedged[0]["reason"] == ("a stalled request held its last free slot and its main "
                                   "loop (GET /lora-adapters) did not answer within 2 s")


def test_the_stall_check_does_not_wait_for_a_liveness_probe_in_flight(gateway_factory):
    """A frozen single-slot worker's stream stalls (``inter_token_s`` 1 s); the stall check
    then ran only once the ``/slots`` probe already waiting on the frozen worker had timed out,
    so the wedge was found up to 2 × ``liveness_timeout_s`` after the stall (9 s with the
    defaults in a tester's run). It starts at the stall now: found within
    ``liveness_timeout_s`` (3 s here) of it, plus scheduling slack. Probes run back to back
    (``liveness_interval_s`` 0.1), so one is always in flight when the stall comes; with the
    old loop the wedge came about 5 s after the stall."""
    cfg = base_config(free_port(), llama_server={
        "threads": 1, "liveness_interval_s": 0.1, "liveness_timeout_s": 3, "stop_grace_s": 1},
        timeouts={"inter_token_s": 1.0})
    cfg["models"][0].update(cpu=1, slots=1, context=4096)
    gw = gateway_factory(cfg)
    victim = gw.workers()[0]
    with httpx.stream("POST", gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": "x", "raw": True, "options": {"num_predict": 4000}}) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(victim["pid"], signal.SIGSTOP)
        rest = [ln for ln in lines if ln]
    try:
        assert "error" in json.loads(rest[-1]), rest[-1]
        wait_for(lambda: '"worker.wedged"' in gw.log_path.read_text(), 30, "wedge found")
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    events = log_events(gw.log_path)
    stall = next(e for e in events if e.get("event") == "watchdog.stall")
    wedged = next(e for e in events if e.get("event") == "worker.wedged")
    took = (datetime.fromisoformat(wedged["timestamp"].replace("Z", "+00:00"))
            - datetime.fromisoformat(stall["timestamp"].replace("Z", "+00:00"))).total_seconds()
    assert wedged["reason"].startswith("a stalled request held its last free slot and its main "
                                       "loop (GET /lora-adapters) did not answer within 3 s"), wedged
    assert took < 3 + 1.2, took


def test_a_request_waiting_on_a_frozen_worker_is_retried_when_it_is_found_wedged(gateway_factory):
    """A real llama-server frozen with SIGSTOP while a request waits for its first bytes: when
    liveness marks it wedged that request is retried on the other worker at once. It waited
    until the frozen process was gone: SIGTERM, which it cannot act on, ``stop_grace_s`` (10 s),
    SIGKILL (23.9 s in a fresh tester's run with the default probes; 14.0 s now)."""
    cfg = base_config(free_port(), llama_server={
        "threads": 1, "liveness_interval_s": 0.5, "liveness_timeout_s": 1, "stop_grace_s": 10},
        scheduler={"prefix_affinity": False})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    victim = gw.workers()[0]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(2) as ex:  # one of the two goes to the frozen worker
            rs = list(ex.map(lambda i: httpx.post(gw.url + "/api/generate", timeout=60, json={
                "model": "demo", "prompt": f"x{i}", "raw": True, "stream": False,
                "options": {"num_predict": 4}}), range(2)))
        took = time.monotonic() - t0
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert took < 8, took  # the wedge is found in about 2 s; not after the 10 s stop grace
    events = log_events(gw.log_path)
    retried = [e for e in events if e.get("event") == "upstream.retry"]
    assert len(retried) == 1 and retried[0]["worker"] == victim["id"], retried
    assert "wedged" in retried[0]["reason"], retried


def _freezing_fakes(tmp_path, gateway_factory, n: int):
    """A gateway of ``n`` single-slot FAKE workers (``marker`` mode: ``FREEZE-ME`` freezes the
    worker that takes it), found wedged within about 2 s (liveness 0.5 s / 1 s)."""
    binary = fake_binary(tmp_path, "marker", first_only=False)
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "liveness_interval_s": 0.5, "liveness_timeout_s": 1,
        "stop_grace_s": 1}, scheduler={"prefix_affinity": False})
    cfg["models"][0].update(cpu=n, slots=1)
    return gateway_factory(cfg)


#: the not-tried-again 502 after a second worker went down under the request, and on a model's
#: only worker (whose words do not blame the request: it may have been killed from outside)
SECOND_DOWN = "while it computed this request, as did the worker it was sent to first: it is not tried again"
ALONE_DOWN = ("while it computed this request, and no other worker of the model is left to try "
              "it on; the worker is restarted, please retry once it is back")


def _freeze_me_gets_502(gw, words: str) -> list[dict]:
    """Send ``FREEZE-ME``; it must get the not-tried-again 502 with ``words``. Returns the
    log's events."""
    r = httpx.post(gw.url + "/api/generate", timeout=120, json={
        "model": "demo", "prompt": "FREEZE-ME", "raw": True, "stream": False,
        "options": {"num_predict": 4}})
    assert r.status_code == 502, r.text
    assert words in r.json()["error"], r.text
    return log_events(gw.log_path)


def _poison_three_fakes(tmp_path, gateway_factory, prompt: str, stream: bool):
    """(gateway, worker id → pid, response) after ``prompt`` (a FAKE marker) was sent to a
    gateway of three FAKE workers; the response must be a 502."""
    gw = _freezing_fakes(tmp_path, gateway_factory, 3)
    pids = {w["id"]: w["pid"] for w in gw.workers()}
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": prompt, "raw": True, "stream": stream,
        "options": {"num_predict": 8}})
    assert r.status_code == 502, r.text
    return gw, pids, r


def _spared_and_serving(gw, pids: dict, downed: set) -> None:
    """The one worker of ``pids`` (id → pid at start) not in ``downed`` kept its process and
    was never restarted, and the gateway still answers."""
    (spared,) = set(pids) - downed
    now = {w["id"]: w for w in gw.workers()}
    assert now[spared]["pid"] == pids[spared] and now[spared]["restarts"] == 0, now[spared]
    ok = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "hello", "raw": True, "stream": False,
        "options": {"num_predict": 4}})
    assert ok.status_code == 200, ok.text


def test_a_request_that_freezes_workers_is_not_tried_on_a_third(tmp_path, gateway_factory):
    """A request that freezes every worker that takes it (the FAKE worker's ``FREEZE-ME``, as a
    schema llama-server's grammar parser loops on did; a fresh tester's find) was retried on
    the model's next worker each time its worker was found wedged: 3 tries, 3 workers down,
    for one request. It is tried on a second worker (its first could have gone down for a cause
    of its own, as the SIGSTOP test above shows), not on a third: 502, and the third worker
    keeps serving."""
    gw = _freezing_fakes(tmp_path, gateway_factory, 3)
    pids = {w["id"]: w["pid"] for w in gw.workers()}
    assert len(pids) == 3 and all(is_fake(p) for p in pids.values())
    events = _freeze_me_gets_502(gw, SECOND_DOWN)
    wedged = [e["worker"] for e in events if e.get("event") == "worker.wedged"]
    retried = [e for e in events if e.get("event") == "upstream.retry"]
    assert len(wedged) == 2 and len(set(wedged)) == 2, wedged
    assert len(retried) == 1 and retried[0]["worker"] == wedged[0], retried
    _spared_and_serving(gw, pids, set(wedged))


def test_a_request_that_freezes_a_models_only_worker_is_not_tried_on_it_again(
        tmp_path, gateway_factory):
    """On a model with one worker, a request that froze it was retried on the same worker
    once it had restarted, and froze it again (a fresh tester's find, with a schema that loops
    llama-server's grammar parser). With no other worker to try, it is answered 502 after the
    first wedge: one wedge, no retry."""
    events = _freeze_me_gets_502(_freezing_fakes(tmp_path, gateway_factory, 1), ALONE_DOWN)
    assert len([e for e in events if e.get("event") == "worker.wedged"]) == 1
    assert not [e for e in events if e.get("event") == "upstream.retry"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_crashes_workers_is_not_tried_on_a_third(tmp_path, gateway_factory,
                                                                 stream):
    """A request that crashes the worker that takes it (the FAKE worker's ``CRASH-ME``) is seen
    as a connection closed before any answer, before the supervisor sees the exit, and was
    retried as a lost connection: on each of 3 workers in turn, 3 crashes for one request.
    Seen exited as its connection closed, the worker counts as gone down under the request:
    a second worker is tried, not a third; on a one-worker model none."""
    gw, pids, r = _poison_three_fakes(tmp_path, gateway_factory, "CRASH-ME", stream)
    assert SECOND_DOWN in r.text, r.text
    # the supervisor may log the second exit after the answer: wait for it, and a moment more
    # for a third that must not come
    wait_for(lambda: len(_workers_down(gw)) >= 2, 10, "2 workers down")
    time.sleep(1)
    exited = _workers_down(gw)
    retried = [e for e in log_events(gw.log_path) if e.get("event") == "upstream.retry"]
    assert len(retried) == 1 and len(exited) == 2, (retried, exited)
    _spared_and_serving(gw, pids, exited)


def test_a_request_that_crashes_workers_mid_answer_is_answered_again_once(tmp_path,
                                                                        gateway_factory):
    """A non-streamed request whose worker crashes mid-answer runs again on another worker
    (its client had nothing yet), but only once: one that crashes every worker (the FAKE's
    ``CRASH-LATER``: 2 tokens, then exit) takes down two of three, then 502, and the third
    keeps serving."""
    gw, pids, _ = _poison_three_fakes(tmp_path, gateway_factory, "CRASH-LATER", False)
    wait_for(lambda: len(_workers_down(gw)) >= 2, 10, "2 workers down")
    time.sleep(1)
    again = [e for e in log_events(gw.log_path) if e.get("event") == "upstream.answer_again"]
    assert len(_workers_down(gw)) == 2 and len(again) == 1, (_workers_down(gw), again)
    _spared_and_serving(gw, pids, _workers_down(gw))


@pytest.mark.parametrize("workers", [3, 1])
def test_a_side_call_that_crashes_workers_is_not_tried_on_a_third(tmp_path, gateway_factory,
                                                                  workers):
    """A chat template that crashes llama-server on one message: /api/generate's render
    (``/apply-template``, a side call) was tried on each worker in turn as each came back,
    8 crashes in 5 s and the model's workers in crash-loop ``failed`` for 300 s (a fresh
    tester's find). Now as for a request: once more on another worker, then 502; on a
    model's only worker not again. The FAKE worker's render exits on ``CRASH-ME``."""
    binary = fake_binary(tmp_path, "marker", first_only=False)
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "liveness_interval_s": 0.5, "liveness_timeout_s": 1,
        "stop_grace_s": 1}, scheduler={"prefix_affinity": False},
        generation={"template_shapes": False})  # every render asks a worker
    cfg["models"][0].update(cpu=workers, slots=1)
    gw = gateway_factory(cfg)
    pids = {w["id"]: w["pid"] for w in gw.workers()}
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "CRASH-ME", "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 502, r.text
    assert (f"two workers of model 'demo:latest' exited while they computed /apply-template for "
            f"this request: it is not tried again" if workers == 3 else
            "exited while it computed /apply-template for this request, and no other worker of "
            "the model is left to try it on; the worker is restarted, please retry once it is "
            "back") in r.json()["error"], r.text
    wait_for(lambda: _workers_down(gw), 10, "a worker down")
    time.sleep(1.5)  # a third crash would have come by now
    assert len(_workers_down(gw)) == min(workers, 2), _workers_down(gw)
    if workers == 3:
        _spared_and_serving(gw, pids, _workers_down(gw))


def _workers_down(gw) -> set[str]:
    """Ids of the workers the log says went down."""
    return {e["worker"] for e in log_events(gw.log_path) if e.get("event") == "worker.down"}


def test_a_request_that_crashes_a_models_only_worker_is_not_tried_again(tmp_path,
                                                                         gateway_factory):
    gw = _freezing_fakes(tmp_path, gateway_factory, 1)
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "CRASH-ME", "raw": True, "stream": False,
        "options": {"num_predict": 4}})
    assert r.status_code == 502, r.text
    assert ALONE_DOWN in r.json()["error"], r.text
    down = lambda: [e for e in log_events(gw.log_path)  # noqa: E731
                    if e.get("event") == "worker.down"]
    wait_for(down, 10, "the worker down")
    time.sleep(1)
    assert len(down()) == 1
    assert not [e for e in log_events(gw.log_path) if e.get("event") == "upstream.retry"]


def test_wedged_worker_streams_end_with_error_and_it_restarts(tmp_path, gateway_factory):
    """Case 11: a worker that stops mid-stream, whose /slots hangs and which ignores SIGTERM.
    Liveness (/slots with a timeout) marks it wedged: its stream ends with an error line,
    SIGTERM then SIGKILL after the grace period, restart; the other worker's stream is intact."""
    binary = fake_binary(tmp_path, "wedge", real=str(ensure_llama_server()))
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "threads": 1, "liveness_interval_s": 0.5,
        "liveness_timeout_s": 1, "stop_grace_s": 2}, timeouts={"inter_token_s": 30})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    fake = wait_for(lambda: next((w for w in gw.workers() if is_fake(w["pid"])), None), 10, "fake")
    body = {"model": "demo", "prompt": "hi", "raw": True, "options": {"num_predict": 300}}
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda _: stream_lines(gw.url + "/api/generate", body), range(2)))
    took = time.monotonic() - t0
    errors = [lines for _, lines in results if "error" in lines[-1]]
    done = [lines for _, lines in results if lines[-1].get("done") is True]
    assert len(errors) == 1 and len(done) == 1, [r[1][-1] for r in results]
    err = errors[0]
    assert len(err) >= 2 and err[0]["response"] == "t0 "  # it had streamed before wedging
    assert "wedged" in err[-1]["error"]
    assert took < 25  # ended by liveness (~2 s), not by the 30 s inter-token watchdog
    wait_for(lambda: not pid_alive(fake["pid"]), 15, "SIGKILL of the wedged worker")
    log = gw.log_path.read_text()
    assert "worker.stop_timeout" in log  # SIGTERM was ignored, SIGKILL followed
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == fake["id"]
                               and x["state"] == "ready"), None), 60, "restart")
    assert w["wedges"] == 1 and w["pid"] != fake["pid"]
    status, lines = stream_lines(gw.url + "/api/generate", {**body, "options": {"num_predict": 8}})
    assert status == 200 and lines[-1]["done"] is True


def test_inter_token_watchdog_ends_stalled_stream(tmp_path, gateway_factory):
    """A stream that stops mid-answer (worker still answering /slots for the first probes is
    not required: liveness is slowed down here) ends by the inter-token watchdog with an
    error line, and the SSE route gets an error event."""
    binary = fake_binary(tmp_path, "wedge", first_only=False)
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "liveness_interval_s": 60, "liveness_timeout_s": 30,
        "stop_grace_s": 1}, timeouts={"inter_token_s": 1.5})
    cfg["models"][0].update(slots=1, cpu=1)
    gw = gateway_factory(cfg)
    t0 = time.monotonic()
    status, lines = stream_lines(gw.url + "/api/chat", {
        "model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and "error" in lines[-1], lines
    assert "sent nothing for 1.5 s" in lines[-1]["error"]
    assert time.monotonic() - t0 < 20
    # non-streamed /v1 (streamed from the worker): an error JSON, never a truncated 200
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 504 and "sent nothing for 1.5 s" in r.json()["error"]["message"]


def test_runaway_generation_is_bounded(tmp_path, gateway_factory):
    """Case 6: num_predict unset → generation.num_predict_max bounds it (done_reason length);
    timeouts.request_s bounds a request in time: the stream ends with an error line and the
    slot is freed."""
    cfg = base_config(free_port(), generation={"num_predict_max": 12})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg)
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "a", "raw": True,
                                                   "stream": False}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "length"
    assert r.json()["eval_count"] == 12
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "a",
                                                      "max_tokens": 100000}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_configured_num_predict_default_bounds_every_api(gateway_factory):
    """Case 6 (runaway generation; a tester's find): ``generation.num_predict_default: 7`` with
    no ``num_predict_max``: an ``/api/generate``, ``/api/chat``, ``/v1/chat/completions`` and
    ``/v1/completions`` request that sets no ``num_predict``/``max_tokens`` generates exactly 7
    tokens and says ``length``. Catches a default that one API path drops (the Ollama options
    mapping ignoring it, or /v1 not setting ``max_tokens``): the request then runs until the
    slot's 512-token context is full (eval_count/completion_tokens far above 7). Greedy
    sampling on /api/* and /v1/* (``temperature`` 0) so the random-weight demo model does not
    stop early at an end-of-generation token."""
    cfg = base_config(free_port(), generation={"num_predict_default": 7})
    cfg["models"][0].update(cpu=1, slots=1, context=512)
    gw = gateway_factory(cfg)
    opts = {"temperature": 0}
    r = httpx.post(gw.url + "/api/generate", timeout=120, json={
        "model": "demo", "prompt": "a", "raw": True, "stream": False, "options": opts})
    assert r.status_code == 200, r.text
    assert (r.json()["eval_count"], r.json()["done_reason"]) == (7, "length"), r.json()
    r = httpx.post(gw.url + "/api/chat", timeout=120, json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": opts})
    assert r.status_code == 200, r.text
    assert (r.json()["eval_count"], r.json()["done_reason"]) == (7, "length"), r.json()
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "a"})):
        r = httpx.post(gw.url + path, timeout=120,
                       json={"model": "demo", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        got = (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"])
        assert got == (7, "length"), (path, r.json())
    # streamed too: the last NDJSON line counts 7
    status, lines = stream_lines(gw.url + "/api/chat", {
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "options": opts})
    assert status == 200 and lines[-1]["done"] is True, lines[-1]
    assert (lines[-1]["eval_count"], lines[-1]["done_reason"]) == (7, "length"), lines[-1]


def test_context_shift_does_not_generate_forever(gateway_factory):
    """Case 6 with llama-server's ``--context-shift`` in the model's args (a fresh tester's
    find): the context's end no longer stops a generation, and one without ``num_predict`` /
    ``max_tokens`` ran until ``request_s`` (an hour; 23,235 tokens in 15 s on a 256-token
    slot, still going). It is capped at 10 slot contexts, as Ollama's runner caps it: 2,560
    tokens, ``length``, on every API. Greedy sampling, so the random-weight demo model does
    not stop early at an end-of-generation token."""
    cfg = base_config(free_port(), llama_server={"threads": 1})
    cfg["models"][0].update(cpu=1, slots=1, context=256, args=["--context-shift"])
    gw = gateway_factory(cfg)
    r = httpx.post(gw.url + "/api/generate", timeout=120, json={
        "model": "demo", "prompt": "a", "raw": True, "stream": False,
        "options": {"temperature": 0}})
    assert r.status_code == 200, r.text
    assert (r.json()["eval_count"], r.json()["done_reason"]) == (2560, "length"), r.json()
    r = httpx.post(gw.url + "/api/generate", timeout=120, json={  # -1 spelled out, and -2
        "model": "demo", "prompt": "a", "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": -2}})
    assert (r.json()["eval_count"], r.json()["done_reason"]) == (2560, "length"), r.json()
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": -1})):
        r = httpx.post(gw.url + path, timeout=120,
                       json={"model": "demo", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        got = (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"])
        assert got == (2560, "length"), (path, r.json())


def test_request_deadline_frees_slot(tmp_path, gateway_factory):
    cfg = base_config(free_port(), timeouts={"request_s": 1.0})
    cfg["models"][0].update(cpu=1, slots=1, context=32768)
    gw = gateway_factory(cfg)
    t0 = time.monotonic()
    status, lines = stream_lines(gw.url + "/api/generate", {
        "model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 30000}})
    assert status == 200 and lines[-1] == {"error": "request deadline exceeded"}, lines[-1]
    assert time.monotonic() - t0 < 10
    worker = gw.workers()[0]
    assert worker["busy"] == 0
    wait_for(lambda: not any(s.get("is_processing") for s in gw.slots(worker)), 5,
             "worker slot idle")


def test_requests_during_a_stall_check_wait_for_the_steady_worker(tmp_path, gateway_factory):
    """Case 10 (a fresh tester's find): a worker whose stall check is running gets no new
    work while another worker of its model is in rotation. 2 workers × 1 slot, the first a
    FAKE silent worker (its restart and the other are real). Request A stalls on the FAKE
    while a long stream keeps the real worker busy; A held the FAKE's only slot, so the FAKE
    is checked at once (``liveness_timeout_s`` 6 s, which it fails: the slot never frees).
    A's retry, and request B sent during that check, wait for the real worker (or the FAKE's
    real restart). Before, either went to the FAKE, whose slot the gateway counts as free once
    A left it, and stalled there for ``first_byte_s`` more before its next try (which of the
    two depended on timing; the old code failed one assertion or the other)."""
    gw, fake = _fake_beside_a_real_worker(tmp_path, gateway_factory, "silent", 6)

    def worker(worker_id: str) -> dict:
        return next(w for w in gw.workers() if w["id"] == worker_id)

    def post(rid: str):
        return httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": rid}, timeout=60,
                          json={"model": "demo", "prompt": rid, "raw": True, "stream": False,
                                "options": {"num_predict": 4}})

    def log_lines(event: str, rid: str) -> list[dict]:
        return [json.loads(ln) for ln in gw.log_path.read_text().splitlines()
                if f'"{event}"' in ln and f'"{rid}"' in ln]

    stop_long = threading.Event()
    with cf.ThreadPoolExecutor(3) as ex:
        a = ex.submit(post, "stalls-on-fake")
        wait_for(lambda: worker(fake["id"])["busy"] == 1, 10, "A on the FAKE")
        long = ex.submit(long_stream, gw.url, stop_long)  # the real worker's one slot
        wait_for(lambda: all(w["busy"] == 1 for w in gw.workers()), 10,
                 "the long stream on the real worker")
        wait_for(lambda: log_lines("upstream.retry", "stalls-on-fake"), 10, "A stalled and retried")
        assert worker(fake["id"])["stall_check"] is True  # checked at once: A held its last slot
        b = ex.submit(post, "sent-during-the-check")
        time.sleep(3)  # past B's first_byte_s, had it gone to the FAKE; the check still runs
        stop_long.set()
        assert long.result(timeout=30) > 0
        ra, rb = a.result(timeout=60), b.result(timeout=60)
    assert (ra.status_code, rb.status_code) == (200, 200), (ra.text, rb.text)
    assert log_lines("upstream.retry", "sent-during-the-check") == []  # B never stalled
    # nor did A's retry: it waited for a worker not under check, not back on the FAKE
    assert len(log_lines("upstream.retry", "stalls-on-fake")) == 1
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == fake["id"]
                               and x["state"] == "ready" and x["pid"] != fake["pid"]), None),
                 60, "the FAKE restarted after failing its check")
    assert not is_fake(w["pid"]) and w["stall_check"] is False


def test_idle_clients_using_up_descriptors_do_not_wedge_a_worker(gateway_factory):
    """With the gateway's descriptors all taken by idle client connections, its liveness probes
    could not open a socket (EMFILE) and counted that against the worker: a healthy worker was
    declared wedged, stopped, and could not be started again meanwhile (a fresh tester's find
    at a 1,024 limit). The probe now says it was the gateway's own shortage and the worker
    stays; once the clients leave, requests are served. The limit is forced to 64 with
    ``prlimit`` (the gateway raises its soft limit to the hard one at start) and given back
    after."""
    import resource
    cfg = base_config(free_port(), llama_server={"liveness_interval_s": 0.3,
                                                 "liveness_timeout_s": 1})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg)
    (w,) = gw.workers()
    _, hard = resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE, (64, hard))
    conns = []
    try:
        for _ in range(80):
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
            conns.append(s)
        time.sleep(3)  # ten probe intervals with no descriptor to spare
    finally:
        for s in conns:
            s.close()
    log = gw.log_path.read_text()
    assert "gateway.out_of_descriptors" in log  # the shortage happened and was seen as such
    assert "worker.wedged" not in log and "worker.liveness_failed" not in log
    resource.prlimit(gw.proc.pid, resource.RLIMIT_NOFILE, (hard, hard))
    wait_for(lambda: (x := httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "hi", "raw": True, "stream": False,
        "options": {"num_predict": 2}})).status_code == 200 and x, 20, "served again")
    (now,) = gw.workers()
    assert now["pid"] == w["pid"] and now["restarts"] == 0, now


def test_a_frozen_worker_gets_no_new_work_once_its_probe_is_late(gateway_factory):
    """Cases 10/11 (a fresh tester's find): a frozen (SIGSTOPped) worker kept getting new
    requests and side calls until its second failed liveness probe declared it wedged (12 s
    and more with the default probes; 10 s probes here, so that is past this test). Once a
    probe is a second late, new work goes to the model's other worker; once it answers again
    (SIGCONT), the worker is back in rotation."""
    cfg = base_config(free_port(), llama_server={"threads": 1, "liveness_interval_s": 0.3,
                                                 "liveness_timeout_s": 10},
                      scheduler={"prefix_affinity": False, "policy": "round_robin"},
                      timeouts={"first_byte_s": 3})
    cfg["models"][0]["slots"] = 1
    gw = gateway_factory(cfg)
    frozen, steady = gw.workers()

    def served_by(rid: str) -> str:
        r = httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": rid}, timeout=60,
                       json={"model": "demo", "prompt": "hi", "raw": True, "stream": False,
                             "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        (done,) = [json.loads(ln) for ln in gw.log_path.read_text().splitlines()
                   if '"request.done"' in ln and f'"{rid}"' in ln]
        return done["worker"]

    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        time.sleep(2)  # a probe sent within 0.3 s, late 1 s after
        placed = [served_by(f"while-frozen-{i}") for i in range(4)]  # round robin: 2 and 2
        assert placed == [steady["id"]] * 4, placed
        log = gw.log_path.read_text()
        assert '"upstream.retry"' not in log  # none was sent to the frozen worker first
        assert '"worker.liveness_slow"' in log
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    wait_for(lambda: frozen["id"] in {served_by(f"after-{i}") for i in range(2)}, 10,
             "the thawed worker back in rotation")
    assert '"worker.wedged"' not in gw.log_path.read_text()
