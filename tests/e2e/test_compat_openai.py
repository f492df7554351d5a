"""OpenAI-compatible API with the real ``openai`` client (issue 3; field cases 5, 21, 22, 26)."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import openai
import pytest

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import TOOLS_TEMPLATE, embed_model, model, nearest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gw(module_gateway_factory, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    tpl.write_text(TOOLS_TEMPLATE)
    return module_gateway_factory(base_config(free_port(), models=[
        model("demo"), embed_model(), model("tooly", args=["--chat-template-file", str(tpl)])]))


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


MSG = [{"role": "user", "content": "hello"}]


def test_case26_include_usage_chat_and_completions(client):
    for create, kw in ((client.chat.completions.create, {"messages": MSG}),
                       (client.completions.create, {"prompt": "hello"})):
        with_usage = list(create(model="demo", max_tokens=6, stream=True,
                                 stream_options={"include_usage": True}, **kw))
        last = with_usage[-1]
        assert last.choices == [] and last.usage.completion_tokens == 6
        assert last.usage.total_tokens == last.usage.prompt_tokens + 6
        assert all(c.usage is None for c in with_usage[:-1])
        without = list(create(model="demo", max_tokens=6, stream=True, **kw))
        assert all(c.choices and c.usage is None for c in without)


def test_several_prompts_stream_with_the_openai_client(client):
    """A streamed ``/v1/completions`` with a list of prompts: llama-server starts it with a
    ``data: null`` event and sends a usage per prompt mid-stream; the openai client needs
    neither (it failed on the null with AttributeError). Every chunk has choices, and with
    ``include_usage`` one usage chunk comes last, the three prompts' usage summed (field case
    26; the sums in detail: test_openai_usage.py)."""
    for so in (None, {"include_usage": True}):
        kw = {"stream_options": so} if so else {}
        chunks = list(client.completions.create(model="demo", prompt=["a", "b", "c"],
                                                max_tokens=3, stream=True,
                                                extra_body={"ignore_eos": True}, **kw))
        body, last = (chunks[:-1], chunks[-1]) if so else (chunks, None)
        assert body and all(c.choices and c.usage is None for c in body)
        assert {c.choices[0].index for c in body} == {0, 1, 2}
        if so:
            assert last.choices == [] and last.usage.completion_tokens == 3 * 3


def test_case22_finish_reason(client):
    r = client.chat.completions.create(model="demo", max_tokens=5, messages=MSG)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.completions.create(model="demo", prompt="hi<|im_end|>", max_tokens=50)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 50
    r = client.completions.create(model="demo", prompt="hi", max_tokens=400, stop=["e", "a", " ", "o"])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 400


def test_response_format_and_tools(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(model="demo", max_tokens=200, messages=MSG, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model="tooly", max_tokens=3, messages=MSG, tools=tools)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # as Ollama's /v1 (through /api/chat): a template without tools is a 400, not ignored
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", max_tokens=3, messages=MSG, tools=tools)
    assert e.value.body["message"] == "demo:latest does not support tools"


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
OTHER = {"type": "function", "function": {"name": "get_weather", "description": "weather " * 30,
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}}}}}


def test_named_tool_choice_narrows_the_tools_and_requires_a_call(client):
    """The pinned llama-server reads ``tool_choice: {"type": "function", ...}`` as a wrong type
    and runs ``auto`` with every tool (a fresh tester's find: LangChain's
    ``with_structured_output(method="function_calling")`` sends it). The gateway sends only the
    named tool with ``"required"``: the rendered prompt holds that tool alone, as many tokens
    as when the client sends it so itself."""
    def prompt_tokens(**kw):
        return client.chat.completions.create(model="tooly", max_tokens=1, messages=MSG,
                                              **kw).usage.prompt_tokens
    named = prompt_tokens(tools=[OTHER, TOOL], tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    assert named == prompt_tokens(tools=[TOOL], tool_choice="required")
    assert named < prompt_tokens(tools=[OTHER, TOOL], tool_choice="required")
    for bad, msg in (({"type": "function", "function": {"name": "nope"}},
                      "tool_choice names function 'nope', which is not in tools"),
                     (1, 'tool_choice must be "none", "auto", "required" or {"type": '
                         '"function", "function": {"name": ...}}, got 1'),
                     ({}, "got {}")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tooly", max_tokens=1, messages=MSG,
                                           tools=[OTHER, TOOL], tool_choice=bad)
        assert msg in e.value.body["message"], e.value.body


def test_n_2_chat_that_renders_to_nothing_answers_at_once(gw):
    """A chat of only an empty assistant message renders to an empty prompt; with ``n`` 2
    llama-server never answered the second choice, so the request held 2 slots for
    ``inter_token_s`` (60 s) and ended 504 (a fresh tester's find). It now runs as a completion
    of the empty prompt repeated, answered at once as ``n`` 1 is, streamed or not, also with
    ``logprobs`` (which sent it to the worker non-streamed)."""
    body = {"model": "demo", "messages": [{"role": "assistant", "content": ""}], "n": 2,
            "max_tokens": 3}
    for extra in ({}, {"logprobs": True}):
        r = httpx.post(gw.url + "/v1/chat/completions", json={**body, **extra}, timeout=10)
        assert r.status_code == 200, r.text
        got = r.json()
        assert [(c["index"], c["message"]["content"], c["finish_reason"])
                for c in got["choices"]] == [(0, "", "length"), (1, "", "length")]
        assert got["object"] == "chat.completion"
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=10,
                          json={**body, **extra, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines), lines
        finishes = sorted((c["index"], c["finish_reason"]) for ln in lines[:-1]
                          for c in json.loads(ln[6:])["choices"] if c["finish_reason"])
        assert finishes == [(0, "length"), (1, "length")]
    busy = [w["busy"] for w in gw.workers() if w["model"] == "demo:latest"]
    assert busy == [0], gw.workers()


def test_v1_suffix_and_reasoning_effort_are_not_dropped(gw):
    """``suffix`` on /v1/completions and ``reasoning_effort`` on /v1 chat were ignored without
    a word on a model that has neither fill-in-the-middle nor thinking (a fresh tester's find);
    they are Ollama's 400s now, as its /v1 answers them."""
    for path, body, msg in (
            ("/v1/completions", {"prompt": "def f(", "suffix": "}"},
             "demo:latest does not support insert"),
            ("/v1/completions", {"prompt": "x", "suffix": 5}, "suffix must be a string, got 5"),
            ("/v1/chat/completions", {"messages": MSG, "reasoning_effort": "high"},
             '"demo" does not support thinking'),
            ("/v1/chat/completions", {"messages": MSG, "reasoning": {"effort": "minimal"}},
             '"demo" does not support thinking'),
            ("/v1/chat/completions", {"messages": MSG, "reasoning": "high"},
             'reasoning must be an object, got "high"'),
            ("/v1/chat/completions", {"messages": MSG, "reasoning": {"effort": "bogus"}},
             "reasoning.effort must be one of 'none', 'minimal', 'low', 'medium', 'high', "
             "'xhigh', 'ultra', 'max', got \"bogus\""),
            ("/v1/chat/completions", {"messages": MSG, "reasoning_effort": ["high"]},
             "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', "
             "'xhigh', 'ultra', 'max', got [\"high\"]"),
            ("/v1/chat/completions", {"messages": MSG, "reasoning_effort": "bogus"},
             "reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', "
             "'xhigh', 'ultra', 'max', got \"bogus\"")):
        r = httpx.post(gw.url + path, json={"model": "demo", "max_tokens": 1, **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg, r.text
    ok = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": MSG, "max_tokens": 1, "temperature": None, "top_p": 1,
        "cache_prompt": False})  # null is "not given"; an int is a number
    assert ok.status_code == 200, ok.text
    ok = httpx.post(gw.url + "/v1/completions", timeout=10, json={
        "model": "demo", "prompt": "x", "suffix": "", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    # "none" turns thinking off, which any model can do (Ollama's /v1 takes it as think:
    # false; it was refused with 400; a fresh tester's find)
    for extra in ({"reasoning_effort": "none"}, {"reasoning": {"effort": "none"}}):
        ok = httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
            "model": "demo", "messages": MSG, "max_tokens": 1, **extra})
        assert ok.status_code == 200, ok.text


def test_v1_completions_apply_a_response_format(gw):
    """llama-server's /v1/completions reads no ``response_format``: a valid one was checked
    and then dropped (a fresh tester's find). It becomes the completion's JSON schema."""
    for seed in range(4):
        r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
            "model": "demo", "prompt": "hi", "max_tokens": 30, "seed": seed,
            "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].lstrip().startswith("{"), r.json()


def test_v1_seed_past_64_bits_and_fields_of_the_wrong_type_are_400(gw):
    """llama-server replaced a seed past 64 bits with one fixed seed and read ``logprobs: 1``
    as true (a fresh tester's find)."""
    for path, body, msg in (
            ("/v1/completions", {"prompt": "hi", "seed": 2 ** 70},
             "seed is out of range for a 64-bit integer"),
            # orjson reads it as the float -2**63, which a range check let through
            ("/v1/completions", {"prompt": "hi", "seed": -2 ** 63 - 1},
             "seed is out of range for a 64-bit integer"),
            ("/v1/chat/completions", {"messages": MSG, "seed": 1.5}, "seed must be an integer, got 1.5"),
            ("/v1/chat/completions", {"messages": MSG, "logprobs": 1},
             "logprobs must be a boolean, got 1"),
            # llama-server refused these with its JSON library's text (a fresh tester's find)
            ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"},
             'temperature must be a number, got "hot"'),
            ("/v1/completions", {"prompt": "hi", "top_p": True}, "top_p must be a number, got true"),
            ("/v1/completions", {"prompt": "hi", "top_k": True}, "top_k must be an integer, got true"),
            ("/v1/completions", {"prompt": "hi", "cache_prompt": "no"},
             'cache_prompt must be a boolean, got "no"'),
            # llama-server truncated a fraction (top_k 1.5 ran as 1) and dropped these wrong
            # types without a word: grammar 5 generated unconstrained (this session's find)
            ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, "top_k must be an integer, got 1.5"),
            ("/v1/completions", {"prompt": "hi", "n_indent": "2"},
             'n_indent must be an integer, got "2"'),
            ("/v1/completions", {"prompt": "hi", "grammar": 5}, "grammar must be a string, got 5"),
            ("/v1/completions", {"prompt": "hi", "json_schema": "x"},
             'json_schema must be an object, got "x"'),
            ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": "x"},
             'chat_template_kwargs must be an object, got "x"'),
            ("/v1/completions", {"prompt": "hi", "samplers": 5},
             "samplers must be a list of strings or a string, got 5"),
            ("/v1/chat/completions", {"messages": MSG, "add_generation_prompt": "x"},
             'add_generation_prompt must be a boolean, got "x"'),
            ("/v1/completions", {"prompt": "hi", "id_slot": "x"}, 'id_slot must be an integer, got "x"'),
            ("/v1/completions", {"prompt": "hi", "n_indent": "x"}, 'n_indent must be an integer, got "x"'),
            ("/v1/chat/completions", {"messages": MSG, "reasoning_format": 5},
             "reasoning_format must be a string, got 5"),
            ("/v1/completions", {"prompt": "hi", "dry_sequence_breakers": "\\n"},
             'dry_sequence_breakers must be a list of strings, got "\\\\n"')):
        r = httpx.post(gw.url + path, json={"model": "demo", "max_tokens": 1, **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg, r.text
    # the right types still run; a whole float is the integer llama-server reads it as
    for body in ({"top_k": 40.0, "samplers": "kt", "grammar": 'root ::= "a"'},
                 {"top_k": None, "samplers": ["top_k", "temperature"], "json_schema": {}}):
        r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
            "model": "demo", "prompt": "hi", "max_tokens": 1, **body})
        assert r.status_code == 200, r.text


def test_v1_llama_server_fields_it_would_drop_are_400(gw):
    """llama-server answered 200 and ignored each of these without a word: a LoRA id the
    worker has no adapter for (the demo loads none), an unknown sampler name, a
    ``continue_final_message`` it reads as "no", and on the chat route a lazy grammar and its
    triggers (replaced by the template's own, so the grammar ran from the first token)."""
    lazy = {"grammar": 'root ::= "zz"', "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "<tool_call>"}]}
    for path, body, msg in (
            ("/v1/completions", {"prompt": "hi", "lora": [{"id": 0, "scale": 1.0}]},
             "lora[0].id 0: this model's workers have no LoRA adapters (its args load none: --lora)"),
            ("/v1/chat/completions", {"messages": MSG, "lora": [5]},
             "lora[0] must be an object with an integer id and a number scale, got 5"),
            ("/v1/completions", {"prompt": "hi", "samplers": ["top_k", "bogus"]},
             'samplers: unknown sampler "bogus" (known: dry, top_k, top_p, top_n_sigma, typ_p, '
             'min_p, temperature, xtc, infill, penalties, adaptive_p)'),
            ("/v1/chat/completions", {"messages": MSG, "continue_final_message": 5},
             'continue_final_message must be a boolean, "content" or "reasoning_content", got 5'),
            ("/v1/chat/completions", {"messages": MSG, **lazy},
             "grammar_lazy is not applied on /v1/chat/completions (llama-server replaces it "
             "with the chat template's own); send a lazy grammar to /v1/completions"),
            # llama-server's own answer was its JSON library's text
            ("/v1/completions", {"prompt": "hi", "grammar_triggers": ["<tool_call>"]},
             'grammar_triggers[0] must be an object with a type 0-3 (token, word, pattern, full '
             'pattern), a string value and, for type 0, an integer token; got "<tool_call>"')):
        r = httpx.post(gw.url + path, json={"model": "demo", "max_tokens": 2, **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    # what llama-server does apply still runs: the lazy grammar on the completion route,
    # known sampler aliases, an empty LoRA list
    for body in (lazy, {"samplers": ["Top-K", "temp"], "lora": []},
                 {"samplers": "kt", "continue_final_message": False}):
        r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
            "model": "demo", "prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_logit_bias_that_bans_every_token_of_the_grammar_is_400(gw):
    """llama-server answered 500 ``got exception: Unexpected empty grammar stack …`` (or sent
    that error event in a 200 stream) when ``logit_bias`` banned every token the grammar
    allowed: the request's fault, a 400 that says why; the worker keeps serving."""
    body = {"model": "demo", "prompt": "hi", "max_tokens": 3, "grammar": 'root ::= "a"',
            "logit_bias": {"a": False}}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("the request's grammar or schema allows no token that "
                                     "sampling kept here (it admits nothing at this point, or "
                                     "a logit_bias bans every token it allows); llama-server: ")
    assert "Unexpected empty grammar stack" in err["message"]
    with httpx.stream("POST", gw.url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error", events
    ok = httpx.post(gw.url + "/v1/completions", timeout=30, json={**body, "logit_bias": {}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "a"


def test_v1_completions_logprobs_in_openais_legacy_shape(gw, client):
    """``/v1/completions`` ``logprobs: N`` comes as OpenAI's ``tokens`` / ``token_logprobs`` /
    ``top_logprobs`` / ``text_offset`` (llama-server sends its chat-style ``content`` list, which
    the ``openai`` client reads as all-None fields), with ``cmpl-`` ids, streamed or not."""
    r = client.completions.create(model="demo", prompt="Once upon", max_tokens=6, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert r.id.startswith("cmpl-") and len(lp.tokens) == 6 == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(x <= 0 for x in lp.token_logprobs)
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top[tok] == logprob  # the 2 likeliest + the sampled one
    # streamed, 2 choices: each choice's offsets run on from its own previous tokens
    seen: dict[int, list] = {0: [], 1: []}
    for ch in client.completions.create(model="demo", prompt="Once upon", max_tokens=5,
                                        logprobs=0, n=2, temperature=0.9, seed=5, stream=True):
        assert ch.id.startswith("cmpl-")
        for c in ch.choices:
            if c.logprobs is not None:
                assert [len(t) for t in c.logprobs.top_logprobs] == [1] * len(c.logprobs.tokens)
                seen[c.index].append((c.logprobs.text_offset[0], c.logprobs.tokens[0], c.text))
    for idx, steps in seen.items():
        assert 1 <= len(steps) <= 5, steps  # an end-of-text token may come first
        assert [o for o, _, _ in steps] == [sum(len(t) for _, t, _ in steps[:i])
                                            for i in range(len(steps))]
    for bad in (True, -1, 21, 1.5, "2"):
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "model": "demo", "prompt": "hi", "max_tokens": 1, "logprobs": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("logprobs must be an integer between 0 and 20")
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.completions.create(model="demo", prompt="hi", max_tokens=1, echo=True)


def test_every_streamed_chat_choice_starts_with_the_assistant_role(gw):
    """llama-server sends a choice's role only with its first token's event, and a first token
    that ends inside a UTF-8 character sends none: seeds 3 and 4 of this short prompt started
    without the role (3 of 40 seeds in a fresh tester's run, every choice with n=2). Each
    choice's first chunk now has ``role: "assistant"``."""
    lacking = []
    for seed in range(12):
        for n in (1, 2):
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
                "model": "demo", "messages": [{"role": "user", "content": "x"}], "n": n,
                "max_tokens": 3, "stream": True, "seed": seed})
            first: dict[int, dict] = {}
            for ln in r.text.splitlines():
                if ln.startswith("data: {"):
                    for c in json.loads(ln[6:]).get("choices") or ():
                        first.setdefault(c["index"], c["delta"])
            assert sorted(first) == list(range(n)), r.text
            lacking += [(seed, n, i) for i, d in first.items() if d.get("role") != "assistant"]
    assert lacking == [], lacking


def test_v1_samples_as_ollamas_v1_when_fields_are_left_out(gw, client):
    """Ollama's /v1 fills in temperature and top_p 1.0 (OpenAI's defaults) and its own
    DefaultOptions (min_p 0, top_k 40, …); llama-server's /v1 used its own (temperature 0.8,
    top_p 0.95, min_p 0.05), so a request sampled differently behind this gateway (a fresh
    tester's find). The worker's /slots shows what the last task ran with; a field the client
    sets is kept."""
    (w,) = [x for x in gw.workers() if x["id"].startswith("demo-")]
    for create, kw in ((client.chat.completions.create, {"messages": MSG}),
                       (client.completions.create, {"prompt": "hello"})):
        for given, want in (({}, {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "top_k": 40}),
                            ({"temperature": 0.3, "top_p": 0.5},
                             {"temperature": 0.3, "top_p": 0.5, "min_p": 0.0})):
            create(model="demo", max_tokens=2, **kw, **given)
            last = max((s for s in gw.slots(w) if s.get("id_task") is not None),
                       key=lambda s: s["id_task"])
            got = {k: round(last["params"][k], 6) for k in want}
            assert got == want, (kw, given, got)


def test_v1_answers_name_the_model_as_the_client_did(client):
    """Ollama's /v1 (and this gateway's /v1/embeddings) answer with the model name the client
    sent; chat and completions named the canonical ``demo:latest`` for ``demo`` (a fresh
    tester's find), streamed or not, structured output included."""
    for name in ("demo", "demo:latest", "DEMO"):
        chat = client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        cmpl = client.completions.create(model=name, prompt="hi", max_tokens=2)
        fmt = client.chat.completions.create(model=name, messages=MSG, max_tokens=5,
                                             response_format={"type": "json_object"})
        streamed = [c.model for c in client.chat.completions.create(
            model=name, messages=MSG, max_tokens=2, stream=True)]
        streamed += [c.model for c in client.completions.create(
            model=name, prompt="hi", max_tokens=2, stream=True)]
        assert {chat.model, cmpl.model, fmt.model, *streamed} == {name}, (name, streamed)


def test_structured_output_runs_as_a_completion_and_never_answers_500(client):
    """``response_format`` on /v1 chat: the chat template, then /v1/completions under the
    schema's grammar, its events turned into chat chunks. llama-server's own chat route
    answered 500 "does not match the expected peg-native format" for 10 of these 16 seeds
    (its parser refuses some answers its grammar allowed; a fresh tester's find)."""
    for seed in range(16):
        r = client.chat.completions.create(model="demo", max_tokens=200, seed=seed, messages=MSG,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        assert r.object == "chat.completion" and c.message.role == "assistant", r
        assert c.finish_reason in ("stop", "length") and c.message.content.lstrip()[0] == "{"
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        assert r.usage.completion_tokens >= 1 and r.id.startswith("chatcmpl-")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    kw = dict(model="demo", max_tokens=40, seed=5, messages=MSG, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content and text.lstrip().startswith("{"), text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        full.choices[0].finish_reason
    # the chat template reached the worker: as many prompt tokens as the chat route counts
    plain = client.chat.completions.create(model="demo", max_tokens=1, messages=MSG)
    assert full.usage.prompt_tokens == plain.usage.prompt_tokens
    two = client.chat.completions.create(**{**kw, "n": 2})
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content.lstrip().startswith("{") for c in two.choices)
    # tools go into the rendered prompt (the chat route's grammar cannot call them either)
    tkw = dict(model="tooly", max_tokens=40, seed=5, messages=MSG, tools=[OTHER, TOOL])
    both = client.chat.completions.create(**tkw, response_format={"type": "json_object"})
    assert both.choices[0].message.content.lstrip().startswith("{")
    assert both.usage.prompt_tokens == client.chat.completions.create(**{
        **tkw, "max_tokens": 1}).usage.prompt_tokens


def test_structured_output_with_logprobs_keeps_the_answer(client):
    """``logprobs`` with a JSON ``response_format`` stayed on llama-server's chat route, whose
    stream under the format's grammar dropped the text: ``content: ""`` with one logprob entry
    for 5 tokens, on seeds 100, 102, 106 and 107 (a fresh tester's find). It runs as a
    completion now, logprobs included, streamed and not."""
    for seed in range(100, 108):
        kw = dict(model="demo", max_tokens=5, seed=seed, messages=MSG, logprobs=True,
                  top_logprobs=2, response_format={"type": "json_object"})
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.message.content.lstrip().startswith("{"), (seed, c.message.content)
        entries = c.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 for e in entries), (seed, c.logprobs)
        # each entry is a token of the answer: their bytes are the answer's bytes
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == \
            c.message.content, (seed, entries)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
        assert text == c.message.content and [e.token for e in streamed] == \
            [e.token for e in entries], seed


def test_a_prefill_outside_the_response_format_is_a_400_that_says_so(gw):
    """A chat whose last assistant message does not start what its JSON ``response_format``
    allows got llama-server's 400 "Failed to initialize samplers: std::exception" (a fresh
    tester's find); one that does is continued."""
    def chat(prefill, stream=False):
        return httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "max_tokens": 6, "seed": 1, "stream": stream,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": prefill}],
            "response_format": {"type": "json_object"}})
    for stream in (False, True):
        r = chat("Sure", stream)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith("the last assistant message is continued (a prefill) "
                                         "under the response_format's grammar"), err
    r = chat('{"v": "')
    assert r.status_code == 200 and \
        r.json()["choices"][0]["message"]["content"].startswith('{"v": "'), r.text


def test_two_constraints_of_the_whole_answer_are_400(gw):
    """llama-server answered 500 "Cannot use both json_schema and grammar" on the chat route,
    kept the grammar on /v1/completions without a word, and under a JSON response_format plus
    a grammar sent only "{" (a fresh tester's finds)."""
    grammar = 'root ::= [a-z]{3}'
    for path, body, says in (
            ("/v1/chat/completions", {"messages": MSG, "json_schema": {"type": "string"},
                                      "grammar": grammar}, "json_schema and grammar"),
            ("/v1/chat/completions", {"messages": MSG, "grammar": grammar,
                                      "response_format": {"type": "json_object"}},
             "response_format and grammar"),
            ("/v1/completions", {"prompt": "hi", "json_schema": {}, "grammar": grammar},
             "json_schema and grammar")):
        for stream in (False, True):
            r = httpx.post(gw.url + path, timeout=60, json={
                "model": "demo", "max_tokens": 4, "stream": stream, **body})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["message"] == f"{says} cannot be used together: each " \
                "constrains the whole answer; send one"
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "max_tokens": 4, "messages": MSG, "grammar": grammar,
        "response_format": {"type": "text"}})  # text is no constraint
    assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 3


def test_continue_final_message_alone_continues(gw):
    """``continue_final_message: true`` without ``add_generation_prompt: false`` got
    llama-server's 400 "Cannot set both add_generation_prompt and continue_final_message to
    true", a pair the client had not sent (a fresh tester's find)."""
    for v in (True, "content"):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "max_tokens": 3, "seed": 1, "continue_final_message": v,
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "Sure"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "max_tokens": 3, "continue_final_message": True,
        "add_generation_prompt": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "Cannot set both" in r.json()["error"]["message"]


def test_logprobs_with_top_logprobs_0_give_each_tokens_logprob_without_alternatives(client):
    """OpenAI answers ``logprobs: true, top_logprobs: 0`` (or none) with each token's logprob
    and ``top_logprobs: []``; llama-server (its ``n_probs`` 0) sent no logprobs at all for 0
    and 20 alternatives for none, on the chat route and under a ``response_format`` alike
    (fresh testers' finds)."""
    for extra in ({}, {"response_format": {"type": "json_object"}}):
        none = client.chat.completions.create(model="demo", max_tokens=4, seed=3, messages=MSG,
                                              logprobs=True, **extra)
        assert [e.top_logprobs for e in none.choices[0].logprobs.content] == \
            [[]] * len(none.choices[0].logprobs.content) != [], extra
        kw = dict(model="demo", max_tokens=4, seed=3, messages=MSG, logprobs=True,
                  top_logprobs=0, **extra)
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
        assert entries and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries), extra
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
        assert [(e.token, e.top_logprobs) for e in streamed] == \
            [(e.token, []) for e in entries], extra
        one = client.chat.completions.create(**{**kw, "top_logprobs": 1})
        assert [e.logprob for e in one.choices[0].logprobs.content] == \
            [e.logprob for e in entries]  # the same tokens, with one alternative each
        assert all(len(e.top_logprobs) == 1 for e in one.choices[0].logprobs.content)


def test_a_continued_message_streams_one_role_chunk_and_its_echo_whatever_the_prompt_size(gw):
    """With the prompt-progress events the gateway asks for on prompts of 64 tokens or more,
    llama-server sent the role chunk twice and put the echo of a continued last assistant
    message in a progress event, which the gateway dropped: a long prompt's stream had two
    role chunks and no echo, a short one's one and the echo (a fresh tester's find)."""
    prefill = "The weather is"
    streams = []
    for user in ("w?", "tell me about the weather in paris please " * 12):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=60, json={
                "model": "tooly", "max_tokens": 2, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": prefill}]}) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert sum("role" in d for d in deltas) == 1 and "role" in deltas[0], deltas
        text = "".join(d.get("content") or "" for d in deltas)
        assert text.startswith(prefill), (user[:10], text)
        streams.append(text)
    assert len(streams) == 2


def test_models_list_and_retrieve(client):
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == ["demo:latest", "embed:latest", "tooly:latest"]
    m = client.models.retrieve("demo")  # the id as asked, as Ollama's /v1/models/{id}
    assert m.id == "demo" and m.object == "model" and m.created > 0
    assert client.models.retrieve("demo:latest").id == "demo:latest"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found" and e.value.body["type"] == "invalid_request_error"


def test_embeddings_indexes(client):
    r = client.embeddings.create(model="embed", input=["one", "two two", "three three three"])
    assert [d.index for d in r.data] == [0, 1, 2]
    assert len({tuple(d.embedding) for d in r.data}) == 3 and len(r.data[0].embedding) == 64
    refs = {t: client.embeddings.create(model="embed", input=t).data[0].embedding
            for t in ("one", "two two", "three three three")}
    assert [nearest(d.embedding, refs) for d in r.data] == ["one", "two two", "three three three"]
    b64 = client.embeddings.create(model="embed", input="one", encoding_format="base64")
    floats = struct.unpack("<64f", base64.b64decode(b64.data[0].embedding))  # little-endian float32
    assert floats == pytest.approx(refs["one"], abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="demo", input="x")
    assert "does not support embedding" in e.value.body["message"]


def test_case5_and_21_errors_are_openai_objects(gw, client):
    long = "word " * 1500
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": long}])
    assert "context" in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as streamed:
        list(client.chat.completions.create(model="demo", stream=True,
                                            messages=[{"role": "user", "content": long}]))
    # streamed too: the OpenAI error object, the same one (field case 5)
    assert streamed.value.body == e.value.body and set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSG)
    assert e.value.body == {  # OpenAI's answer for a model that does not exist
        "message": "The model `nope` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": None, "code": "model_not_found"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[])
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, gw.url + path)
        assert r.status_code == status and r.headers["content-type"].startswith("application/json")
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_n_must_be_a_positive_integer(gw):
    """``n`` as OpenAI takes it: an integer >= 1; true, 0, 2.5 and "2" are 400 in OpenAI's shape
    before anything is forwarded (``true`` was taken as 1; found by a tester)."""
    for n in (True, 0, 2.5, "2"):
        for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "hi"})):
            r = httpx.post(gw.url + path, json={"model": "demo", "max_tokens": 2, "n": n, **body},
                           timeout=30)
            assert r.status_code == 400 and "n must be an integer" in r.json()["error"]["message"], \
                (n, path, r.text)
    r = httpx.post(gw.url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2,
                                                     "n": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_model_of_the_wrong_type_is_named_as_such(gw):
    """``model`` that is not a string: 400 "model must be a string" on every ``/v1`` inference
    route, as on ``/api`` (it said "model is required", a tester's find); missing or "" still
    says "model is required"."""
    for path, body in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/embeddings", {"input": "hi"})):
        for model, text in ((5, "model must be a string"), (["demo"], "model must be a string"),
                            (None, "model is required"), ("", "model is required")):
            r = httpx.post(gw.url + path, json={"model": model, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["message"] == text, (path, model, r.text)


LONG_PROMPT = "tell me a story " * 40  # about 160 tokens: past upstream.PROGRESS_MIN_PROMPT_TOKENS


def test_prompt_progress_the_gateway_asks_for_never_reaches_a_client(gw, client):
    """Prompts of 64 estimated tokens or more go up with ``return_progress`` (field case 7:
    it makes llama-server notice a client that left during the prefill); those progress
    events carry no content and never reach a client, on ``/v1`` streamed or not and on
    ``/api``. A client that asks for them itself gets them."""
    chat = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}))
    assert all("prompt_progress" not in (c.model_extra or {}) for c in chat)
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].usage.completion_tokens == 4 and chat[-1].usage.prompt_tokens > 64
    done = client.completions.create(model="demo", prompt=LONG_PROMPT, max_tokens=4)
    assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"
    assert "prompt_progress" not in (done.model_extra or {})
    with httpx.stream("POST", gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": LONG_PROMPT, "raw": True,
            "options": {"num_predict": 4}}) as r:
        lines = [json.loads(ln) for ln in r.iter_lines() if ln]
    assert all("prompt_progress" not in ln for ln in lines)
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4
    asked = []
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": LONG_PROMPT, "max_tokens": 4, "stream": True,
            "return_progress": True}) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                asked.append(json.loads(ln[6:]))
    progress = [e for e in asked if "prompt_progress" in e]
    assert progress and progress[-1]["prompt_progress"]["processed"] > 64
