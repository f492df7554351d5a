"""Non-streamed /v1 requests, streamed from the worker and assembled by the gateway
(gateway/api/openai_fold.py), on real llama-server workers through a real gateway.

The answer must equal llama-server's own non-streamed answer to the same request; a client
that leaves frees the worker's slot (seen in the worker's own ``/slots``) at once; a worker that
dies mid-answer gives a 502 JSON, never a truncated 200.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from gateway.api.openai import V1_SAMPLING_DEFAULTS
from gateway.api.openai_legacy import LegacyCompletions
from tests.conftest import base_config, free_port, worker_key

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw(module_gateway_factory):
    """1 worker × 2 slots of 16k tokens each (long answers take seconds on one core)."""
    cfg = base_config(free_port())
    cfg["models"][0].update(cpu=1, slots=2, context=16384)
    return module_gateway_factory(cfg)


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def direct(gw, path: str, body: dict) -> dict:
    """The same request sent straight to the (only) worker, non-streamed, with its key and the
    sampling fields the gateway fills in on ``/v1`` (Ollama's, ``V1_SAMPLING_DEFAULTS``) where
    the body has none."""
    body = {**V1_SAMPLING_DEFAULTS, **body}
    w = gw.workers()[0]
    r = httpx.post(f"http://127.0.0.1:{w['port']}{path}", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {worker_key(w['pid'])}"})
    assert r.status_code == 200, r.text
    return r.json()


def keys(obj: dict) -> dict:
    """The key sets of an answer at every level a client reads."""
    out = {"top": set(obj), "usage": set(obj["usage"]), "timings": set(obj.get("timings", {}))}
    for i, c in enumerate(obj["choices"]):
        out[f"choice{i}"] = set(c)
        if "message" in c:
            out[f"message{i}"] = set(c["message"])
    return out


def same_text(got: str, want: str) -> None:
    """Equal, but for the one difference the stream cannot avoid (openai_fold module doc): an
    answer cut by max_tokens inside a multi-byte character ends, non-streamed, with U+FFFD
    for the incomplete bytes, which llama-server never streams."""
    assert want.startswith(got) and set(want[len(got):]) <= {"\ufffd"}, (got, want)


def same_answer(got: dict, want: dict) -> None:
    assert keys(got) == keys(want)
    for g, w in zip(got["choices"], want["choices"]):
        if "message" in w:
            same_text(g["message"]["content"], w["message"]["content"])
            assert {**g["message"], "content": ""} == {**w["message"], "content": ""}
        else:
            same_text(g["text"], w["text"])
    assert [c["finish_reason"] for c in got["choices"]] == [c["finish_reason"] for c in want["choices"]]
    if "message" not in want["choices"][0]:  # /v1/completions: OpenAI's legacy logprobs
        want = LegacyCompletions(None).answer(copy.deepcopy(want))
    assert [c.get("logprobs") for c in got["choices"]] == [c.get("logprobs") for c in want["choices"]]
    n = len(want["choices"])
    if n == 1:
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got["usage"][k] == want["usage"][k], k
    else:  # the worker's answer carries task 0's usage, the gateway's the whole request's
        assert all(c["finish_reason"] == "length" for c in want["choices"])  # n equal tasks
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]  # one prompt
        assert got["usage"]["completion_tokens"] == n * want["usage"]["completion_tokens"]
        assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"]
    for k in ("object", "system_fingerprint"):
        assert got[k] == want[k], k
    # the model as the client named it ("demo"), as Ollama's /v1 answers; the worker names the
    # canonical one it was sent
    assert (got["model"], want["model"]) == ("demo", "demo:latest")


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Once upon a time"}]


@pytest.mark.parametrize("sampling", [{"temperature": 0, "seed": 42},
                                      {"temperature": 0.9, "seed": 42}])
def test_chat_answer_equals_the_workers_own_non_streamed_answer(gw, client, sampling):
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=CHAT, max_tokens=24, **sampling)
    parsed = raw.parse()  # the openai client accepts it
    got = raw.http_response.json()
    want = direct(gw, "/v1/chat/completions", {"model": "demo:latest", "messages": CHAT,
                                               "max_tokens": 24, **sampling})
    same_answer(got, want)
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
    assert parsed.choices[0].message.content == got["choices"][0]["message"]["content"]
    assert parsed.usage.completion_tokens == 24 and "prompt_tokens_details" in got["usage"]


@pytest.mark.parametrize("extra", [{"temperature": 0, "seed": 42},
                                   {"temperature": 0.9, "seed": 7, "n": 2, "logprobs": 2},
                                   {"temperature": 0.9, "seed": 3, "stop": [" "]}])
def test_completion_answer_equals_the_workers_own_non_streamed_answer(gw, client, extra):
    kw = {k: v for k, v in extra.items() if k not in ("seed",)}
    raw = client.completions.with_raw_response.create(
        model="demo", prompt="The quick brown fox", max_tokens=20, seed=extra["seed"], **kw)
    parsed = raw.parse()
    got = raw.http_response.json()
    want = direct(gw, "/v1/completions", {"model": "demo:latest", "prompt": "The quick brown fox",
                                          "max_tokens": 20, **extra})
    same_answer(got, want)
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert [c.text for c in parsed.choices] == [c["text"] for c in got["choices"]]
    if "logprobs" in extra:  # the openai client reads the legacy shape: llama-server's entries
        for c, raw_c in zip(parsed.choices, want["choices"]):
            assert len(c.logprobs.tokens) == len(raw_c["logprobs"]["content"]) > 0
            assert c.logprobs.token_logprobs == [e["logprob"] for e in raw_c["logprobs"]["content"]]


def test_stream_options_on_a_non_streamed_request_change_nothing(gw, client):
    """llama-server reads ``stream_options`` only when streaming: usage is always there."""
    body = {"model": "demo", "messages": CHAT, "max_tokens": 5, "temperature": 0}
    for so in ({"include_usage": False}, {"include_usage": True}):
        r = httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream_options": so},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def _slots_busy(gw) -> bool:
    return any(s.get("is_processing") for s in gw.slots(gw.workers()[0]))


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}),
    ("/v1/completions", {"prompt": "go"})])
def test_client_that_leaves_frees_the_workers_slot_within_2s(gw, path, body):
    """The client gives up after 1 s of a 15,000-token answer: the gateway closes the
    worker's stream, the worker's own /slots shows the slot idle within 2 s with far fewer
    tokens decoded, and the gateway's lease is back."""
    assert not _slots_busy(gw)
    out = {}

    def run():
        try:
            out["resp"] = httpx.post(gw.url + path, json={"model": "demo", "max_tokens": 15000,
                                                          **body}, timeout=1.0)
        except httpx.HTTPError as e:
            out["error"] = e

    th = threading.Thread(target=run)
    th.start()
    assert _wait(lambda: _slots_busy(gw), 1.0)
    th.join()
    assert isinstance(out.get("error"), httpx.TimeoutException), out
    t_gone = time.monotonic()
    assert _wait(lambda: not _slots_busy(gw), 2.0)
    assert time.monotonic() - t_gone <= 2.0
    slot = max(gw.slots(gw.workers()[0]), key=lambda s: s.get("id_task", -1))
    assert slot["next_token"][0]["n_decoded"] < 15000  # stopped, not finished
    assert _wait(lambda: gw.workers()[0]["busy"] == 0, 0.5)


def test_worker_killed_mid_answer_gives_502_json_not_a_truncated_200(gw):
    out = {}

    def run():
        out["resp"] = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "max_tokens": 15000, "messages": [{"role": "user", "content": "go"}]})

    th = threading.Thread(target=run)
    th.start()
    assert _wait(lambda: _slots_busy(gw), 2.0)
    time.sleep(0.2)  # tokens are flowing
    os.kill(gw.workers()[0]["pid"], signal.SIGKILL)
    th.join(60)
    r = out["resp"]
    assert r.status_code == 502, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    gw.wait_ready(60)  # restarted for the tests after this one
