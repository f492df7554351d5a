"""Worker crashes: mid-request (field case 16) and crash loops."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import httpx
import pytest

from tests.conftest import base_config, free_port
from tests.e2e.test_watchdog import stream_lines, wait_for
from tests.fakes import fake_binary, hanging_binary

pytestmark = pytest.mark.slow


def test_crash_mid_request_errors_streams_and_queued_run_elsewhere(gateway_factory):
    """Case 16: SIGKILL a worker streaming 2 requests while 3 more wait: the 2 end with an
    error line, the 3 queued run on the other worker (the crashed one stays down for its 12 s
    restart backoff, longer than the other worker's streams), all 5 complete, the crashed worker
    restarts after its backoff and its crash is counted."""
    cfg = base_config(free_port(), llama_server={"threads": 1, "restart_backoff_initial_s": 12})
    cfg["models"][0]["context"] = 8192
    gw = gateway_factory(cfg)
    body = {"model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 1500}}
    with cf.ThreadPoolExecutor(7) as ex:
        futs = [ex.submit(stream_lines, gw.url + "/api/generate", body, 120) for _ in range(4)]
        st = wait_for(lambda: (s := gw.status()) and all(w["busy"] == 2 for w in s["workers"]) and s,
                      30, "4 streams running")
        futs += [ex.submit(stream_lines, gw.url + "/api/generate",
                           {**body, "options": {"num_predict": 50}}, 120) for _ in range(3)]
        wait_for(lambda: gw.status()["queue"]["depth"] == 3, 10, "3 queued")
        victim = st["workers"][0]
        other = st["workers"][1]["id"]
        os.kill(victim["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        results = [f.result(timeout=120) for f in futs]
        all_done = time.monotonic() - t_kill
    errors = [lines[-1] for status, lines in results if "error" in lines[-1]]
    done = [lines[-1] for status, lines in results if lines[-1].get("done") is True]
    assert len(errors) == 2 and len(done) == 5, [r[1][-1] for r in results]
    assert all(status == 200 for status, _ in results)
    assert all(d["done_reason"] == "length" for d in done)
    assert sorted(d["eval_count"] for d in done) == [50, 50, 50, 1500, 1500]
    assert all_done < 12, all_done  # the 3 did not wait for the restart
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == victim["id"]
                               and x["state"] == "ready"), None), 60, "restart")
    assert w["crashes"] == 1 and w["restarts"] == 1 and w["pid"] != victim["pid"]
    st = gw.status()
    assert st["queue"]["depth"] == 0 and all(x["busy"] == 0 for x in st["workers"])
    # the log names the worker and its GPU, and each broken stream's request (a fresh tester
    # found worker.down without gpu and upstream.stream_broken without request_id or worker)
    events = [json.loads(ln) for ln in gw.log_path.read_text().splitlines() if ln.startswith("{")]
    down = [e for e in events if e["event"] == "worker.down"]
    assert [(e["worker"], e["gpu"]) for e in down] == [(victim["id"], "cpu")], down
    ids = {e["request_id"] for e in events if e["event"] == "request.done"}
    for e in (e for e in events if e["event"] == "upstream.stream_broken"):
        assert e["request_id"] in ids and e["worker"] == victim["id"], e
    # the two cut answers are counted as such (they showed only as status 200; an operator
    # tester's find), and request.done says what cut them
    cut = [e for e in events if e["event"] == "request.done" and e.get("cut")]
    assert len(cut) == 2 and all(e["status"] == 200 and "worker" in e["cut"] for e in cut), cut
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert 'llama_gateway_answers_cut_total{endpoint="/api/generate",model="demo:latest"} 2.0' \
        in metrics, [m for m in metrics.splitlines() if "answers_cut" in m]
    # field case 16: a metric counts the crash (restarts_total counts every restart's cause)
    assert (f'llama_gateway_worker_crashes_total{{gpu="cpu",model="demo:latest",'
            f'worker="{victim["id"]}"}} 1.0') in metrics, \
        [m for m in metrics.splitlines() if "crashes" in m]
    # the 3 queued requests ran on the other worker (each request.done names the worker that
    # served it), as did its own 2 streams
    served = [e for e in events if e["event"] == "request.done" and not e.get("cut")
              and e.get("path") == "/api/generate"]
    assert len(served) == 5 and all(e["status"] == 200 for e in served), served
    assert [e["worker"] for e in served] == [other] * 5, served


def test_crash_loop_marks_worker_failed_then_retries(tmp_path, gateway_factory):
    """A worker that crashes right after becoming ready: 3 crashes within the window mark it
    `failed` (state and detail in /gateway/api/workers); it is tried again after
    failed_retry_s, never in a hot loop; requests meanwhile get 503, never a hang."""
    binary = fake_binary(tmp_path, "crash", first_only=False, extra="--fake-crash-after 0.3")
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "restart_backoff_initial_s": 0.1, "restart_backoff_max_s": 0.2,
        "crash_loop_restarts": 3, "crash_loop_window_s": 60, "failed_retry_s": 4},
        queue={"timeout_s": 1})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg, wait=False)
    w = wait_for(lambda: next((x for x in gw.workers() if x["state"] == "failed"), None), 30,
                 "failed state")
    assert w["detail"].startswith("crash loop: 3 crashes within 60 s")
    assert "exited with status 3" in w["detail"] and w["crash_loops"] == 1
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "x",
                                                   "stream": False}, timeout=30)
    assert r.status_code == 503 and "error" in r.json()
    restarts = w["restarts"]
    # 3 processes ran, 2 of them restarts: the crash that made it failed started none (it was
    # counted as a third restart; a tester's find)
    assert (w["crashes"], restarts) == (3, 2), w
    assert w["detail"].endswith(("; next try in 4 s", "; next try in 3 s")), w["detail"]
    time.sleep(2)
    now = gw.workers()[0]
    assert now["restarts"] == restarts  # waiting, not looping
    # the detail counts down with the 503s' Retry-After (it said 4 s throughout; a fresh
    # tester's find)
    assert now["detail"].endswith(("; next try in 1 s", "; next try in 2 s")), now["detail"]
    # the try after the pause crashes too: failed again at once, not after 3 more crashes
    # with backoffs at their maximum (a fresh tester's request waited 65 s for its 503)
    w2 = wait_for(lambda: next((x for x in gw.workers() if x["crash_loops"] == 2), None), 30,
                  "second crash loop after the retry")
    assert w2["state"] == "failed" and w2["restarts"] == restarts + 1, w2
    assert w2["detail"].startswith("crash loop: the try after the last crash loop ended too "
                                   "(last: exited with status 3"), w2["detail"]
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "x",
                                                   "stream": False}, timeout=30)
    assert r.status_code == 503 and time.monotonic() - t0 < 1, r.text


def test_a_worker_that_hangs_at_every_start_is_failed_and_its_requests_refused(
        tmp_path, gateway_factory):
    """A worker whose every start hangs (it never answers /health) is stopped after each
    ``startup_timeout_s`` and restarted; when a try takes longer than ``crash_loop_window_s``
    (the defaults: 180 s against 120 s) no two restarts fell in one window, so it never became
    ``failed`` and each request for its model waited ``queue.timeout_s`` (10 min) for a 503 (a
    fresh tester's find). ``crash_loop_restarts`` starts in a row that do not get ready now mark
    it failed: requests get the crash-loop 503 at once. The binary is a FAKE wrapper that sleeps
    forever for the model ``hang`` and runs llama-server for ``demo``."""
    from workers.provision import ensure_llama_server
    wrapper = hanging_binary(tmp_path, str(ensure_llama_server()), "hang:latest")
    cfg = base_config(free_port(), llama_server={
        "binary": str(wrapper), "threads": 1, "startup_timeout_s": 2, "crash_loop_window_s": 1,
        "crash_loop_restarts": 2, "restart_backoff_initial_s": 0.2, "failed_retry_s": 60},
        models=[{"name": "demo", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1},
                {"name": "hang", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1}])
    gw = gateway_factory(cfg, wait=False)
    w = wait_for(lambda: next((x for x in gw.workers() if x["id"] == "hang-cpu0"
                               and x["state"] == "failed"), None), 30, "hang-cpu0 failed")
    assert w["detail"].startswith("crash loop: 2 starts in a row did not get ready (last: "), w
    assert w["crash_loops"] == 1 and w["restarts"] == 1
    r = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "hang", "prompt": "x", "raw": True, "stream": False})
    assert r.status_code == 503 and "every worker of it failed" in r.json()["error"], r.text
    assert r.headers["Retry-After"]
    ok = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "x", "raw": True, "stream": False,
        "options": {"num_predict": 2}})
    assert ok.status_code == 200, ok.text


def test_a_binary_that_cannot_be_started_any_more_ends_in_a_crash_loop(tmp_path, gateway_factory):
    """The llama-server binary removed while the gateway runs (an upgrade): each restart's
    spawn failed (ENOENT), and the worker stayed in ``backoff`` forever without counting a
    start, so requests waited for ``queue.timeout_s`` (a fresh tester's find). Failed spawns
    are starts that did not get ready: ``crash_loop_restarts`` of them mark it failed, and
    requests get the crash-loop 503 at once. The binary is a wrapper script that execs the
    real llama-server."""
    from workers.provision import ensure_llama_server
    wrapper = tmp_path / "llama-server-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexec "{ensure_llama_server()}" "$@"\n')
    wrapper.chmod(0o755)
    cfg = base_config(free_port(), llama_server={
        "binary": str(wrapper), "threads": 1, "restart_backoff_initial_s": 0.1,
        "restart_backoff_max_s": 0.2, "crash_loop_restarts": 3, "failed_retry_s": 60},
        queue={"timeout_s": 30})
    cfg["models"][0].update(cpu=1, slots=1, context=512)
    gw = gateway_factory(cfg)
    victim = gw.workers()[0]
    wrapper.unlink()
    os.kill(victim["pid"], signal.SIGKILL)
    w = wait_for(lambda: next((x for x in gw.workers() if x["state"] == "failed"), None), 20,
                 "failed state")
    assert w["detail"].startswith("crash loop: 3 starts in a row did not get ready (last: "
                                  f"spawn failed: {wrapper}: No such file or directory)"), w["detail"]
    assert w["crash_loops"] == 1 and w["restarts"] == 3, w  # the killed run and 2 failed spawns
    assert w["crashes"] == 4, w  # the kill and the 3 failed starts
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/api/generate", timeout=40, json={
        "model": "demo", "prompt": "x", "raw": True, "stream": False})
    assert r.status_code == 503 and "every worker of it failed" in r.json()["error"], r.text
    assert time.monotonic() - t0 < 2 and r.headers["Retry-After"]
    events = [json.loads(ln) for ln in gw.log_path.read_text().splitlines() if ln.startswith("{")]
    assert sum(e["event"] == "worker.spawn_failed" for e in events) == 3


@pytest.mark.parametrize("path,stream", [("/api/generate", False), ("/api/chat", True),
                                         ("/v1/chat/completions", True)])
def test_a_worker_killed_while_it_computes_a_prompt_is_retried_elsewhere(tmp_path,
                                                                          gateway_factory,
                                                                          path, stream):
    """A worker killed (``kill -9``) while it computes a long prompt: no answer byte was sent,
    so the request runs again on the other worker and the client gets the whole answer. The
    gateway asks for prompt-progress events, with which llama-server sends its headers as the
    prompt begins; the retry covered only requests without headers, so these got 502 "the
    worker stopped in the middle of the answer" (a fresh tester's find)."""
    from workers.demo_model import write_demo_model
    cfg = base_config(free_port())
    cfg["models"][0].update(slots=1, cpu=2, context=16384,
                            path=str(write_demo_model(tmp_path / "long.gguf", n_ctx_train=16384)))
    gw = gateway_factory(cfg)
    text = "on " * 11000
    body = ({"model": "demo", "prompt": text, "raw": True} if path == "/api/generate" else
            {"model": "demo", "messages": [{"role": "user", "content": text}]})
    body["stream"] = stream
    body.update({"max_tokens": 6} if path.startswith("/v1") else {"options": {"num_predict": 6}})
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, gw.url + path, json=body, timeout=120)
        busy = wait_for(lambda: next((w for w in gw.workers() if w["busy"]), None), 10,
                        "a worker on the prompt")
        time.sleep(0.3)
        w = next(x for x in gw.workers() if x["id"] == busy["id"])
        assert w["prefill_backlog_tokens"] > 10000, w  # still computing the prompt
        os.kill(w["pid"], signal.SIGKILL)
        r = fut.result(120)
    assert r.status_code == 200, r.text[-300:]
    if path == "/v1/chat/completions":
        events = [json.loads(ln[6:]) for ln in r.text.splitlines()
                  if ln.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    else:
        last = json.loads(r.text.strip().splitlines()[-1])
        assert last.get("done") is True and last["eval_count"] == 6, last
    events = [json.loads(ln) for ln in gw.log_path.read_text().splitlines() if ln.startswith("{")]
    retries = [e for e in events if e["event"] == "upstream.retry"]
    assert [e["worker"] for e in retries] == [busy["id"]], retries


def _killed_mid_answer(gw, path: str, body: dict):
    """POST ``body`` to ``path`` and SIGKILL its worker 0.5 s into the answer; returns (the
    response, the killed worker's row, the gateway's log events, its upstream.answer_again
    events)."""
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, gw.url + path, json=body, timeout=120)
        victim = wait_for(lambda: next((w for w in gw.workers() if w["busy"] == 1), None), 30,
                          "the request on a worker")
        time.sleep(0.5)  # well into its answer
        os.kill(victim["pid"], signal.SIGKILL)
        r = fut.result(timeout=120)
    events = [json.loads(ln) for ln in gw.log_path.read_text().splitlines() if ln.startswith("{")]
    return r, victim, events, [e for e in events if e["event"] == "upstream.answer_again"]


@pytest.mark.parametrize("workers", [2, 1])
def test_a_non_streamed_answer_cut_by_a_crash_is_answered_by_another_worker(
        gateway_factory, workers):
    """A non-streamed request whose worker was SIGKILLed mid-answer got 502, although its client
    had received nothing and another worker was idle (a fresh tester's find). It runs again, once,
    on another worker of its model and is answered in full; with no other worker, 502 as before
    (the same worker restarted would take a request that crashes it twice)."""
    cfg = base_config(free_port(), llama_server={"threads": 1, "restart_backoff_initial_s": 12})
    cfg["models"][0].update(cpu=workers, slots=1, context=8192)
    gw = gateway_factory(cfg)
    body = {"model": "demo", "prompt": "a", "raw": True, "stream": False,
            "options": {"num_predict": 3000, "temperature": 0}}
    r, victim, events, again = _killed_mid_answer(gw, "/api/generate", body)
    if workers == 1:
        assert r.status_code == 502 and again == [], r.text
        # words that do not blame the request: a worker killed from outside reads the same
        assert r.json()["error"] == ("the worker stopped in the middle of the answer "
                                     "(connection lost); please retry"), r.text
        return
    assert r.status_code == 200, r.text
    assert (r.json()["eval_count"], r.json()["done_reason"]) == (3000, "length")
    assert [e["worker"] for e in again] == [victim["id"]], again
    (done,) = [e for e in events if e["event"] == "request.done" and e.get("path") == "/api/generate"]
    assert done["worker"] != victim["id"] and not done.get("cut"), done


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False),
                                         ("/v1/completions", False),
                                         ("/v1/chat/completions", True)])
def test_a_v1_answer_cut_by_a_crash_runs_again_unless_events_were_out(gateway_factory, path,
                                                                      stream):
    """A non-streamed ``/v1`` request whose worker was SIGKILLed mid-answer got 502 while the
    Ollama routes ran it again on the idle worker (a fresh tester's find): it now runs again,
    once, on the other worker and is answered in full. A stream whose events were already out
    cannot be: it ends with an OpenAI error event, and nothing runs again."""
    cfg = base_config(free_port(), llama_server={"threads": 1, "restart_backoff_initial_s": 12})
    cfg["models"][0].update(cpu=2, slots=1, context=8192)
    gw = gateway_factory(cfg)
    body = {"model": "demo", "max_tokens": 3000, "temperature": 0, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "a"}]} if "chat" in path
                else {"prompt": "a"})
    r, victim, events, again = _killed_mid_answer(gw, path, body)
    (done,) = [e for e in events if e["event"] == "request.done" and e.get("path") == path]
    assert r.status_code == 200, r.text[-300:]
    if stream:
        last = json.loads([ln for ln in r.text.splitlines() if ln.startswith("data: {")][-1][6:])
        assert "error" in last and again == [] and done["worker"] == victim["id"], (last, again)
        return
    answer = r.json()
    assert (answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]) \
        == (3000, "length"), answer["usage"]
    assert [e["worker"] for e in again] == [victim["id"]], again
    assert done["worker"] != victim["id"], done
