"""Real clients against a real gateway on real llama-server workers (issue 2)."""

import json
import subprocess

import httpx
import ollama
import openai
import pytest

pytestmark = pytest.mark.slow


def test_ollama_client_chat_streams_to_done(gateway):
    client = ollama.Client(host=gateway.url)
    parts = list(client.chat(model="demo", messages=[{"role": "user", "content": "hi"}],
                             stream=True, options={"num_predict": 12}))
    assert len(parts) >= 2
    assert all(p.message.role == "assistant" for p in parts)
    assert parts[-1].done is True
    assert parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 12
    assert all(p.done is False for p in parts[:-1])
    assert "".join(p.message.content for p in parts)


def test_ollama_client_generate_non_stream(gateway):
    client = ollama.Client(host=gateway.url)
    r = client.generate(model="demo", prompt="once upon a time", options={"num_predict": 5})
    assert r.done is True and r.done_reason == "length"
    assert r.eval_count == 5 and r.response
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0


def test_openai_chat_stream_and_not(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused")
    r = client.chat.completions.create(model="demo", max_tokens=8,
                                       messages=[{"role": "user", "content": "hello"}])
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model="demo", max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "hello"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_curl_tags_lists_model(gateway):
    out = subprocess.run(["curl", "-sS", "-f", gateway.url + "/api/tags"], capture_output=True,
                         check=True, text=True).stdout
    tags = json.loads(out)
    names = [m["name"] for m in tags["models"]]
    assert names == ["demo:latest"]
    m = tags["models"][0]
    assert m["size"] > 0 and isinstance(m["digest"], str) and len(m["digest"]) == 64
    assert m["details"]["format"] == "gguf" and m["details"]["family"] == "llama"


def test_root_version_and_unknown_model(gateway):
    r = httpx.get(gateway.url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(gateway.url + "/").status_code == 200
    assert "version" in httpx.get(gateway.url + "/api/version").json()
    r = httpx.post(gateway.url + "/api/chat", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_client_closing_a_stream_is_a_cancel_not_an_error(gateway):
    """A client that reads one line and hangs up: one ``request.done`` with status 499 and
    ``client_left`` per request, counted in ``/metrics`` under status 499, never an internal
    error, and the gateway keeps serving (its slot was released)."""
    body = {"model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 1500}}
    generated_before = _generated(gateway.url)
    for _ in range(3):
        with httpx.Client(timeout=30) as c, c.stream("POST", gateway.url + "/api/generate",
                                                     json=body) as s:
            lines = s.iter_lines()
            assert json.loads(next(lines))["done"] is False
    r = httpx.post(gateway.url + "/api/generate", json={**body, "stream": False,
                                                        "options": {"num_predict": 4}}, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 4
    log = gateway.log_path.read_text()
    assert "request.failed" not in log and "request.cancelled" not in log
    done = [json.loads(ln) for ln in log.splitlines() if '"request.done"' in ln]
    left = [d for d in done if d.get("client_left")]
    assert len(left) == 3 and all(d["status"] == 499 and d["path"] == "/api/generate"
                                  for d in left), left
    metrics = httpx.get(gateway.url + "/metrics", timeout=5).text
    assert 'llama_gateway_requests_total{endpoint="/api/generate",model="demo:latest",' \
           'status="499"} 3.0' in metrics, [m for m in metrics.splitlines() if "requests_total" in m]
    assert all(w["busy"] == 0 for w in gateway.workers())
    # the tokens the cut streams had generated are counted (they were not at all: a fresh
    # tester's find), as the events read from the worker; the finished one by its eval_count
    assert all(d["events_streamed"] >= 1 for d in left), left
    assert _generated(gateway.url) - generated_before == 4 + sum(d["events_streamed"] for d in left)


def _generated(url: str) -> float:
    """``llama_gateway_generated_tokens_total`` of demo:latest (0 before any)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('llama_gateway_generated_tokens_total{model="demo:latest"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
