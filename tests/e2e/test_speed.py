"""Measured decode speed on a real gateway over HTTP (``gateway/speed.py``).

Two FAKE workers (``tests/fakes/paced_llama_server.py``: a real llama-server's speed cannot be
set) generate at 300 and 100 tokens/s per sequence and count their ``/metrics`` generation
counters as llama-server does. The gateway must measure them (``speed`` 3 and 1 in
``/gateway/api/workers`` and ``llama_gateway_worker_speed_ratio``), give the fast one 3 of 4
long requests (least_loaded; 2 of 4 while speeds are equal, or with
``scheduler.measured_speed: false``), and forget the measurement of a worker that restarts.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import base_config, free_port
from tests.fakes import paced_binary

pytestmark = pytest.mark.slow

FAST, SLOW = 300.0, 100.0  # tokens/s per sequence
ADMIN = {"Authorization": "Bearer t"}


def fake_tps(pid: int) -> float:
    """The ``--fake-tps`` a FAKE worker process was started with."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return float(args[args.index(b"--fake-tps") + 1])


class Chat:
    """A streamed chat of its own prompt (no prefix shared with the others), open once its first
    line has come."""

    def __init__(self, gw, i: int, max_tokens: int):
        self.client = httpx.Client(timeout=30)
        body = {"model": "demo", "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"{i} tell me story number {i}"}]}
        self.resp = self.client.send(self.client.build_request(
            "POST", gw.url + "/v1/chat/completions", json=body), stream=True)
        assert self.resp.status_code == 200, self.resp.read()
        self.lines = self.resp.iter_lines()
        next(self.lines)

    def finish(self) -> list[str]:
        """The rest of the answer's non-empty lines."""
        rest = [line for line in self.lines if line]
        self.client.close()
        return rest

    def close(self) -> None:
        self.client.close()


def by_id(gw) -> dict[str, dict]:
    return {w["id"]: w for w in gw.workers()}


def busy_with_long_requests(gw, first: int) -> dict[str, int]:
    """Busy slots per worker while 4 long requests of their own prompts (numbered from
    ``first``) stream; they are closed after."""
    with cf.ThreadPoolExecutor(4) as ex:
        streams = list(ex.map(lambda i: Chat(gw, first + i, 1500), range(4)))
    try:
        return {w: v["busy"] for w, v in by_id(gw).items()}
    finally:
        for c in streams:
            c.close()


def reload(gw, cfg: dict) -> None:
    gw.cfg_path.write_text(yaml.safe_dump(cfg))
    r = httpx.post(gw.url + "/gateway/api/admin/reload", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text


def wait_for(pred, timeout: float):
    end = time.monotonic() + timeout
    while not (v := pred()) and time.monotonic() < end:
        time.sleep(0.1)
    return v


def test_faster_worker_is_measured_and_takes_more(gateway_factory, tmp_path):
    cfg = base_config(free_port(), llama_server={"binary": str(paced_binary(tmp_path, FAST, SLOW))},
                      admin={"token": "t"})
    cfg["models"][0].update(slots=4, context=8192)  # cpu: 2 → two workers × 4 slots
    gw = gateway_factory(cfg)
    ws = by_id(gw)
    fast = next(w for w, v in ws.items() if fake_tps(v["pid"]) == FAST)
    slow = next(w for w in ws if w != fast)
    assert {w["speed"] for w in ws.values()} == {1.0}
    assert all(w["sequence_tokens_per_s"] is None for w in ws.values())

    # Warm-up: 8 requests of 120 tokens, 4 per worker (equal speeds): 1.6 s of generation on
    # the fast worker, 4.8 s on the slow one, both past the 1 s measuring window.
    with cf.ThreadPoolExecutor(8) as ex:
        for c in ex.map(lambda i: Chat(gw, i, 120), range(8)):
            assert c.finish()[-1] == "data: [DONE]"

    def both_measured():
        ws = by_id(gw)
        return ws if all(w["sequence_tokens_per_s"] is not None for w in ws.values()) else None

    measured = wait_for(both_measured, 5)
    assert measured, by_id(gw)
    assert measured[slow]["speed"] == 1.0  # the lower median is the reference
    assert 2.4 <= measured[fast]["speed"] <= 3.6, measured
    assert measured[fast]["sequence_tokens_per_s"] == pytest.approx(FAST, rel=0.2)
    assert measured[slow]["sequence_tokens_per_s"] == pytest.approx(SLOW, rel=0.2)
    metrics = {s.labels["worker"]: s.value
               for f in text_string_to_metric_families(httpx.get(gw.url + "/metrics").text)
               for s in f.samples if s.name == "llama_gateway_worker_speed_ratio"}
    assert metrics == {fast: pytest.approx(measured[fast]["speed"], abs=1e-3), slow: 1.0}

    # 4 long requests on 2 × 4 slots: 3 go to the fast worker.
    assert busy_with_long_requests(gw, 100) == {fast: 3, slow: 1}

    # scheduler.measured_speed false, by reload: speeds 1.0 at once, rates still measured and
    # shown, and 4 long requests split 2 : 2 (then back on).
    cfg = yaml.safe_load(gw.cfg_path.read_text())
    cfg["scheduler"] = {**cfg.get("scheduler", {}), "measured_speed": False}
    reload(gw, cfg)
    off = by_id(gw)
    assert {w["speed"] for w in off.values()} == {1.0}
    assert off[fast]["sequence_tokens_per_s"] == pytest.approx(FAST, rel=0.2)
    assert busy_with_long_requests(gw, 200) == {fast: 2, slow: 2}
    cfg["scheduler"]["measured_speed"] = True
    reload(gw, cfg)
    assert 2.4 <= by_id(gw)[fast]["speed"] <= 3.6

    # A restart forgets the measurement (a new process; this one is paced at SLOW).
    r = httpx.post(f"{gw.url}/gateway/api/admin/workers/{fast}/restart", headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text
    after = by_id(gw)
    assert after[fast]["speed"] == 1.0 and after[fast]["sequence_tokens_per_s"] is None
    assert after[slow]["speed"] == 1.0  # the only measured worker is its own reference
