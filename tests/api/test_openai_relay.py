"""gateway/api/openai.py ``_relay_stream`` between a FAKE upstream (a llama-server-shaped SSE
stream written by the test, since the pinned llama-server only sometimes puts the case on the
wire) and a real aiohttp client."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.api.openai import _relay_stream
from gateway.api.openai_usage import UsageSum
from tests.test_upstream import _sse
from tests.test_worker_http import post, serve

pytestmark = pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey")

HEAD = b'"created":1,"id":"chatcmpl-x","model":"m","object":"chat.completion.chunk"'
# llama-server carries the chat's first role delta in its prompt-progress events when there
# are any (server-task.cpp to_json_oaicompat_chat_stream: ``first || is_progress``)
PROGRESS = (b'{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
            b'"content":null}}],' + HEAD + b',"prompt_progress":{"total":90,"cache":0,'
            b'"processed":64,"time_ms":1.0}}')
TOKEN = b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"hi"}}],' + HEAD + b'}'


async def _relayed(payloads: list[bytes], progress: bool) -> list[dict]:
    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _sse(*payloads) + b"0\r\n\r\n")
        await w.drain()

    server, port, _ = await serve(reply)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await post("127.0.0.1", port, "/v1/chat/completions", b"{}", {}, progress=progress)
        started: list = []
        await _relay_stream(request, resp, started, False, UsageSum(1), chat=True)
        return started[0]

    app = web.Application()
    app.router.add_post("/", handler)
    async with server, TestClient(TestServer(app)) as client:
        text = await (await client.post("/")).text()
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


async def test_a_chat_stream_starts_with_its_role_when_only_dropped_progress_events_had_it():
    """The gateway drops the progress events it asked for; the first chunk a client saw then
    lacked ``role`` (the openai client's ``delta.role`` None; seen once in a full run)."""
    events = await _relayed([PROGRESS, TOKEN, b"[DONE]"], progress=True)
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": None}, {"content": "hi"}]
    assert all("prompt_progress" not in e for e in events)
    assert events[0]["id"] == events[1]["id"] == "chatcmpl-x"


async def test_a_stream_that_has_its_role_gets_no_second_one():
    role = PROGRESS.replace(b',"prompt_progress":{"total":90,"cache":0,"processed":64,'
                            b'"time_ms":1.0}', b"")
    events = await _relayed([PROGRESS, role, TOKEN, b"[DONE]"], progress=True)
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": None}, {"content": "hi"}]
