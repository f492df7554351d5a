"""Unit tests of gateway/api/openai_structured.py on llama-server's recorded SSE
(tests/api/openai_sse_recorded.json, the pinned build on the demo model)."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from gateway.api.openai_fold import OpenAIFold
from gateway.api.openai_structured import (ChatChunks, completion_body, completion_schema,
                                           template_fields)

REC = json.loads(Path(__file__).with_name("openai_sse_recorded.json").read_text())
MSGS = [{"role": "user", "content": "hi"}]


def _chat_events(case: str) -> list[dict]:
    conv = ChatChunks()
    out = []
    for ev in REC[case]["events"]:  # one batch per event, as a slow stream arrives
        out.extend(orjson.loads(b) for b in conv([orjson.dumps(ev)]))
    return out


def test_completion_events_become_chat_chunks_with_the_same_text_and_usage():
    evs = _chat_events("completion")
    assert evs[0]["choices"] == [{"finish_reason": None, "index": 0,
                                  "delta": {"role": "assistant", "content": None}}]
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"])
    src = REC["completion"]["events"]
    assert text == "".join(e["choices"][0]["text"] for e in src)
    *_, finish, usage = evs
    assert finish["choices"] == [{"finish_reason": "length", "index": 0, "delta": {}}]
    assert "usage" not in finish and usage["choices"] == [] and usage["usage"] == src[-1]["usage"]
    assert usage["id"] == src[-1]["id"]


def test_folded_like_a_chat_answer_with_n_2():
    fold = OpenAIFold(chat=True, per_prompt=2)
    conv = ChatChunks()
    src = [orjson.dumps(e) for e in REC["completion_n2_logprobs"]["events"]]
    for data in conv(src):  # one batch: the role chunk of each choice before its text
        fold.add(orjson.loads(data))
    got = fold.result()
    want = REC["completion_n2_logprobs"]["non_streamed"]
    assert got["object"] == "chat.completion"
    assert [c["message"]["content"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert [c["message"]["role"] for c in got["choices"]] == ["assistant", "assistant"]
    # each choice's logprobs come along, as the completion answer has them
    assert [c["logprobs"] for c in got["choices"]] == [c["logprobs"] for c in want["choices"]]
    assert got["usage"]["completion_tokens"] == sum(
        e["usage"]["completion_tokens"] for e in REC["completion_n2_logprobs"]["events"]
        if "usage" in e)


def test_error_event_is_left_as_it_is():
    err = b'{"error":{"code":500,"message":"x","type":"server_error"}}'
    assert ChatChunks()([err]) == [err]


def test_which_chats_run_as_a_completion():
    base = {"messages": MSGS, "response_format": {"type": "json_object"}}
    assert completion_schema(base) == {}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert completion_schema({"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}) == schema
    assert completion_schema({**base, "response_format": {"type": "json_object",
                                                          "schema": schema}}) == schema
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert completion_schema({**base, "tools": tools}) == {}  # rendered into the prompt
    for other in ({"response_format": {"type": "text"}}, {"response_format": None},
                  {"grammar": "root ::= \"a\""},
                  {"messages": MSGS + [{"role": "assistant", "content": '{"k":'}]},
                  {"messages": [{"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "data:,"}}]}]}):
        assert completion_schema({**base, **other}) is None, other
    assert completion_schema({**base, "tools": [], "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}) == {}
    # logprobs come along (llama-server's streamed chat route dropped the text under the
    # format's grammar; a fresh tester's find)
    assert completion_schema({**base, "logprobs": True, "top_logprobs": 2}) == {}


def test_completion_body_keeps_sampling_and_drops_chat_fields():
    body = {"model": "demo:latest", "messages": MSGS, "response_format": {"type": "json_object"},
            "max_tokens": 5, "seed": 3, "n": 2, "stream": True, "tools": [],
            "tool_choice": "auto", "chat_template_kwargs": {"x": 1}, "stop": ["}"]}
    up = completion_body(body, "<prompt>", {})
    assert up == {"model": "demo:latest", "max_tokens": 5, "seed": 3, "n": 2, "stream": True,
                  "stop": ["}"], "prompt": "<prompt>", "json_schema": {}}
    assert template_fields(body) == {"tools": [], "tool_choice": "auto",
                                     "chat_template_kwargs": {"x": 1}}
    # the chat's logprobs are the completion's n_probs: top_logprobs, else 20 (llama-server's
    # chat route); n >= 2 with an empty prompt: no schema
    empty = completion_body({**body, "response_format": None, "logprobs": True,
                             "top_logprobs": 2}, "", None)
    assert "json_schema" not in empty and "logprobs" not in empty and "top_logprobs" not in empty
    assert empty["n_probs"] == 2
    assert completion_body({**body, "logprobs": True}, "p", {})["n_probs"] == 20
    assert "n_probs" not in completion_body({**body, "logprobs": False, "top_logprobs": None}, "p", {})
    assert empty["prompt"] == "" and empty["n"] == 2


def test_prefilled_format_is_a_last_assistant_message_under_a_json_format():
    from gateway.api.openai_structured import prefilled_format
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    assert prefilled_format({"messages": msgs, "response_format": {"type": "json_object"}})
    assert prefilled_format({"messages": msgs, "json_schema": {}})
    assert not prefilled_format({"messages": msgs, "response_format": {"type": "text"}})
    assert not prefilled_format({"messages": msgs[:1], "response_format": {"type": "json_object"}})
    assert not prefilled_format({"messages": "x", "response_format": {"type": "json_object"}})

