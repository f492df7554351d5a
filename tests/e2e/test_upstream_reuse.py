"""Field case 27: this llama-server build drops reused keep-alive connections under load.
16 concurrent streaming clients send 64 requests through the gateway to one worker: 0 may
fail (the gateway opens a fresh upstream connection per request and retries before the
first byte)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

from tests.conftest import base_config, free_port

pytestmark = pytest.mark.slow


def test_64_streams_16_concurrent_one_worker_no_failures(gateway_factory):
    cfg = base_config(free_port())
    cfg["models"][0].update(cpu=1, slots=4)
    gw = gateway_factory(cfg)
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}],
            "options": {"num_predict": 32}}

    def one(client: httpx.Client) -> dict:
        with client.stream("POST", "/api/chat", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = [json.loads(x) for x in r.iter_lines() if x]
        return lines[-1]

    # 16 keep-alive clients, 4 requests each, all at once
    clients = [httpx.Client(base_url=gw.url, timeout=120) for _ in range(16)]
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            finals = list(ex.map(lambda i: one(clients[i % 16]), range(64)))
    finally:
        for c in clients:
            c.close()
    failures = [f for f in finals if f.get("done") is not True]
    assert failures == [] and len(finals) == 64
    assert all(f["done_reason"] == "length" and f["eval_count"] == 32 for f in finals)
    assert gw.status()["queue"]["depth"] == 0
