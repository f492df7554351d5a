"""Edge cases a new user hit through the real gateway (each was a 500, a bypass or a 503 on an
idle gateway before): out-of-vocabulary ``context``, images on a text model over ``/v1``,
llama-server's own ``n_predict`` past ``num_predict_max``, and embedding batches larger than
the queue."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import embed_model, model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw(module_gateway_factory):
    cfg = base_config(free_port(), models=[model("demo"), embed_model(cpu=1)],
                      generation={"num_predict_max": 10}, queue={"max_pending": 2})
    return module_gateway_factory(cfg)


@pytest.mark.parametrize("ctx", [[559], [-1], [1, 2, 99999999]])
def test_context_outside_vocabulary_is_400(gw, ctx):
    for stream in (False, True):
        r = httpx.post(gw.url + "/api/generate", json={"model": "demo", "prompt": "hi", "context": ctx,
                                                       "stream": stream, "options": {"num_predict": 2}})
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"].startswith("context contains invalid token ids")


def test_image_to_text_model_over_v1_is_400(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "demo", "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "demo:latest does not support vision",
                                 "type": "invalid_request_error", "param": None, "code": None}


def test_n_predict_cannot_bypass_num_predict_max(gw):
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "hi",
                                                     "max_tokens": 5, "n_predict": 300}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "n_predict": -1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": "demo", "max_tokens": 1e30, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens must be an integer")
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "demo", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages must be a list of message objects"
    # a second key, or a null, must not lift the cap either (found by a fresh tester)
    for extra in ({"max_tokens": 5, "max_completion_tokens": 100000}, {"max_tokens": None},
                  {"max_completion_tokens": 100000}):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 10, extra
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "demo", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages[0].content[0].text must be a string"


def test_embedding_batch_larger_than_queue_is_served(gw):
    """40 inputs on 1 worker × 2 slots with queue.max_pending 2: the batch keeps at most 2 of
    its inputs in flight, so it never overflows the queue."""
    texts = [f"text number {i}" for i in range(40)]
    r = httpx.post(gw.url + "/api/embed", json={"model": "embed", "input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["embeddings"]) == 40


@pytest.mark.parametrize("field,value,msg", [("stream", "yes", "stream must be a boolean"),
                                             ("stop", 5, "stop must be a string or a list of strings")])
def test_v1_wrong_types_are_400(gw, field, value, msg):
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["message"] == msg


@pytest.mark.parametrize("path,body", [
    ("/api/pull", {"model": "demo"}), ("/api/generate", {"model": "demo", "prompt": "hi"}),
    ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]})])
def test_ollama_stream_must_be_a_boolean(gw, path, body):
    """``"stream": "x"`` is a 400 on every Ollama route that streams (``/api/pull`` answered
    200 and streamed; a fresh tester's find)."""
    r = httpx.post(gw.url + path, json={**body, "stream": "x"}, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": "stream must be a boolean"}
