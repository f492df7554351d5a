"""Slot-aware dispatch on real workers: 2 workers × 2 slots, 8 long requests (issue 2,
field cases 1 and 9)."""

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from tests.conftest import base_config, free_port

pytestmark = pytest.mark.slow

LONG = {"model": "demo", "prompt": "tell me a long story", "raw": True, "stream": False,
        "options": {"num_predict": 1500, "temperature": 1.0}}


def long_cfg(**over):
    cfg = base_config(free_port(), **over)
    cfg["models"][0]["context"] = 4096
    return cfg


def _watch(gw, stop, samples, states=None):
    """Poll each worker's own /slots and the gateway's accounting until ``stop`` is set;
    ``states`` (a set) collects every worker state seen."""
    states = set() if states is None else states
    while not stop.is_set():
        ws = gw.workers()
        per = {w["id"]: sum(1 for s in gw.slots(w) if s.get("is_processing")) for w in ws}
        st = httpx.get(gw.url + "/gateway/api/workers").json()
        samples.append((per, {w["id"]: w["busy"] for w in st["workers"]}, st["queue"]["depth"]))
        # field case 12: every slot busy is never "unhealthy": the workers stay ready
        states.update(w["state"] for w in st["workers"])
        time.sleep(0.05)


def test_eight_long_requests_run_four_at_once(gateway_factory):
    gw = gateway_factory(long_cfg())
    stop, samples, states = threading.Event(), [], set()
    watcher = threading.Thread(target=_watch, args=(gw, stop, samples, states))
    watcher.start()
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=LONG, timeout=300)
                    for _ in range(8)]
            results = [f.result() for f in futs]
    finally:
        stop.set()
        watcher.join()
    assert [r.status_code for r in results] == [200] * 8
    assert all(r.json()["done_reason"] == "length" and r.json()["eval_count"] == 1500
               for r in results)
    # never more than 2 per worker, seen from the worker itself and from the gateway
    assert max(max(per.values()) for per, _, _ in samples) == 2
    assert max(max(busy.values()) for _, busy, _ in samples) == 2
    # at some instant both workers ran 2 and 4 waited in the gateway
    assert any(sorted(busy.values()) == [2, 2] and q == 4 for _, busy, q in samples), samples[:20]
    assert any(sorted(per.values()) == [2, 2] for per, _, _ in samples)
    assert states == {"ready"}, states
    # field case 9: /api/ps lists the model once, with the capacity of both workers
    ps = httpx.get(gw.url + "/api/ps", timeout=10).json()["models"]
    assert [m["name"] for m in ps] == ["demo:latest"], ps
    assert sorted(w["slots"] for w in ps[0]["workers"]) == [2, 2], ps


def test_queue_full_answers_503_with_ollama_body(gateway_factory):
    gw = gateway_factory(long_cfg(queue={"max_pending": 2, "retry_after_s": 3}))
    with cf.ThreadPoolExecutor(8) as ex:
        futs = []
        for i in range(8):
            futs.append(ex.submit(httpx.post, gw.url + "/api/generate", json=LONG, timeout=300))
            time.sleep(0.05)  # arrival order, so the first 6 are the admitted ones
        results = [f.result() for f in futs]
    codes = [r.status_code for r in results]
    assert sorted(codes) == [200] * 6 + [503] * 2, codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["content-type"].startswith("application/json")
            assert r.json() == {"error": "server busy, please try again.  "
                                         "maximum pending requests exceeded"}
            assert r.headers["Retry-After"] == "3"
