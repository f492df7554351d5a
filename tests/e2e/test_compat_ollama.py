"""Ollama API conformance with the real ``ollama`` client and LangChain's ChatOllama, against a
real gateway on real llama-server workers (issue 3; field cases 5, 22, 23, 24)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import httpx
import ollama
import pytest
from langchain_ollama import ChatOllama

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import TOOLS_TEMPLATE, model, worker_metrics

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def gw(module_gateway_factory, tmp_path_factory):
    tpl = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    tpl.write_text(TOOLS_TEMPLATE)
    cfg = base_config(free_port(), models=[
        model("demo", aliases=["Friendly"]),
        model("tooly", args=["--chat-template-file", str(tpl)])])
    return module_gateway_factory(cfg)


@pytest.fixture
def client(gw):
    return ollama.Client(host=gw.url)


def test_generate_stream_and_not_with_context_round_trip(client):
    r = client.generate(model="demo", prompt="once upon a time", options={"num_predict": 6})
    assert r.done and r.done_reason == "length" and r.eval_count == 6 and r.response
    # context = tokens of (rendered prompt + response text), re-tokenized as Ollama does.
    assert isinstance(r.context, list) and len(r.context) >= r.prompt_eval_count
    parts = list(client.generate(model="demo", prompt="go on", context=r.context, stream=True,
                                 options={"num_predict": 4}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    # The old context (prompt + answer) was detokenized and put in front of the new prompt.
    assert parts[-1].prompt_eval_count > r.prompt_eval_count + r.eval_count
    assert parts[-1].context[:len(r.context)] == r.context


def test_line_separators_in_an_answer_do_not_break_the_ollama_client(gw, client):
    """The ``ollama`` client reads NDJSON with httpx's ``iter_lines``, which also ends a line at
    U+2028, U+2029 and U+0085: written raw, one cut the JSON line and the client raised
    ``JSONDecodeError`` mid-stream (a fresh tester's find). They are sent as escapes."""
    for ch in ("\u2028", "\u2029", "\x85"):
        fmt = {"const": f"a{ch}b"}  # the grammar forces the character into the answer
        text = "".join(c.response for c in client.generate(
            model="demo", prompt="hi", format=fmt, stream=True, options={"num_predict": 20}))
        assert json.loads(text) == f"a{ch}b"
        text = "".join(c.message.content for c in client.chat(
            model="demo", messages=[{"role": "user", "content": "hi"}], format=fmt, stream=True,
            options={"num_predict": 20}))
        assert json.loads(text) == f"a{ch}b"
    raw = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "hi", "format": {"const": "a\u2028b"},
        "options": {"num_predict": 20}}).content
    assert b"\xe2\x80\xa8" not in raw and b"\\u2028" in raw
    assert all(json.loads(line) for line in raw.decode().splitlines())


def test_num_predict_0_is_no_limit_on_both_apis(gw, client):
    """num_predict 0 (and ``max_tokens: 0`` on ``/v1``, which Ollama's ``/v1`` sends as it)
    made the worker stop after 1 token; Ollama's runners take 0 as no limit. A grammar ends
    the answer: the whole constant comes back."""
    r = client.generate(model="demo", prompt="hi", format={"const": "abcdef"},
                        options={"num_predict": 0})
    assert (r.response, r.done_reason) == ('"abcdef"', "stop") and r.eval_count > 1
    r = client.chat(model="demo", messages=[{"role": "user", "content": "hi"}],
                    format={"const": "abcdef"}, options={"num_predict": 0})
    assert r.message.content == '"abcdef"' and r.done_reason == "stop"
    v = httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "hi", "max_tokens": 0, "grammar": 'root ::= "abcdef"'}).json()
    assert v["choices"][0]["text"] == "abcdef" and v["choices"][0]["finish_reason"] == "stop", v


def test_raw_generate_has_no_context_and_rejects_system(client):
    r = client.generate(model="demo", prompt="abc", raw=True, options={"num_predict": 3})
    assert r.done and r.context is None
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="demo", prompt="abc", raw=True, system="be brief")
    assert e.value.status_code == 400
    assert e.value.error == "raw mode does not support template, system, or context"


def test_case22_done_reason_from_worker(client):
    assert client.generate(model="demo", prompt="x", options={"num_predict": 5}).done_reason == "length"
    eos = client.generate(model="demo", prompt="hello<|im_end|>", raw=True, options={"num_predict": 50})
    assert eos.done_reason == "stop" and eos.eval_count < 50
    stopped = client.generate(model="demo", prompt="tell me", options={
        "num_predict": 400, "stop": ["e", "a", "o", " "]})
    assert stopped.done_reason == "stop" and stopped.eval_count < 400
    assert not any(c in stopped.response for c in "eao ")
    load = client.generate(model="demo", prompt="")
    assert load.done is True and load.done_reason == "load"
    assert client.generate(model="demo", keep_alive=0).done_reason == "unload"
    chat_load = client.chat(model="demo", messages=[])
    assert chat_load.done_reason == "load" and chat_load.message.role == "assistant"


def test_case23_durations_match_worker_and_v1_usage(gw, client):
    worker = next(w for w in gw.workers() if w["model"] == "demo:latest") \
        if "model" in gw.workers()[0] else gw.workers()[0]
    msgs = [{"role": "user", "content": "durations are nanoseconds " * 8}]
    before = worker_metrics(worker)
    t0 = time.monotonic_ns()
    r = client.chat(model="demo", messages=msgs, options={"num_predict": 40, "seed": 1})
    wall = time.monotonic_ns() - t0
    after = worker_metrics(worker)
    fields = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")
    for f in fields:
        v = getattr(r, f)
        assert isinstance(v, int) and v > 0, f
    prompt_s = after["llamacpp:prompt_seconds_total"] - before["llamacpp:prompt_seconds_total"]
    eval_s = after["llamacpp:tokens_predicted_seconds_total"] - before["llamacpp:tokens_predicted_seconds_total"]
    # The worker's own numbers (ms precision in its counters): ns = ms * 1e6, not ms or s.
    assert r.prompt_eval_duration == pytest.approx(prompt_s * 1e9, rel=0.05, abs=2e6)
    assert r.eval_duration == pytest.approx(eval_s * 1e9, rel=0.05, abs=2e6)
    assert r.eval_count == after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 40
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    # load_duration ends when the request has its slot, before the prefill (it ended at the
    # worker's first token and so held the prompt evaluation too: a fresh tester's find)
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration
    assert r.total_duration <= wall
    v1 = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": msgs, "max_tokens": 40}).json()
    assert v1["usage"]["prompt_tokens"] == r.prompt_eval_count
    assert v1["usage"]["completion_tokens"] == r.eval_count


def test_case24_list_ps_show_typed(gw, client):
    lst = client.list()
    names = sorted(m.model for m in lst.models if m.model != "Friendly:latest")
    assert names == ["demo:latest", "tooly:latest"]
    # an alias is listed as Ollama lists a copy (ollama cp): its own name, the same file
    by_name = {m.model: m for m in lst.models}
    assert by_name["Friendly:latest"].digest == by_name["demo:latest"].digest
    for name in ("Friendly", "friendly:latest", "Friendly:latest"):  # as listed, any case
        r = httpx.get(gw.url + f"/v1/models/{name}", timeout=10)
        # the name as asked, as Ollama's /v1/models/{id} (ToModel(show, c.Param("model")))
        assert r.status_code == 200 and r.json()["id"] == name, (name, r.text)
    for m in lst.models:
        assert isinstance(m.modified_at, datetime) and m.size > 0 and len(m.digest) == 64
        d = m.details
        assert d.format == "gguf" and d.family == "llama" and d.parameter_size.endswith("K")
        assert d.quantization_level == "F32" and d.families == ["llama"]
    ps = client.ps()
    assert sorted(m.model for m in ps.models) == names
    for m in ps.models:
        assert m.size_vram == 0 and isinstance(m.size_vram, int)
        assert isinstance(m.expires_at, datetime) and m.expires_at.tzinfo is not None
        assert m.context_length == 1024 and m.details.family == "llama" and m.digest == lst.models[0].digest
    # Ollama's details always carry parent_model ("" when none), in /api/ps as in /api/tags
    for m in httpx.get(gw.url + "/api/ps").json()["models"]:
        assert m["details"]["parent_model"] == "", m["details"]
    show = client.show("demo")
    assert isinstance(show.modelinfo, dict) and show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.context_length"] == 4096 and show.modelinfo["llama.embedding_length"] == 64
    assert "<|im_start|>" in show.template and show.capabilities == ["completion"]
    assert show.details.parameter_size
    # field case 4: the real per-slot context (read back from /slots), as /api/ps shows it
    assert show.parameters.splitlines()[0].split() == ["num_ctx", "1024"], show.parameters
    assert client.show("tooly").capabilities == ["completion", "tools"]
    assert client.show("FRIENDLY").details.family == "llama"  # alias, case-insensitive


def test_ps_expires_at_never_passes_for_a_model_it_lists(client):
    """The gateway never unloads, so ``/api/ps`` never shows an ``expires_at`` in the past: every
    model it lists expires as Ollama shows one kept forever (``keep_alive`` < 0: Go's largest
    duration, about 292 years, after the last request), whatever ``keep_alive`` said. An
    invalid ``keep_alive`` is still 400."""
    def expiry(name):
        return next(m.expires_at for m in client.ps().models if m.model == name)

    forever = timedelta(microseconds=(2 ** 63 - 1) // 1000)
    for keep_alive in (1, "10m", -1, 0.5):
        before = datetime.now(timezone.utc)
        client.generate(model="demo", prompt="x", keep_alive=keep_alive, options={"num_predict": 1})
        after = datetime.now(timezone.utc)
        time.sleep(1.5)  # past what keep_alive 1 and 0.5 would allow
        exp = expiry("demo:latest")
        assert before + forever - timedelta(seconds=1) <= exp <= after + forever, (keep_alive, exp)
    assert client.ps().models[0].model == "demo:latest"  # the most recently used first
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="demo", prompt="x", keep_alive="5 minutes")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error


def test_capability_and_validation_errors(client):
    cases = [
        (dict(model="demo", prompt="x", suffix="y"), "demo:latest does not support insert"),
        (dict(model="demo", prompt="x", images=["iVBORw0KGgo="]), "demo:latest does not support vision"),
        (dict(model="demo", prompt="x", think=True), '"demo" does not support thinking'),
    ]
    for kw, msg in cases:
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(**kw)
        assert (e.value.status_code, e.value.error) == (400, msg)
    assert client.generate(model="demo", prompt="x", think=False, options={"num_predict": 2}).done
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="demo", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    assert (e.value.status_code, e.value.error) == (400, "demo:latest does not support tools")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope", prompt="x")
    assert (e.value.status_code, e.value.error) == (404, "model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="demo", prompt="x", options={"top_k": "many"})
    assert (e.value.status_code, e.value.error) == (400, 'option "top_k" must be of type integer')
    r = httpx.post(client._client.base_url.join("/api/generate"), json={
        "model": "demo", "prompt": "x", "top_logprobs": 21})
    assert r.status_code == 400 and r.json() == {"error": "top_logprobs must be between 0 and 20"}
    r = httpx.post(client._client.base_url.join("/api/chat"), json={"messages": []})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}


def test_tools_accepted_and_tool_history_round_trips(client):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    r = client.chat(model="tooly", messages=msgs, tools=TOOLS, options={"num_predict": 4})
    assert r.done and r.message.role == "assistant" and r.eval_count == 4
    # The tools really reached the template: the prompt is longer than without them.
    plain = client.chat(model="tooly", messages=msgs, options={"num_predict": 1})
    assert r.prompt_eval_count > plain.prompt_eval_count + 20


def test_chat_with_tools_and_logprobs_answers_streamed_or_not(client):
    """llama-server refuses to stream a chat with tools and logprobs, and the gateway asks every
    chat streamed: each such /api/chat was 400 "logprobs is not supported with tools + stream",
    ``stream: false`` too (a fresh tester's find). It is asked non-streamed and relayed as one
    piece; the text, its logprobs and the counts are the same either way."""
    kw = dict(model="tooly", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
              logprobs=True, top_logprobs=2, options={"num_predict": 6, "seed": 7})
    r = client.chat(**kw)
    assert r.done and r.eval_count == 6 and r.done_reason == "length", r
    assert r.logprobs and all(len(e.top_logprobs) == 2 for e in r.logprobs), r.logprobs
    assert "".join(e.token for e in r.logprobs) == r.message.content
    parts = list(client.chat(**kw, stream=True))
    assert parts[-1].done and parts[-1].eval_count == 6
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [e.token for p in parts for e in (p.logprobs or [])] == [e.token for e in r.logprobs]


def test_chat_with_format_and_tools_is_never_a_500(client):
    """``format`` and ``tools`` together went to llama-server's chat route, which answered 500
    "... peg-native format" for 4 of 8 seeds (streamed: an error line after the tokens; a fresh
    tester's find). They run as a completion of the template with the tools under the format's
    grammar, as Ollama does."""
    msgs = [{"role": "user", "content": "q"}]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    for seed in range(8):
        opts = {"num_predict": 60, "seed": seed, "temperature": 1}
        r = client.chat(model="tooly", messages=msgs, tools=TOOLS, format=schema, options=opts)
        assert r.done and r.message.content.lstrip().startswith("{"), r
        parts = list(client.chat(model="tooly", messages=msgs, tools=TOOLS, format=schema,
                                 options=opts, stream=True))
        assert parts[-1].done and "".join(p.message.content for p in parts) == r.message.content
    plain = client.chat(model="tooly", messages=msgs, format=schema, options={"num_predict": 1})
    assert r.prompt_eval_count > plain.prompt_eval_count + 20  # the tools are in the prompt


def test_chat_prefill_answers_with_the_continuation_only(client):
    """A chat ending in an assistant message continues it; llama-server's chat route repeats
    that message at the start of its answer (``"Sure" + continuation``; a fresh tester's find)
    where Ollama answers the continuation only, as the gateway's ``format`` route already did.
    The continuation is what a raw completion of the rendered prompt generates."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]
    opts = {"num_predict": 3, "seed": 1}
    raw = client.generate(model="tooly", raw=True, options=opts,
                          prompt="<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\nSure")
    r = client.chat(model="tooly", messages=msgs, options=opts)
    assert r.message.content == raw.response and r.eval_count == 3, (r.message.content, raw.response)
    parts = list(client.chat(model="tooly", messages=msgs, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == raw.response


def test_format_json_schema_and_logprobs(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.generate(model="demo", prompt="answer", format=schema, options={"num_predict": 200})
    assert isinstance(json.loads(r.response)["ok"], bool) and r.done_reason == "stop"
    c = client.chat(model="demo", messages=[{"role": "user", "content": "json"}], format=schema,
                    options={"num_predict": 200})
    assert isinstance(json.loads(c.message.content)["ok"], bool)
    lp = client.generate(model="demo", prompt="x", logprobs=True, top_logprobs=3, options={"num_predict": 4})
    # llama-server joins a token that ends inside a UTF-8 character with the next one.
    assert 1 <= len(lp.logprobs) <= 4 and all(len(t.top_logprobs) == 3 for t in lp.logprobs)
    assert all(isinstance(t.logprob, float) for t in lp.logprobs)
    streamed = list(client.chat(model="demo", messages=[{"role": "user", "content": "x"}], stream=True,
                                logprobs=True, options={"num_predict": 3}))
    got = [t for p in streamed for t in (p.logprobs or [])]
    assert 1 <= len(got) <= 3 and all(not t.top_logprobs for t in got)


def test_chat_format_answers_are_never_a_500(gw, client):
    """A chat with a JSON schema ``format`` whose grammar-conforming answer the pinned
    llama-server's chat route failed to parse once more (500 "The model produced output that
    does not match the expected peg-native format", streamed: an error line after the tokens;
    seeds 0 and 7 here, a fresh tester saw about a quarter of seeds) runs as Ollama runs it:
    the chat template, then a completion under the grammar. Thinking, logprobs and the prompt
    (template included) still come through."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "make a person"}]
    for seed in (0, 7):
        opts = {"num_predict": 60, "seed": seed, "temperature": 1}
        r = client.chat(model="demo", messages=msgs, format=schema, options=opts)
        assert r.done and r.done_reason in ("length", "stop") and r.eval_count > 0
        assert r.message.content.lstrip().startswith("{")
        parts = list(client.chat(model="demo", messages=msgs, format=schema, options=opts,
                                 stream=True))
        assert parts[-1].done and "".join(p.message.content for p in parts) == r.message.content
        assert parts[-1].prompt_eval_count == r.prompt_eval_count
    # the template reached the worker: more prompt tokens than the two contents alone
    raw = client.generate(model="demo", prompt="be brief make a person", raw=True,
                          options={"num_predict": 1})
    assert r.prompt_eval_count > raw.prompt_eval_count + 5
    lp = client.chat(model="demo", messages=msgs, format="json", logprobs=True, top_logprobs=2,
                     options={"num_predict": 3})
    assert lp.done and 1 <= len(lp.logprobs) <= 3 and all(len(t.top_logprobs) == 2 for t in lp.logprobs)


def test_show_empties_long_arrays_and_verbose_gives_them_whole(gw):
    """``model_info`` as Ollama's /api/show: arrays longer than 5 are ``[]`` without
    ``verbose`` and whole with it (the keys were missing altogether, and ``verbose`` changed
    nothing; a fresh tester's find)."""
    short = httpx.post(gw.url + "/api/show", json={"model": "demo"}, timeout=30).json()["model_info"]
    full = httpx.post(gw.url + "/api/show", json={"model": "demo", "verbose": True},
                      timeout=30).json()["model_info"]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        assert short[key] == [], key
    assert len(full["tokenizer.ggml.tokens"]) == 559 and len(full["tokenizer.ggml.merges"]) == 300
    assert all(isinstance(t, str) for t in full["tokenizer.ggml.tokens"])
    assert {k: v for k, v in full.items() if not isinstance(v, list) or len(v) <= 5} == \
        {k: v for k, v in short.items() if v != []}
    # a wrong-typed verbose is Ollama's 400 (a JSON unmarshal error there), not ignored
    bad = httpx.post(gw.url + "/api/show", json={"model": "demo", "verbose": "yes"}, timeout=30)
    assert bad.status_code == 400 and bad.json() == {"error": "verbose must be a boolean"}


def test_system_and_options_reach_worker(client):
    base = client.generate(model="demo", prompt="x", options={"num_predict": 1})
    with_sys = client.generate(model="demo", prompt="x", system="you are terse " * 5, options={"num_predict": 1})
    assert with_sys.prompt_eval_count > base.prompt_eval_count + 10
    a = client.generate(model="demo", prompt="same", options={"num_predict": 12, "seed": 7, "temperature": 0})
    b = client.generate(model="demo", prompt="same", options={"num_predict": 12, "seed": 7, "temperature": 0})
    assert a.response == b.response


def test_case5_overlong_prompt_is_400_streamed_and_not(client):
    long = "word " * 1500
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            res = client.chat(model="demo", messages=[{"role": "user", "content": long}], stream=stream)
            if stream:
                list(res)
        assert e.value.status_code == 400
        assert e.value.error.startswith("the prompt is longer than the context length")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="demo", prompt=long)
    assert e.value.status_code == 400


def test_pull_existing_succeeds_and_management_is_refused(client):
    assert client.pull("demo").status == "success"
    statuses = [p.status for p in client.pull("demo", stream=True)]
    assert statuses[-1] == "success" and len(statuses) > 1
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("not-served")
    assert e.value.status_code == 404 and "gateway.yaml" in e.value.error
    for call in (lambda: client.delete("demo"), lambda: client.copy("demo", "other"),
                 lambda: client.push("demo")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "gateway.yaml" in e.value.error


def test_langchain_chat_ollama(gw):
    llm = ChatOllama(model="demo", base_url=gw.url, num_predict=5)
    msg = llm.invoke("hello")
    assert isinstance(msg.content, str) and msg.content
    assert msg.usage_metadata["output_tokens"] == 5 and msg.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream("hello"))
    assert "".join(c.content for c in chunks) and len(chunks) >= 2
    assert [c.response_metadata.get("done_reason") for c in chunks
            if c.response_metadata.get("done_reason")] == ["length"]


def test_first_tags_of_a_large_model_does_not_stall_the_gateway(tmp_path, gateway_factory):
    """A fresh tester's find: ``/api/tags`` right after start-up hashed a large model file on
    the event loop, so a 1 GiB model froze every request (and systemd's watchdog pings) for
    1.7 s, a 40 GB one for minutes. The model here is the demo GGUF padded to 2 GiB (sparse;
    llama-server reads only its tensors): its hash takes seconds, the first ``/api/tags`` answers
    within about a second with a provisional digest while ``GET /`` keeps answering, and once the
    hash is done ``/api/tags`` shows the file's own sha256."""
    import hashlib
    import shutil
    import threading

    from workers.demo_model import ensure_demo_model

    big = tmp_path / "big.gguf"
    shutil.copyfile(ensure_demo_model(), big)
    with open(big, "r+b") as f:
        f.truncate(2 << 30)
    cfg = base_config(free_port(), models=[{"name": "big", "path": str(big), "slots": 1,
                                            "context": 512, "cpu": 1}])
    gw = gateway_factory(cfg, wait=False)
    worst = [0.0]
    stop = threading.Event()

    def poll_root():
        while not stop.is_set():
            t = time.monotonic()
            httpx.get(gw.url + "/", timeout=30)
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.02)

    th = threading.Thread(target=poll_root)
    th.start()
    try:
        t0 = time.monotonic()
        first = httpx.get(gw.url + "/api/tags", timeout=30).json()["models"][0]
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
    assert took < 1.8 and worst[0] < 0.5, (took, worst[0])
    with open(big, "rb") as f:
        want = hashlib.file_digest(f, "sha256").hexdigest()
    assert first["digest"] != want and len(first["digest"]) == 64  # provisional: still hashing
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        digest = httpx.get(gw.url + "/api/tags", timeout=30).json()["models"][0]["digest"]
        if digest == want:
            break
        time.sleep(0.5)
    assert digest == want


def test_huge_integers_and_penalty_windows_do_not_harm_the_worker(gw):
    """A fresh tester's finds and one seen here. llama-server reads 32-bit ints, so budgets past
    2**31 wrapped (``num_predict: 4294967296`` generated 1 token); ``repeat_last_n: -1`` (Ollama:
    the whole context) was llama-server's 400; and ``repeat_last_n: 1000000000`` with a repeat
    penalty made the worker allocate 4 GB in its main loop, which wedged it into a restart."""
    before = {w["id"]: w["restarts"] for w in gw.workers()}
    gen = {"model": "demo", "prompt": "x", "raw": True, "stream": False}
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        **gen, "options": {"num_predict": 3, "repeat_last_n": 1_000_000_000,
                           "repeat_penalty": 1.1}})
    assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
    r = httpx.post(gw.url + "/api/chat", timeout=60, json={
        "model": "demo", "stream": False, "messages": [{"role": "user", "content": "x"}],
        "options": {"num_predict": 3, "repeat_last_n": -1, "repeat_penalty": 1.1}})
    assert r.status_code == 200 and r.json()["eval_count"] == 3, r.text
    r = httpx.post(gw.url + "/api/generate", timeout=60, json={
        **gen, "options": {"num_predict": 2 ** 32}})
    assert r.status_code == 200 and r.json()["eval_count"] > 100, r.text  # to the context's end
    r = httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "x", "max_tokens": 2 ** 32 + 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 100, r.text
    # written as a float it got past an integers-only cap (a fresh tester's find)
    r = httpx.post(gw.url + "/v1/completions", timeout=60, content=b'{"model": "demo", '
                   b'"prompt": "x", "max_tokens": 2, "repeat_last_n": 1e9, "repeat_penalty": 1.2}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert {w["id"]: w["restarts"] for w in gw.workers()} == before  # none was wedged


def test_sampling_flags_in_args_are_the_models_defaults(gateway_factory):
    """An operator's llama-server sampling flags in ``models[].args`` (a model's recommended
    sampling) were overridden by the gateway's defaults on every request (a fresh tester's
    find). They are the model's defaults now, as an Ollama Modelfile's PARAMETER lines: a
    request that leaves the field out gets the worker's value, one that sets it its own. The
    worker's /slots shows what the last task ran with."""
    cfg = base_config(free_port(), models=[model("demo", args=[
        "--temp", "0.2", "--top-k", "7", "--min-p", "0.3", "--repeat-penalty", "1.3"])])
    gw = gateway_factory(cfg)
    (w,) = gw.workers()

    def last_params() -> dict:
        last = max((s for s in gw.slots(w) if s.get("id_task") is not None),
                   key=lambda s: s["id_task"])
        return {k: round(last["params"][k], 6) for k in
                ("temperature", "top_k", "min_p", "repeat_penalty", "top_p")}

    gen = {"model": "demo", "prompt": "x", "raw": True, "stream": False}
    httpx.post(gw.url + "/api/generate", json={**gen, "options": {"num_predict": 2}}, timeout=30)
    # the flags' values; top_p, which no flag set, Ollama's default 0.9
    assert last_params() == {"temperature": 0.2, "top_k": 7, "min_p": 0.3,
                             "repeat_penalty": 1.3, "top_p": 0.9}
    httpx.post(gw.url + "/api/generate", timeout=30, json={
        **gen, "options": {"num_predict": 2, "temperature": 0.5, "top_k": 3}})
    assert last_params() == {"temperature": 0.5, "top_k": 3, "min_p": 0.3,
                             "repeat_penalty": 1.3, "top_p": 0.9}
    httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    # /v1: the flags' values, top_p Ollama's /v1 default 1.0
    assert last_params() == {"temperature": 0.2, "top_k": 7, "min_p": 0.3,
                             "repeat_penalty": 1.3, "top_p": 1.0}
