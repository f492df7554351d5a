"""Thinking on a model with the ``thinking`` capability, as Ollama does it: ``think`` left out
on ``/api/chat`` is forced to true (routes.go; shared/reference/ollama-api.md), and Ollama's ``/v1`` maps a
``reasoning_effort`` above ``none`` to thinking on. The template here (ChatML) writes an empty
``<think></think>`` block when ``enable_thinking`` is false, so the prompt's token count says
which way it was rendered. llama-server does not take it for a reasoning template and left
thinking off by default: unset ``think`` and ``reasoning_effort: "high"`` rendered as "off"
(a fresh tester's find)."""

import httpx
import pytest

from tests.conftest import base_config, free_port

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


def test_thinking_is_on_unless_turned_off(tmp_path, gateway_factory):
    tpl = tmp_path / "think.jinja"
    tpl.write_text(TEMPLATE)
    gw = gateway_factory(base_config(free_port(), models=[
        {"name": "tt", "path": "builtin:demo", "slots": 1, "context": 1024, "cpu": 1,
         "args": ["--chat-template-file", str(tpl)]}]))
    caps = httpx.post(gw.url + "/api/show", json={"model": "tt"}, timeout=30).json()
    assert "thinking" in caps["capabilities"], caps["capabilities"]
    msgs = [{"role": "user", "content": "hi"}]

    def api(path, **extra):
        body = {"model": "tt", "stream": False, "options": {"num_predict": 1}, **extra}
        body.update({"messages": msgs} if path == "/api/chat" else {"prompt": "hi"})
        r = httpx.post(gw.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["prompt_eval_count"]

    def v1(**extra):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "tt", "messages": msgs, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    on, off = api("/api/chat", think=True), api("/api/chat", think=False)
    assert off > on, (on, off)  # the empty think block of "off"
    assert api("/api/chat") == on  # left out: forced on
    assert api("/api/chat", think="high") == on
    # /api/generate splits its answer by the template's tags (test_thinking_split.py), so
    # think left out is on there too, as in Ollama's GenerateHandler
    g_on, g_off = api("/api/generate", think=True), api("/api/generate", think=False)
    assert g_off > g_on and api("/api/generate") == g_on
    assert v1() == on
    for effort in ("minimal", "low", "medium", "high"):
        assert v1(reasoning_effort=effort) == on, effort
    assert v1(reasoning={"effort": "high"}) == on
    assert v1(reasoning_effort="none") == off
    # the client's own chat_template_kwargs win
    assert v1(chat_template_kwargs={"enable_thinking": False}) == off
    # a format's grammar would cover the reasoning: not forced under one, as before
    r = httpx.post(gw.url + "/api/chat", timeout=60, json={
        "model": "tt", "messages": msgs, "stream": False, "format": "json",
        "options": {"num_predict": 1}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == off, r.text
