"""Field case 2 (ollama#4124, #4159): overload is answered 503, never 500, and nothing hangs.

300 concurrent ``/api/embed`` calls of 2 inputs each, then 20 chats, arrive while the workers
are still loading (the binary is a wrapper that sleeps 3 s before exec'ing the real
llama-server): they wait in the gateway and all succeed (``queue.max_pending`` 512 counts
requests, not inputs). Then 1,000 concurrent generations against a queue of 8: every one ends with 200 or
with Ollama's 503 JSON body, none with 500, all within the time limit.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.api.errors import BUSY_MESSAGE
from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import embed_model, model
from tests.fakes import slow_start_binary
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow


async def _fire(url: str, bodies: list[dict], limit_s: float) -> list[tuple[int, str, dict]]:
    async def one(s, body):
        async with s.post(url, json=body) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.json(content_type=None)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        return await asyncio.wait_for(asyncio.gather(*(one(s, b) for b in bodies)), limit_s)


def test_case2_embeds_during_load_wait_and_overflow_is_503_not_500(tmp_path, gateway_factory):
    wrapper, _ = slow_start_binary(tmp_path, str(ensure_llama_server()), 3)
    cfg = base_config(free_port(), llama_server={"binary": str(wrapper), "threads": 1},
                      models=[embed_model(cpu=2), model("demo", cpu=1)],
                      queue={"max_pending": 512})
    gw = gateway_factory(cfg, wait=False)
    assert {w["state"] for w in gw.workers()} == {"starting"}
    # 300 embed requests of 2 inputs each, then 20 chats: 320 requests, under max_pending 512
    # (which counts requests, as Ollama's OLLAMA_MAX_QUEUE does), though 620 inputs wait
    embeds = [{"model": "embed", "input": [f"text {i}", f"more {i}"]} for i in range(300)]
    chat = {"model": "demo", "stream": False, "options": {"num_predict": 4},
            "messages": [{"role": "user", "content": "hi"}]}

    async def load_burst():
        first = asyncio.ensure_future(_fire(gw.url + "/api/embed", embeds, 180))
        waiting = 0
        async with aiohttp.ClientSession() as s:  # until more than 512 inputs wait
            for _ in range(100):
                async with s.get(gw.url + "/gateway/api/workers") as r:
                    waiting = (await r.json())["queue"]["waiting_inputs"]
                if waiting > 512:
                    break
                await asyncio.sleep(0.02)
        chats = asyncio.ensure_future(_fire(gw.url + "/api/chat", [chat] * 20, 180))
        return waiting, await first, await chats

    waiting, res, chats = asyncio.run(load_burst())
    assert waiting > 512  # the chats below arrive with more inputs than max_pending waiting
    assert [r[0] for r in res] == [200] * 300
    assert all(len(r[2]["embeddings"]) == 2 for r in res)
    assert [r[0] for r in chats] == [200] * 20, [r[2] for r in chats if r[0] != 200][:2]

    cfg = base_config(free_port(), models=[model("demo", cpu=2)], queue={"max_pending": 8})
    gw = gateway_factory(cfg)
    body = {"model": "demo", "prompt": "x", "raw": True, "stream": False,
            "options": {"num_predict": 32}}
    res = asyncio.run(_fire(gw.url + "/api/generate", [body] * 1000, 240))
    codes = [r[0] for r in res]
    assert set(codes) <= {200, 503}, sorted(set(codes))
    assert codes.count(200) >= 4 + 8 and codes.count(503) > 0
    for status, ctype, data in res:
        assert ctype.startswith("application/json")
        if status == 503:
            assert data == {"error": BUSY_MESSAGE}
        else:
            assert data["done"] is True and data["eval_count"] == 32
    st = gw.status()
    assert st["queue"]["depth"] == 0 and all(w["busy"] == 0 for w in st["workers"])
