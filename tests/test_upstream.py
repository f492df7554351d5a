"""Unit tests of gateway.upstream: its settings (one path, ``Upstream.configure``, takes the
limits of a config, at start and on reload) and its SSE reader against a small asyncio server
(the request paths are covered end to end in tests/e2e)."""

import asyncio
import time

import orjson

from gateway.admission import Admission
from gateway.config import parse_config
from gateway.scheduling import Dispatcher
from gateway.texts import CONTEXT_OVERFLOW_MESSAGE, KV_EXHAUSTED_MESSAGE
from gateway.upstream import (GRAMMAR_DEAD_END_MESSAGE, Upstream, error_event, iter_sse_batches,
                              parse_error_body)
from tests.test_worker_http import post, serve


def _config(first_byte_s, request_s, inter_token_s, client_write_s, write_buffer_bytes,
            spare_connections=True):
    return parse_config({
        "models": [{"name": "demo", "path": "builtin:demo"}],
        "timeouts": {"first_byte_s": first_byte_s, "request_s": request_s,
                     "inter_token_s": inter_token_s, "client_write_s": client_write_s},
        "limits": {"write_buffer_bytes": write_buffer_bytes},
        "llama_server": {"spare_connections": spare_connections}})


def _limits(up: Upstream) -> tuple:
    wd = up.watchdog
    return (up.first_byte_s, up.request_s, wd.first_byte_s, wd.inter_token_s,
            wd.client_write_s, wd.write_buffer_bytes)


def test_limits_come_from_the_config_at_start_and_on_reload():
    up = Upstream(Admission(Dispatcher(time.monotonic)), lambda worker_id: None,
                  _config(5, 50, 2, 3, 4096, spare_connections=False))
    assert _limits(up) == (5, 50, 5, 2, 3, 4096)
    assert up.spares is None and up.watchdog.tick_s == 0.5
    up.configure(_config(0.4, 40, 8, 9, 8192))  # a reload
    assert _limits(up) == (0.4, 40, 0.4, 8, 9, 8192)
    assert up.watchdog.tick_s == 0.1  # the watchdog ticks for the new first-byte limit
    assert up.spares is None  # fixed for the client's life (a restart-only setting)


# Events as the pinned llama-server sends them with ``return_progress`` (recorded from a real
# worker: /completion, then /v1/chat/completions; progress events carry no content).
PROGRESS_EVENTS = [
    b'{"index":0,"content":"","tokens":[0],"stop":false,"id_slot":-1,"tokens_predicted":0,'
    b'"tokens_evaluated":1501,"prompt_progress":{"total":1501,"cache":0,"processed":0,"time_ms":0}}',
    b'{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
    b'"object":"chat.completion.chunk","prompt_progress":{"total":1513,"cache":0,"processed":1513,'
    b'"time_ms":65}}',
]
# A token whose text names the key: inside a JSON string its quotes are escaped.
ANSWER = b'{"index":0,"content":"say \\"prompt_progress\\": 1","tokens":[103],"stop":false}'


def _sse(*payloads: bytes) -> bytes:
    body = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    return b"%x\r\n%s\r\n" % (len(body), body)


async def test_sse_reader_drops_the_prompt_progress_it_asked_for_and_notes_the_answer():
    gate = asyncio.Event()

    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _sse(*PROGRESS_EVENTS))
        await w.drain()
        await gate.wait()
        w.write(_sse(ANSWER, b"[DONE]") + b"0\r\n\r\n")
        await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b"{}", {}, progress=True)
        answers = []
        resp.on_answer = lambda: answers.append(resp.content.total_bytes)
        batches = iter_sse_batches(resp)
        first = asyncio.ensure_future(batches.__anext__())
        while not resp.content.total_bytes:  # the progress events arrived
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not first.done() and not resp.answered and answers == []
        gate.set()
        assert await first == [ANSWER]
        assert resp.answered and len(answers) == 1 and answers[0] > len(b"".join(PROGRESS_EVENTS))
        assert [b async for b in batches] == []


async def test_sse_reader_passes_progress_events_a_client_asked_for():
    """Without ``progress`` (the client set ``return_progress`` itself), nothing is dropped."""
    async def reply(r, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _sse(*PROGRESS_EVENTS, ANSWER) + b"0\r\n\r\n")
        await w.drain()

    server, port, _ = await serve(reply)
    async with server:
        resp = await post("127.0.0.1", port, "/completion", b"{}", {})
        got = [p async for batch in iter_sse_batches(resp) for p in batch]
        assert got == [*PROGRESS_EVENTS, ANSWER] and resp.answered


def test_the_workers_context_overflow_error_gets_the_gateways_words_and_numbers():
    """llama-server's 400 for a prompt over the slot's context (its body, pinned build) reads
    as the gateway's own prompt length check words it; other errors keep the worker's text."""
    body = (b'{"error":{"code":400,"message":"request (4100 tokens) exceeds the available context '
            b'size (4096 tokens), try increasing it","type":"exceed_context_size_error",'
            b'"n_prompt_tokens":4100,"n_ctx":4096}}')
    e = parse_error_body(400, body)
    assert e.kind == "exceed_context_size_error" and e.status == 400
    assert e.message == (f"{CONTEXT_OVERFLOW_MESSAGE} (prompt: 4100 tokens, context per slot: "
                         f"4096 tokens)")
    other = parse_error_body(400, b'{"error":{"code":400,"message":"bad grammar",'
                                  b'"type":"invalid_request_error"}}')
    assert (other.message, other.kind) == ("bad grammar", "invalid_request_error")
    no_numbers = parse_error_body(400, b'{"error":{"message":"request exceeds the available '
                                       b'context size","type":"exceed_context_size_error"}}')
    assert no_numbers.message == "request exceeds the available context size"


def test_worker_500s_that_are_the_clients_fault_are_400():
    """llama-server answers a runtime_error thrown while reading the request with 500; those
    of CLIENT_FAULT_500 are the client's (a content part the model cannot take, a malformed
    message list). Other 500s stay 500."""
    for msg in ("audio input is not supported - hint: if this is unexpected, you may need to "
                "provide the mmproj", "video input is not supported - hint: …",
                "Failed to parse messages: [json.exception.type_error.302] type must be string"):
        body = orjson.dumps({"error": {"code": 500, "message": msg, "type": "server_error"}})
        e = parse_error_body(500, body)
        assert (e.status, e.message) == (400, msg)
    e = parse_error_body(500, b'{"error":{"code":500,"message":"got exception: out of memory"}}')
    assert (e.status, e.message) == (500, "got exception: out of memory")
    assert parse_error_body(501, b'{"error":{"message":"audio input is not supported"}}').status == 501


def test_a_grammar_left_without_tokens_is_the_requests_fault():
    """llama-server answers 500 (or a 500 error event) "Unexpected empty grammar stack" when
    sampling kept no token the grammar allows, e.g. a logit_bias banning them all: 400 with
    the gateway's words in front, in both shapes."""
    text = "got exception: Unexpected empty grammar stack after accepting piece: \u001e (30)"
    err = {"code": 500, "message": text, "type": "server_error"}
    for e in (error_event(err), parse_error_body(500, orjson.dumps({"error": err}))):
        assert e.status == 400
        assert e.message == GRAMMAR_DEAD_END_MESSAGE + text
        assert e.message.startswith("the request's grammar or schema allows no token that")
    # streamed events take CLIENT_FAULT_500 as answers do
    e = error_event({"code": 500, "message": "Failed to parse messages: x"})
    assert (e.status, e.message) == (400, "Failed to parse messages: x")
    assert error_event({"code": "x", "message": "Compute error."}).status == 500


def test_kv_exhaustion_is_load_not_a_server_fault():
    """llama-server fails every running request with 500 "Context size has been exceeded."
    when a decode finds no free KV cells (slots sharing one cache): 503 ``kv_exhausted``,
    in a stream's error event and in an error answer alike; other 500s stay 500."""
    err = {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}
    for e in (error_event(err), parse_error_body(500, orjson.dumps({"error": err}))):
        assert (e.status, e.kind, e.message) == (503, "kv_exhausted", KV_EXHAUSTED_MESSAGE)
    e = error_event({"code": 500, "message": "Compute error.", "type": "server_error"})
    assert (e.status, e.message) == (500, "Compute error.")
