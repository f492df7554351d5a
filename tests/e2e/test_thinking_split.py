"""Reasoning split from the answer on real workers, as Ollama splits it: ``/api/generate``
(llama-server's ``/completion`` returns the text as generated) and ``/api/chat`` on a template
llama-server does not take for a reasoning one (its ``reasoning_content`` stays empty) answer
``thinking`` apart from ``response`` / ``message.content`` by the tags the template names.

The demo model is random, so a default ``--grammar`` in the model's ``args`` makes it write a
reasoning block: ``<think>`` … ``</think>`` then an answer (llama-server applies it to every
request that brings no grammar of its own)."""

import json

import httpx
import pytest

from tests.conftest import base_config, free_port

pytestmark = pytest.mark.slow

# ChatML that strips earlier reasoning from assistant turns: names both tags, renders the
# same prompt whatever ``think`` is, so think on and off generate the same text for a seed
STRIPS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
          "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML that writes an empty block when thinking is off: llama-server does not take it for a
# reasoning template, so its /v1/chat/completions leaves the tags in ``content``
PLAIN = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
         "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{ '<|im_start|>assistant\\n' }}"
         "{% if enable_thinking is defined and enable_thinking is false %}"
         "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
# the same, opening the reasoning in the generation prompt: llama-server does not take it for
# a reasoning template either, and /api/chat does not see the rendered prompt
PLAIN_OPENS = PLAIN.replace("{{ '<|im_start|>assistant\\n' }}",
                            "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is not "
                            "defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}")
# DeepSeek-R1 style: the generation prompt opens the reasoning itself
OPENS = STRIPS.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
BLOCK = 'root ::= "<think>" [a-z] [a-z ]{4,16} "</think>" [a-z] [a-z ]{4,16}'
OPENED = 'root ::= [a-z] [a-z ]{4,16} "</think>" [a-z] [a-z ]{4,16}'


@pytest.fixture(scope="module")
def gw(module_gateway_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("tpl")
    (d / "strips.jinja").write_text(STRIPS)
    (d / "opens.jinja").write_text(OPENS)
    (d / "plain.jinja").write_text(PLAIN)
    (d / "plain_opens.jinja").write_text(PLAIN_OPENS)

    def model(name, tpl, grammar):
        return {"name": name, "path": "builtin:demo", "slots": 1, "context": 1024, "cpu": 1,
                "args": ["--chat-template-file", str(d / tpl), "--grammar", grammar]}
    return module_gateway_factory(base_config(free_port(), models=[
        model("strips", "strips.jinja", BLOCK), model("opens", "opens.jinja", OPENED),
        model("plain", "plain.jinja", BLOCK),
        model("plain_opens", "plain_opens.jinja", OPENED)]))


def call(gw, path, body, stream):
    """(thinking, answer, last object) of one Ollama call, the stream's pieces joined."""
    body = {"options": {"num_predict": 48, "seed": 7, "temperature": 0.8}, **body,
            "stream": stream}
    key = "message" if path == "/api/chat" else None
    with httpx.stream("POST", gw.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        objs = [json.loads(line) for line in r.iter_lines() if line]
    assert all("error" not in o for o in objs), objs
    pick = (lambda o: o.get(key) or {}) if key else (lambda o: o)
    thinking = "".join(pick(o).get("thinking", "") for o in objs)
    answer = "".join(pick(o).get("content" if key else "response", "") for o in objs)
    return thinking, answer, objs[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_answers_thinking_apart(gw, stream):
    ask = {"model": "strips", "prompt": "hi"}
    on_t, on_a, on = call(gw, "/api/generate", {**ask, "think": True}, stream)
    off_t, off_a, off = call(gw, "/api/generate", {**ask, "think": False}, stream)
    left_t, left_a, _ = call(gw, "/api/generate", ask, stream)
    # think off: the text as generated, tags and all, as Ollama (no parser without think)
    assert off_t == "" and off_a.startswith("<think>") and "</think>" in off_a, off_a
    # think on: the same text, split at the tags
    assert on_t and on_a and "<think>" not in on_t + on_a and "</think>" not in on_t + on_a
    assert off_a == f"<think>{on_t}</think>{on_a}", (off_a, on_t, on_a)
    # left out: on (the template names its tags)
    assert (left_t, left_a) == (on_t, on_a)
    # ``context`` holds the answer as generated, reasoning included: the same tokens
    assert on["context"] == off["context"] and len(on["context"]) > on["prompt_eval_count"]
    assert on["done"] is True and on["eval_count"] == off["eval_count"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_thinking_apart(gw, stream):
    """On a template llama-server leaves unsplit (the tags come back in its ``content``,
    test below) the gateway splits them, think given or left out."""
    ask = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"think": True}, {}):
        thinking, answer, last = call(gw, "/api/chat", {**ask, **extra}, stream)
        assert thinking and answer, (thinking, answer)
        assert "<think>" not in thinking + answer and "</think>" not in thinking + answer
        assert set(thinking + answer) <= set("abcdefghijklmnopqrstuvwxyz "), (thinking, answer)
        assert last["done"] is True
    # think off: no parser, the text as generated (after the template's own empty block)
    thinking, answer, _ = call(gw, "/api/chat", {**ask, "think": False}, stream)
    assert thinking == "" and answer.startswith("<think>") and "</think>" in answer, answer


@pytest.mark.parametrize("stream", [False, True])
def test_chat_on_a_template_that_opens_the_reasoning_unrecognised(gw, stream):
    """/api/chat does not see its rendered prompt; the gateway learns from a rendered sample
    that the template ends its generation prompt with ``<think>``, so the worker's content
    (reasoning, ``</think>``, answer: llama-server does not take this template for a
    reasoning one) is split as Ollama splits it (a fresh tester's find: all of it landed in
    ``content``)."""
    assert "<think>" in PLAIN_OPENS
    ask = {"model": "plain_opens", "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"think": True}, {}):
        thinking, answer, _ = call(gw, "/api/chat", {**ask, **extra}, stream)
        assert thinking.strip() and answer, (thinking, answer)
        assert "</think>" not in thinking + answer, (thinking, answer)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_a_prompt_that_opens_the_reasoning(gw, path):
    """The generation prompt ends with ``<think>``: the model writes only the rest of the
    block. ``/api/generate`` knows its rendered prompt and splits it (Ollama feeds the tag to
    its parser); on ``/api/chat`` llama-server takes this template for a reasoning one and
    splits it itself (``reasoning_content``)."""
    ask = ({"prompt": "hi"} if path == "/api/generate"
           else {"messages": [{"role": "user", "content": "hi"}]})
    thinking, answer, _ = call(gw, path, {"model": "opens", "think": True, **ask}, False)
    assert thinking.strip() and answer, (thinking, answer)
    assert "</think>" not in thinking + answer, (thinking, answer)


def test_openai_route_is_left_as_the_worker_answers(gw):
    """``/v1/chat/completions`` passes llama-server's answer through (its own
    ``reasoning_content`` parsing), as before."""
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["content"].startswith("<think>") and not msg.get("reasoning_content"), msg
