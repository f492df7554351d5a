"""Requests that no worker can ever take are answered at once, and say why: a model whose workers
are all crash-loop ``failed``, queued requests cut by a shutdown, and queued requests of a model a
reload removed. Real gateway, real llama-server, the real ``ollama`` and ``openai`` clients; the
only fake is the deliberately broken worker binary (tests/fakes ``exiting_binary``)."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import ollama
import openai
import pytest
import yaml

from tests.conftest import base_config, free_port, llama_server_pids, pid_alive
from tests.e2e.test_reload_shutdown import long_context_gateway
from tests.e2e.test_watchdog import stream_lines, wait_for
from tests.fakes import exiting_binary
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow

QUEUE_TIMEOUT_S = 60
FAILED_TEXT = "every worker of it failed"
MSGS = [{"role": "user", "content": "hi"}]


def timed(fn):
    """Run ``fn``; (its result or the exception it raised, monotonic time it ended)."""
    try:
        out = fn()
    except Exception as e:  # the errors are what these tests look at
        out = e
    return out, time.monotonic()


def clients(gw) -> tuple[ollama.Client, openai.OpenAI]:
    # max_retries=0: the openai client retries 503s by itself; here each call is timed alone.
    return (ollama.Client(host=gw.url, timeout=QUEUE_TIMEOUT_S + 30),
            openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                          timeout=QUEUE_TIMEOUT_S + 30))


def assert_failed_refusal(err, ended: float, *, since: float, within_s: float) -> None:
    """``err`` is the crash-loop refusal (503, failed text, Retry-After) of either client."""
    assert ended - since < within_s < QUEUE_TIMEOUT_S, (ended - since, err)
    if isinstance(err, ollama.ResponseError):
        assert err.status_code == 503 and FAILED_TEXT in err.error and "crash loop" in err.error
        return
    assert isinstance(err, openai.InternalServerError), repr(err)
    assert err.status_code == 503 and err.body["type"] == "server_error"
    assert FAILED_TEXT in err.body["message"] and "crash loop" in err.body["message"]
    assert 1 <= int(err.response.headers["Retry-After"]) <= 300  # the supervisor's next try


def test_failed_workers_refuse_queued_and_new_requests_at_once_until_an_admin_restart(
        tmp_path, gateway_factory):
    go, heal = tmp_path / "go", tmp_path / "heal"
    binary = exiting_binary(tmp_path, str(ensure_llama_server()), go=go, heal=heal)
    cfg = base_config(free_port(), llama_server={
        "binary": str(binary), "restart_backoff_initial_s": 0.1, "restart_backoff_max_s": 0.2,
        "crash_loop_restarts": 3, "crash_loop_window_s": 60, "failed_retry_s": 300},
        queue={"timeout_s": QUEUE_TIMEOUT_S}, admin={"token": "t"})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg, wait=False)
    oc, ai = clients(gw)
    with cf.ThreadPoolExecutor(3) as ex:
        # While the worker is starting, requests wait (in the queue, or for a worker to render
        # the prompt template: /api/generate without raw).
        waiting = [
            ex.submit(timed, lambda: oc.chat(model="demo", messages=MSGS, options={"num_predict": 4})),
            ex.submit(timed, lambda: ai.chat.completions.create(model="demo", messages=MSGS,
                                                                max_tokens=4)),
            ex.submit(timed, lambda: oc.generate(model="demo", prompt="hi",
                                                 options={"num_predict": 4}))]
        wait_for(lambda: (s := gw.status())["queue"]["depth"] == 2 and s["in_flight"] >= 3, 30,
                 "2 queued requests and a generate waiting for a worker")
        time.sleep(0.5)
        assert not any(f.done() for f in waiting)
        assert gw.workers()[0]["state"] == "starting"
        go.touch()  # from now on every start of the worker exits at once: crash loop
        since = time.monotonic()
        for f in waiting:  # answered when the worker is marked failed (3 quick restarts)
            assert_failed_refusal(*f.result(timeout=30), since=since, within_s=10)
    w = gw.workers()[0]
    assert w["state"] == "failed" and w["detail"].startswith("crash loop: 3 crashes")
    assert gw.status()["queue"]["depth"] == 0
    # /api/ps shows it with its failed worker and why, as field case 13 asks (an earlier
    # version hid it, as Ollama lists only loaded models, and `ollama ps` was empty)
    [m] = oc.ps().models
    assert m.model == "demo:latest" and m.size_vram == 0
    [pw] = httpx.get(gw.url + "/api/ps", timeout=10).json()["models"][0]["workers"]
    assert pw["state"] == "failed" and pw["detail"].startswith("crash loop: 3 crashes"), pw

    # New requests: refused at once, by both clients and in both shapes.
    for call in (lambda: oc.chat(model="demo", messages=MSGS),
                 lambda: ai.chat.completions.create(model="demo", messages=MSGS, max_tokens=4),
                 lambda: oc.generate(model="demo", prompt="hi")):
        t0 = time.monotonic()
        assert_failed_refusal(*timed(call), since=t0, within_s=2)
    r = httpx.post(gw.url + "/api/chat", json={"model": "demo", "messages": MSGS}, timeout=10)
    assert r.status_code == 503 and list(r.json()) == ["error"] and FAILED_TEXT in r.json()["error"]
    assert r.headers["content-type"].startswith("application/json")
    assert 1 <= int(r.headers["Retry-After"]) <= 300
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "hi"}, timeout=10)
    assert r.status_code == 503 and FAILED_TEXT in r.json()["error"]["message"]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # A load request (empty prompt / no messages, what clients send to pre-load a model) is
    # refused the same way, not answered "load" (a fresh tester's find); an unload still is.
    for path, body in (("/api/generate", {"prompt": ""}), ("/api/chat", {"messages": []})):
        r = httpx.post(gw.url + path, json={"model": "demo", **body}, timeout=10)
        assert r.status_code == 503 and FAILED_TEXT in r.json()["error"], (path, r.text)
        assert 1 <= int(r.headers["Retry-After"]) <= 300
    r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "keep_alive": 0}, timeout=10)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text

    # The worker binary is fixed; an admin restart brings the worker back and requests run.
    heal.touch()
    r = httpx.post(gw.url + "/gateway/api/admin/workers/demo-cpu0/restart",
                   headers={"Authorization": "Bearer t"}, timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    assert oc.chat(model="demo", messages=MSGS, options={"num_predict": 4}).done is True
    out = ai.chat.completions.create(model="demo", messages=MSGS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert [m.model for m in oc.ps().models] == ["demo:latest"]


def _long_stream(url: str, model: str) -> tuple[int, list[dict]]:
    return stream_lines(url + "/api/generate", {"model": model, "prompt": "x", "raw": True,
                                                "options": {"num_predict": 60000}}, 60)


def test_queued_requests_cut_by_shutdown_say_the_gateway_is_shutting_down(tmp_path):
    gw = long_context_gateway(tmp_path, slots=1, drain_s=1)
    pids = [w["pid"] for w in gw.workers()]
    oc, ai = clients(gw)
    with cf.ThreadPoolExecutor(3) as ex:
        running = ex.submit(_long_stream, gw.url, "demo")
        wait_for(lambda: gw.workers()[0]["busy"] == 1, 30, "the only slot busy")
        queued = [ex.submit(timed, lambda: oc.chat(model="demo", messages=MSGS)),
                  ex.submit(timed, lambda: ai.chat.completions.create(model="demo", messages=MSGS))]
        wait_for(lambda: gw.status()["queue"]["depth"] == 2, 30, "2 queued requests")
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        (ol_err, ol_t), (ai_err, ai_t) = [f.result(timeout=30) for f in queued]
        status, lines = running.result(timeout=30)
    assert gw.proc.wait(30) == 0
    # answered when the drain time (1 s) ran out, not after the queue timeout
    assert 1 <= ol_t - t0 < 5 and 1 <= ai_t - t0 < 5, (ol_t - t0, ai_t - t0)
    assert isinstance(ol_err, ollama.ResponseError) and ol_err.status_code == 503
    assert ol_err.error.startswith("server shutting down, please try again: the gateway is "
                                   "shutting down")
    assert isinstance(ai_err, openai.InternalServerError) and ai_err.status_code == 503
    assert ai_err.body["message"].startswith("server shutting down, please try again")
    assert "error" in lines[-1]  # the running stream was cut as the worker stopped
    assert not any(pid_alive(p) for p in pids)
    assert not (set(pids) & llama_server_pids())


def test_queued_requests_of_a_model_removed_by_reload_get_404(gateway_factory):
    cfg = base_config(free_port(), shutdown={"drain_s": 1}, admin={"token": "t"}, models=[
        {"name": "alpha", "path": "builtin:demo", "slots": 1, "context": 65536, "cpu": 1},
        {"name": "beta", "path": "builtin:demo", "slots": 1, "context": 1024, "cpu": 1}])
    gw = gateway_factory(cfg)
    oc, ai = clients(gw)
    with cf.ThreadPoolExecutor(3) as ex:
        running = ex.submit(_long_stream, gw.url, "alpha")
        wait_for(lambda: next(w for w in gw.workers() if w["id"] == "alpha-cpu0")["busy"] == 1,
                 30, "alpha's only slot busy")
        queued = [ex.submit(timed, lambda: oc.chat(model="alpha", messages=MSGS)),
                  ex.submit(timed, lambda: ai.chat.completions.create(model="alpha",
                                                                      messages=MSGS))]
        wait_for(lambda: gw.status()["queue"]["depth"] == 2, 30, "2 queued requests")
        new = yaml.safe_load(gw.cfg_path.read_text())
        new["models"].pop(0)  # alpha removed
        gw.cfg_path.write_text(yaml.safe_dump(new))
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/gateway/api/admin/reload", headers={"Authorization": "Bearer t"},
                       timeout=120)
        assert r.status_code == 200 and r.json()["removed"] == ["alpha-cpu0"], r.text
        (ol_err, ol_t), (ai_err, ai_t) = [f.result(timeout=30) for f in queued]
        running.result(timeout=30)
    # answered as the reload began removing alpha's worker, not once it had drained (1 s) and
    # stopped (up to stop_grace_s more while llama-server finishes the running stream)
    assert ol_t - t0 < 5 and ai_t - t0 < 5, (ol_t - t0, ai_t - t0)
    text = "model 'alpha:latest' not found (removed from the gateway's config by a reload)"
    assert isinstance(ol_err, ollama.ResponseError), repr(ol_err)
    assert ol_err.status_code == 404 and ol_err.error == text
    assert isinstance(ai_err, openai.NotFoundError), repr(ai_err)
    # /v1: OpenAI's own words and the name as asked, as for a request naming it afterwards
    assert ai_err.body["message"] == ("The model `alpha` does not exist or you do not have "
                                      "access to it."), ai_err.body
    assert ai_err.body["code"] == "model_not_found" and "retry-after" not in ai_err.response.headers
    assert oc.chat(model="beta", messages=MSGS, options={"num_predict": 2}).done is True


def test_a_model_with_no_worker_planned_here_is_refused_at_once(gateway_factory):
    """``gpus: auto`` with ``cpu_fallback: 0`` on this machine without a GPU: no worker."""
    cfg = base_config(free_port(), queue={"timeout_s": QUEUE_TIMEOUT_S})
    cfg["models"].append({"name": "gpuonly", "path": "builtin:demo", "gpus": "auto",
                          "cpu_fallback": 0})
    gw = gateway_factory(cfg)
    oc, ai = clients(gw)
    t0 = time.monotonic()
    ol_err, ol_t = timed(lambda: oc.chat(model="gpuonly", messages=MSGS))
    ai_err, ai_t = timed(lambda: ai.chat.completions.create(model="gpuonly", messages=MSGS))
    assert ai_t - t0 < 5, (ol_t - t0, ai_t - t0)
    text = "model 'gpuonly:latest' has no worker on this machine"
    assert isinstance(ol_err, ollama.ResponseError) and ol_err.status_code == 503, repr(ol_err)
    assert ol_err.error.startswith(text)
    assert isinstance(ai_err, openai.InternalServerError) and ai_err.status_code == 503
    assert ai_err.body["message"].startswith(text) and "retry-after" not in ai_err.response.headers
    assert oc.chat(model="demo", messages=MSGS, options={"num_predict": 2}).done is True
