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
    # an integer literal past 64 bits (orjson reads it as a float) is out of range, not "not an
    # integer" (a fresh tester's find); so is 1e30, which JSON cannot tell from it
    for big in (1e30, 10 ** 30):
        r = httpx.post(gw.url + "/v1/chat/completions", json={
            "model": "demo", "max_tokens": big, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            "max_tokens is out of range for a 64-bit integer", r.text
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "hi", "n": 10 ** 30})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "n is out of range for a 64-bit integer", r.text
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2.5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be an integer, got 2.5"
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


@pytest.mark.parametrize("field,value,msg", [
    ("stream", "yes", "stream must be a boolean"),
    ("stop", 5, "stop must be a string or a list of strings"),
    # llama-server drops these without a word when their type is wrong (a fresh tester's find)
    ("response_format", "json", 'response_format must be an object, got "json"'),
    ("logit_bias", "x", 'logit_bias must be an object, got "x"'),
    ("top_logprobs", 21, "top_logprobs must be between 0 and 20"),
    # also dropped without a word by llama-server: a type that is not a string, a schema that
    # is not an object, logit_bias entries it cannot read or token ids outside the vocabulary
    ("response_format", {"type": 5},
     "response_format.type must be one of 'text', 'json_object' or 'json_schema', got 5"),
    ("response_format", {"type": "json_schema", "json_schema": "x"},
     'response_format.json_schema must be an object, got "x"'),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
     "response_format.json_schema.schema must be an object, got []"),
    ("logit_bias", [1, 2], "logit_bias[0] must be a [token, bias] pair, got 1"),
    ("logit_bias", {"5": "x"}, 'logit_bias["5"] must be a number, got "x"'),
    ("logit_bias", {"100000": -1}, "logit_bias token 100000 is outside the model's vocabulary "
                                   "of 559 tokens"),
    ("logit_bias", [[-1, 2]], "logit_bias token -1 is outside the model's vocabulary of 559 tokens"),
    ("top_logprobs", 10 ** 30, "top_logprobs is out of range for a 64-bit integer"),
    # llama-server's own n_probs: the whole vocabulary per token (a 69 MB answer on the demo;
    # a fresh tester's find)
    ("n_probs", 559, "n_probs must be between 0 and 20, as top_logprobs"),
    ("n_probs", -1, "n_probs must be between 0 and 20, as top_logprobs"),
    ("n_probs", "5", 'n_probs must be an integer, got "5"')])
def test_v1_wrong_types_are_400(gw, field, value, msg):
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": "demo", "max_tokens": 2, "logprobs": True,
        "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["message"] == msg, r.text


def test_v1_n_probs_is_bounded_on_completions_too(gw):
    r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "max_tokens": 2, "prompt": "hi", "n_probs": 559})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "n_probs must be between 0 and 20, as top_logprobs"
    r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "max_tokens": 2, "prompt": "hi", "n_probs": 20})
    assert r.status_code == 200, r.text


def test_v1_top_logprobs_in_range_and_logit_bias_as_a_list_still_run(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "max_tokens": 2, "logprobs": True, "top_logprobs": 20,
        "logit_bias": [[5, -1.0], ["hi", False]], "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def _nested(depth: int):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "metadata"),
                                        ("/v1/completions", "x"), ("/api/chat", "format")])
def test_json_nested_past_the_limit_is_400_and_within_it_runs(gw, path, field):
    """JSON nested 300 levels deep in a field the gateway forwards was a 500 with a traceback
    (orjson writes at most 254 levels; a fresh tester's find): now a 400 in the route's shape
    past 128 levels, and a body of exactly 128 levels (the field's value 127 deep) still runs."""
    body = {"model": "demo", "max_tokens": 2, "options": {"num_predict": 2}, "stream": False}
    body.update({"prompt": "hi"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    for depth in (300, 129):
        r = httpx.post(gw.url + path, json={**body, field: _nested(depth)}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400, r.text
        msg = err["message"] if path.startswith("/v1") else err
        assert msg == "invalid JSON: nested more than 128 levels deep", r.text
    if path.startswith("/v1"):  # a format nested this deep is no schema (and 400 for that)
        r = httpx.post(gw.url + path, json={**body, field: _nested(127)}, timeout=60)
        assert r.status_code == 200, r.text


def test_audio_part_on_a_text_model_is_400(gw):
    """llama-server answers an ``input_audio`` part on a model without an audio projector with
    500 (a runtime_error); the client's fault, so 400 (a fresh tester's find), as an image is."""
    for stream in (False, True):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
            "model": "demo", "max_tokens": 2, "stream": stream, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "aGk=", "format": "wav"}}]}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("audio input is not supported")


def test_malformed_tool_calls_are_400(gw):
    """``tool_calls`` that is not a list of objects was dropped, leaving an empty assistant turn
    and a 200 with nothing generated (a fresh tester's find)."""
    for calls in ("x", [None], [{"function": "f"}], [{}], [{"id": "c1"}]):
        r = httpx.post(gw.url + "/api/chat", timeout=30, json={
            "model": "demo", "stream": False, "options": {"num_predict": 2},
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "", "tool_calls": calls}]})
        assert r.status_code == 400, (calls, r.text)
        assert r.json()["error"] == ("messages[1].tool_calls must be a list of objects, each with "
                                     "an object function")


def test_ollama_long_model_names_reach_the_model(gw):
    """Ollama reads ``demo`` as ``registry.ollama.ai/library/demo:latest``; clients that send
    the long form got 404 (a fresh tester's find)."""
    for name in ("library/demo", "registry.ollama.ai/library/demo:latest", "Library/Demo"):
        r = httpx.post(gw.url + "/api/chat", timeout=60, json={
            "model": name, "stream": False, "options": {"num_predict": 2},
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == name, (name, r.text)
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, (name, r.text)
    r = httpx.post(gw.url + "/api/show", json={"model": "registry.ollama.ai/demo"}, timeout=30)
    assert r.status_code == 404  # a namespace "registry.ollama.ai", not the default host


def test_405_names_the_allowed_methods_and_v1_root_is_openai_shaped(gw):
    for path in ("/api/chat", "/v1/chat/completions"):
        r = httpx.get(gw.url + path, timeout=10)
        assert r.status_code == 405 and "POST" in r.headers["Allow"].split(","), (path, r.headers)
    r = httpx.get(gw.url + "/v1", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path,body", [
    ("/api/pull", {"model": "demo"}), ("/api/generate", {"model": "demo", "prompt": "hi"}),
    ("/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]})])
def test_ollama_stream_must_be_a_boolean(gw, path, body):
    """``"stream": "x"`` is a 400 on every Ollama route that streams (``/api/pull`` answered
    200 and streamed; a fresh tester's find)."""
    r = httpx.post(gw.url + path, json={**body, "stream": "x"}, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": "stream must be a boolean"}


@pytest.mark.parametrize("path,field,value,msg", [
    ("/api/generate", "system", [], "system must be a string"),
    ("/api/generate", "suffix", {}, "suffix must be a string"),
    ("/api/generate", "template", 5, "template must be a string"),
    ("/api/generate", "raw", "", "raw must be a boolean"),
    ("/api/generate", "raw", {}, "raw must be a boolean"),
    ("/api/generate", "logprobs", "", "logprobs must be a boolean"),
    ("/api/chat", "logprobs", [], "logprobs must be a boolean"),
    ("/api/chat", "top_logprobs", "", "top_logprobs must be between 0 and 20"),
    ("/api/embed", "dimensions", "", "dimensions must be a non-negative integer"),
    ("/api/embed", "options", "x", "options must be an object"),
    ("/api/embed", "truncate", 1, "truncate must be a boolean"),
    ("/api/embeddings", "prompt", [], "prompt must be a string"),
    ("/api/embeddings", "options", [], "options must be an object"),
    ("/api/generate", "truncate", "", "truncate must be a boolean"),
    ("/api/chat", "shift", 5, "shift must be a boolean"),
    ("/api/chat", "tools", [5], "tools must be a list of tool objects")])
def test_ollama_fields_of_the_wrong_type_are_400(gw, path, field, value, msg):
    """``""``, ``[]`` and ``{}`` passed as unset values (a falsy default) and the field was
    ignored; Ollama's JSON decoding answers 400 (a fresh tester's find)."""
    model = "embed" if "embed" in path else "demo"
    body = {"model": model, "stream": False, "options": {"num_predict": 1}}
    body.update({"/api/embed": {"input": "x"}, "/api/embeddings": {"prompt": "x"},
                 "/api/chat": {"messages": [{"role": "user", "content": "x"}]}}.get(
                     path, {"prompt": "x"}))
    if "embed" in path:
        del body["options"]
    body[field] = value
    r = httpx.post(gw.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": msg}, r.text


@pytest.mark.parametrize("field,value", [("thinking", 5), ("tool_name", 5), ("tool_call_id", [])])
def test_ollama_message_fields_of_the_wrong_type_are_400(gw, field, value):
    """``thinking: 5`` passed; ``tool_name: 5`` got llama-server's "json.exception" text (a
    fresh tester's find)."""
    r = httpx.post(gw.url + "/api/chat", timeout=30, json={
        "model": "demo", "stream": False, "options": {"num_predict": 1},
        "messages": [{"role": "user", "content": "x", field: value}]})
    assert r.status_code == 400 and r.json() == {"error": f"messages[0].{field} must be a string"}


def test_ollama_option_past_64_bits_below_zero_is_400(gw):
    """-2**63 - 1 reaches the gateway as the float -2**63 and was accepted (a fresh tester's
    find; 2**64 was refused)."""
    r = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "x", "stream": False,
        "options": {"num_predict": 1, "seed": -2 ** 63 - 1}})
    assert r.status_code == 400
    assert r.json() == {"error": 'option "seed" is out of range for a 64-bit integer'}


def test_ollama_null_fields_are_unset(gw):
    """A client that writes unset fields as null gets the defaults (Ollama's pointer fields):
    ``truncate: null`` was a 400 ``truncate must be a boolean`` (a fresh tester's find)."""
    r = httpx.post(gw.url + "/api/embed", timeout=30, json={
        "model": "embed", "input": "x", "truncate": None, "dimensions": None, "options": None})
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 1, r.text
    r = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "x", "stream": False, "system": None, "suffix": None,
        "template": None, "raw": None, "logprobs": None, "top_logprobs": None,
        "options": {"num_predict": 1}})
    assert r.status_code == 200 and r.json()["done"], r.text


def test_a_go_template_and_a_negative_num_keep_are_400_in_ollamas_words(gw):
    """``template`` (an Ollama Go template, which the gateway cannot render) was dropped
    without a word and the model's own template used; ``num_keep`` below -1 got llama-server's
    400 naming its field ``n_keep``, which the client never sent (a fresh tester's finds). An
    empty or null ``template`` is what clients send by default and still runs."""
    base = {"model": "demo", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    r = httpx.post(gw.url + "/api/generate", json={**base, "template": "{{ .Prompt }}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("template is not supported by this gateway"), r.text
    for empty in ("", None):
        r = httpx.post(gw.url + "/api/generate", json={**base, "template": empty}, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(gw.url + "/api/generate", timeout=30,
                   json={**base, "options": {"num_predict": 2, "num_keep": -5}})
    assert r.status_code == 400
    assert r.json() == {"error": 'option "num_keep" must be -1 (the whole prompt) or more, got -5'}
    r = httpx.post(gw.url + "/api/generate", timeout=30,
                   json={**base, "options": {"num_predict": 2, "num_keep": -1}})
    assert r.status_code == 200, r.text
