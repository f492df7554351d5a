"""Fuzz every endpoint with hypothesis: wrong types, huge numbers, deep nesting, invalid UTF-8,
missing fields, odd headers. Never a 500, never a hang, always a JSON error in the route's
shape. Extend ``ENDPOINTS`` when routes are added."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import base_config, free_port, start_gateway

pytestmark = pytest.mark.slow

# (method, path, shape): shape "ollama" = {"error": str}, "openai" = {"error": {"message"...}}
ENDPOINTS = [
    ("POST", "/api/generate", "ollama"), ("POST", "/api/chat", "ollama"),
    ("POST", "/api/show", "ollama"), ("GET", "/api/tags", "ollama"), ("GET", "/api/ps", "ollama"),
    ("POST", "/v1/chat/completions", "openai"), ("POST", "/v1/completions", "openai"),
    ("GET", "/v1/models", "openai"),
]
FIELDS = ["model", "prompt", "messages", "stream", "options", "format", "system", "raw", "keep_alive",
          "max_tokens", "stop", "tools", "name", "images", "template", "context", "temperature",
          "num_predict", "role", "content", "stream_options", "n"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=30),
                    st.sampled_from(["demo", "demo:latest", "nope", "", "json", -1, 0, 10**30]))


values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.sampled_from(FIELDS), c, max_size=4)),
                      max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 3, None]),
                                 "content": values})
body = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.fixed_dictionaries({"model": st.just("demo"), "prompt": values, "stream": values,
                           "options": st.one_of(values, st.dictionaries(
                               st.sampled_from(["num_predict", "top_k", "temperature", "stop", "seed"]),
                               values, max_size=3))}),
    st.fixed_dictionaries({"model": st.just("demo"), "messages": st.lists(message, max_size=3),
                           "stream": st.booleans(), "max_tokens": values}),
)
raw_bodies = st.one_of(
    body.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
    st.just(b"\xff\xfe{\"model\": \"demo\"}"),
    st.just(b'{"model": "demo", "prompt": "\xc3\x28"}'),  # invalid UTF-8 inside a string
    st.just(b'{"model": "demo", "options": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001),
    st.just(b"[" * 5000),
    st.just(b""), st.just(b"null"), st.just(b"[]"), st.just(b'"x"'), st.just(b"1e999999"),
)
headers = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                                     "application/json; charset=latin-1"]),
    "X-Priority": st.sampled_from(["1", "-5", "high", "99999999999999999999"]),
    "X-Request-ID": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20),
    "Authorization": st.sampled_from(["Bearer x", "Basic abc", ""]),
})


@pytest.fixture(scope="module")
def fuzz_gw(tmp_path_factory):
    cfg = base_config(free_port(), generation={"num_predict_max": 4},
                      timeouts={"request_s": 20})
    cfg["models"][0].update(cpu=1, slots=2)
    gw = start_gateway(tmp_path_factory.mktemp("fuzz"), cfg)
    client = httpx.Client(base_url=gw.url, timeout=30)
    yield gw, client
    client.close()
    gw.stop()


def check(resp: httpx.Response, shape: str) -> None:
    assert resp.status_code != 500 and resp.status_code < 600, resp.text[:300]
    if resp.status_code >= 400:
        assert resp.headers["content-type"].startswith("application/json"), resp.headers
        err = resp.json()["error"]
        if shape == "ollama":
            assert isinstance(err, str) and err
        else:
            assert isinstance(err["message"], str) and err["message"]
    else:
        text = resp.text
        if "ndjson" in resp.headers.get("content-type", ""):
            lines = [json.loads(x) for x in text.splitlines() if x]
            assert lines and ("done" in lines[-1] or "error" in lines[-1])
        elif "event-stream" not in resp.headers.get("content-type", ""):
            json.loads(text)


@pytest.mark.parametrize("method,path,shape", ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_bodies, hdrs=headers)
def test_fuzz_endpoint(fuzz_gw, method, path, shape, raw, hdrs):
    gw, client = fuzz_gw
    if method == "GET":
        resp = client.request(method, path, headers=hdrs)
    else:
        resp = client.request(method, path, content=raw, headers=hdrs)
    check(resp, shape)


def test_gateway_still_serves_after_fuzz(fuzz_gw):
    gw, client = fuzz_gw
    r = client.post("/api/generate", json={"model": "demo", "prompt": "a", "stream": False})
    assert r.status_code == 200 and r.json()["done"] is True
    st = gw.status()
    assert all(w["busy"] == 0 for w in st["workers"]) and st["queue"]["depth"] == 0
    assert "request.failed" not in gw.log_path.read_text()  # no handler crashed
