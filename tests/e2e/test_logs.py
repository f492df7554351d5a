"""The gateway's log (gateway/logs.py) on a real gateway: one JSON object per line, also for
what aiohttp logs through the stdlib; worker errors name the worker that answered; workers whose
verbosity the operator raised get their info lines logged at info.

One gateway for the module: 2 CPU workers of the demo model, ``args: ["-lv", "4"]`` (the
operator raised the workers' verbosity), log level info, JSON format, an admin token (to drain
a worker).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import model, raw_exchange

pytestmark = pytest.mark.slow

WORKERS = ("demo-cpu0", "demo-cpu1")
ADMIN = "admin-token"


@pytest.fixture(scope="module")
def gw(module_gateway_factory):
    return module_gateway_factory(base_config(
        free_port(), admin={"token": ADMIN}, models=[model("demo", cpu=2, args=["-lv", "4"])]))


def records(gw) -> list[dict]:
    """Every line of the gateway's log (stdout and stderr) as JSON; fails on a line that is not
    one JSON object."""
    out = []
    for n, line in enumerate(gw.log_path.read_text(errors="replace").splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            pytest.fail(f"log line {n} is not JSON: {line!r}")
        assert isinstance(rec, dict), (n, line)
        out.append(rec)
    return out


def wait_for(gw, pred, timeout: float = 10) -> list[dict]:
    """The log's records matching ``pred``, waiting up to ``timeout`` s for at least one."""
    end = time.monotonic() + timeout
    while True:
        found = [r for r in records(gw) if pred(r)]
        if found or time.monotonic() > end:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize("head", [
    # aiohttp's parser refuses a second Content-Type (BadHttpMessage, logged at error)
    b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}",
    # ... and an HTTP/1.1 request without Host
    b"GET /api/tags HTTP/1.1\r\nUser-Agent: x\r\n\r\n",
], ids=["duplicate-content-type", "no-host"])
def test_request_aiohttp_refuses_is_one_json_record_and_the_next_is_answered(gw, head):
    """aiohttp answers a request its parser refuses itself (text/plain 400, README "Known
    gaps") and logs it through the stdlib with a traceback: that must be one JSON record
    (``logger: aiohttp.server``, aiohttp's level, the traceback in ``exception``), not the
    traceback's lines in the JSON log."""
    def rejected(r):
        return r.get("logger") == "aiohttp.server" and r["event"] == "request.unparsed"
    before = len(wait_for(gw, rejected, timeout=0))
    out = raw_exchange(gw.port, head)
    assert out.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), out[:200]
    end = time.monotonic() + 10
    while len(found := wait_for(gw, rejected)) == before and time.monotonic() < end:
        time.sleep(0.1)
    assert len(found) == before + 1, found
    rec = found[-1]
    assert rec["level"] == "error" and rec["remote"] == "127.0.0.1" and rec["status"] == 400
    assert rec["error"] in out.decode()  # aiohttp's reason, as the client read it
    assert "Traceback (most recent call last)" in rec["exception"]
    assert "BadHttpMessage" in rec["exception"] and rec["timestamp"]
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "hi", "raw": True,
                                                    "stream": False, "options": {"num_predict": 3}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["done"] is True
    records(gw)  # every line still JSON


def unparsed_total(gw) -> float:
    """``llama_gateway_requests_unparsed_total`` scraped from the gateway's ``/metrics``."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "llama_gateway_requests_unparsed_total")


@pytest.mark.parametrize("head", [
    # a request line with a version that is not HTTP's (logged at error)
    b"GET /api/tags HTTP/9.x\r\nHost: localhost\r\n\r\n",
    # not HTTP at all as a connection's first bytes (a bad method: aiohttp logs it at debug)
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n",
], ids=["bad-version", "not-http"])
def test_request_aiohttp_refuses_is_counted_in_metrics(gw, head):
    """A malformed request line, answered by aiohttp's parser before any gateway code runs
    (README "Known gaps"), counts once in ``llama_gateway_requests_unparsed_total``, whatever
    level aiohttp logs it at."""
    before = unparsed_total(gw)
    out = raw_exchange(gw.port, head)
    assert out.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), out[:200]
    assert unparsed_total(gw) == before + 1


def _drained(gw, worker: str, on: bool) -> None:
    r = httpx.post(f"{gw.url}/gateway/api/admin/workers/{worker}/{'drain' if on else 'undrain'}",
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [
    ("/api/generate", {"model": "demo", "prompt": "hi", "stream": False,
                       "format": {"type": "frobnicate"}}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "s", "schema": {"type": "frobnicate"}}}}),
])
def test_upstream_error_names_the_worker_that_answered(gw, path, body):
    """A schema llama-server cannot turn into a grammar is refused by the worker itself (400,
    "JSON schema error at #: unrecognized type frobnicate"); ``request.upstream_error`` names
    that worker and its gpu ("cpu" here), and ``request.done`` the worker. One worker is drained
    so the answering worker is known."""
    serving, drained = WORKERS
    _drained(gw, drained, True)
    try:
        rid = f"upstream-error-{path.replace('/', '-')}"
        r = httpx.post(gw.url + path, json=body, headers={"X-Request-ID": rid}, timeout=60)
    finally:
        _drained(gw, drained, False)
    assert r.status_code == 400 and "frobnicate" in r.text, r.text
    errs = wait_for(gw, lambda e: e["event"] == "request.upstream_error" and e.get("request_id") == rid)
    assert len(errs) == 1, errs
    assert errs[0]["worker"] == serving and errs[0]["gpu"] == "cpu", errs[0]
    assert errs[0]["level"] == "warning" and "frobnicate" in errs[0]["error"]
    done = wait_for(gw, lambda e: e["event"] == "request.done" and e.get("request_id") == rid)
    assert [d["worker"] for d in done] == [serving] and done[0]["status"] == 400


def test_raised_worker_verbosity_logs_worker_info_lines_at_info(gw):
    """The operator's ``-lv 4`` in the model's args: the worker's per-request info lines are in
    the log at the gateway's level info, as ``worker.output`` of the worker that served."""
    rid = "verbose-worker"
    r = httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": rid}, timeout=60,
                   json={"model": "demo", "prompt": "hello", "raw": True, "stream": False,
                         "options": {"num_predict": 4}})
    assert r.status_code == 200
    done = wait_for(gw, lambda e: e["event"] == "request.done" and e.get("request_id") == rid)
    worker = done[0]["worker"]
    assert worker in WORKERS
    # llama-server's "slot launch_slot_: id  N | task T | processing task" info line
    launched = wait_for(gw, lambda e: e["event"] == "worker.output" and e["worker"] == worker
                        and " I " in e["line"] and "processing task" in e["line"])
    assert launched and all(e["level"] == "info" for e in launched), launched[:3]


def test_a_repeated_prompt_logs_no_worker_warning(gw):
    """A prompt the worker has all in its slot's cache (sent again, as a chat UI's
    "regenerate" does) makes llama-server write two 'W' lines ("need to evaluate at least 1
    token …", "n_past was set to …"); they are routine per-request chatter, logged like the
    worker's info lines (here at info: the operator raised the workers' verbosity), never at
    warning. Before this, every such request put two warnings in the gateway's log."""
    body = {"model": "demo", "prompt": "the same prompt again and again", "raw": True,
            "stream": False, "options": {"num_predict": 2, "seed": 1}}
    for i in range(4):
        r = httpx.post(gw.url + "/api/generate", headers={"X-Request-ID": f"repeat-{i}"},
                       timeout=60, json=body)
        assert r.status_code == 200, r.text
    wait_for(gw, lambda e: e["event"] == "request.done" and e.get("request_id") == "repeat-3")
    routine = wait_for(gw, lambda e: e["event"] == "worker.output" and (
        "need to evaluate at least 1 token" in e["line"] or "n_past was set to" in e["line"]))
    assert len(routine) >= 2, "no repeated prompt was a full cache hit on its worker"
    assert all(e["level"] == "info" for e in routine), routine[:3]


def test_a_client_that_leaves_mid_stream_logs_no_worker_warning(gw):
    """A client that closes a stream mid-answer (a chat UI's stop button) makes the gateway
    close the worker's connection, and llama-server cancels the task with a 'W' line ("cancel
    task, id_task = N"); routine, so logged like the worker's info lines (here at info), while
    the gateway's own request log says the client left (499). A fresh tester saw one warning
    per disconnect before."""
    with httpx.stream("POST", gw.url + "/api/generate", timeout=60,
                      headers={"X-Request-ID": "leaves-early"},
                      json={"model": "demo", "prompt": "x", "raw": True,
                            "options": {"num_predict": 20000}}) as r:
        lines = r.iter_lines()
        assert next(lines) and next(lines)
    done = wait_for(gw, lambda e: e["event"] == "request.done"
                    and e.get("request_id") == "leaves-early")
    assert done and done[0]["status"] == 499, done
    cancelled = wait_for(gw, lambda e: e["event"] == "worker.output"
                         and "cancel task, id_task" in e["line"])
    assert cancelled and all(e["level"] == "info" for e in cancelled), cancelled[:3]
