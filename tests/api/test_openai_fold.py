"""Unit tests of the /v1 stream fold (gateway/api/openai_fold.py), no workers needed.

``openai_sse_recorded.json`` holds real llama-server answers (see record_openai_sse.py): each
case's SSE events folded must give the worker's own non-streamed answer. The tool-call and
error sequences are written out by hand in llama-server's chunk shapes
(``server_chat_msg_diff_to_json_oaicompat``, ``format_error_response``): the random demo model
never emits a tool call and no request makes the pinned worker fail mid-stream on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api.ollama_mapping import StreamState
from gateway.api.openai_fold import OpenAIFold, needs_non_streamed_upstream
from gateway.upstream import UpstreamError

RECORDED = json.loads(Path(__file__).with_name("openai_sse_recorded.json").read_text())


def fold(events: list[dict], chat: bool, per_prompt: int = 1) -> dict:
    f = OpenAIFold(chat=chat, per_prompt=per_prompt)
    for ev in events:
        f.add(ev)
    return f.result()


def _unstable(obj: dict) -> dict:
    """The answer without what differs between two runs of one request: the random ``id``,
    the clock (``created``, ``timings`` values; their keys stay)."""
    return {**obj, "id": None, "created": None, "timings": sorted(obj.get("timings", {}))}


#: The whole request's usage (OpenAI's) of the recorded several-task cases, by hand from
#: their events' per-task usages: completion tokens summed over the tasks, prompt tokens once
#: per prompt. The worker's own non-streamed answer carries task 0's usage instead.
SUMMED = {
    "chat_n2_logprobs": {"completion_tokens": 3 + 3, "prompt_tokens": 14, "total_tokens": 20,
                         "prompt_tokens_details": {"cached_tokens": 0}},
    "completion_n2_logprobs": {"completion_tokens": 3 + 3, "prompt_tokens": 2, "total_tokens": 8,
                               "prompt_tokens_details": {"cached_tokens": 0}},
    "completion_two_prompts": {"completion_tokens": 4 + 4, "prompt_tokens": 1 + 2,
                               "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 0}},
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_stream_folds_into_the_workers_own_non_streamed_answer(name):
    """Equal to the worker's non-streamed answer, but for the usage of a several-task request,
    which is the whole request's (``SUMMED``)."""
    case = RECORDED[name]
    got = fold(case["events"], chat=case["path"].endswith("chat/completions"),
               per_prompt=case["request"].get("n", 1))
    want = case["non_streamed"]
    if len(want["choices"]) > 1:
        want = {**want, "usage": SUMMED[name]}
    assert _unstable(got) == _unstable(want)
    assert list(got) == list(want)  # same keys in the same order as llama-server's
    for g, w in zip(got["choices"], want["choices"]):
        assert list(g) == list(w)
    assert got["id"] == case["events"][-1]["id"] and isinstance(got["created"], int)


def test_n2_sums_each_choices_usage_and_takes_timings_of_choice_0_when_choice_1_ends_first():
    events = json.loads(json.dumps(RECORDED["chat_n2_logprobs"]["events"]))
    ends = [ev["choices"][0]["index"] for ev in events
            if ev["choices"] and ev["choices"][0]["finish_reason"]]
    assert ends == [1, 0]  # the recording does exercise the order
    usage = [ev for ev in events if not ev["choices"]]
    usage[0]["usage"] = {**usage[0]["usage"], "completion_tokens": 999}  # choice 1's, marked
    got = fold(events, chat=True, per_prompt=2)
    assert got["usage"] == {"completion_tokens": 999 + 3, "prompt_tokens": 14,
                            "total_tokens": 999 + 3 + 14, "prompt_tokens_details": {"cached_tokens": 0}}
    assert got["timings"] == usage[1]["timings"]


def _chunk(delta: dict, finish=None, **extra) -> dict:
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": 1795963640, "id": "chatcmpl-x", "model": "demo",
            "system_fingerprint": "b1-0c1e570", "object": "chat.completion.chunk", **extra}


USAGE = {"completion_tokens": 30, "prompt_tokens": 14, "total_tokens": 44,
         "prompt_tokens_details": {"cached_tokens": 0}}

TOOL_EVENTS = [
    _chunk({"role": "assistant", "content": None}),
    _chunk({"reasoning_content": "need "}),
    _chunk({"reasoning_content": "weather"}),
    _chunk({"content": "Checking."}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_a1", "type": "function",
                            "function": {"name": "get_weather"}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "call_b2", "type": "function",
                            "function": {"name": "get_time", "arguments": "{}"}}]}),
    _chunk({}, "tool_calls"),
    {"choices": [], "created": 1795963640, "id": "chatcmpl-x", "model": "demo",
     "system_fingerprint": "b1-0c1e570", "object": "chat.completion.chunk", "usage": USAGE,
     "timings": {"prompt_n": 14, "predicted_n": 30}},
]


def test_tool_call_fragments_reasoning_and_content_fold_into_one_message():
    got = fold(TOOL_EVENTS, chat=True)
    assert got == {
        "choices": [{"finish_reason": "tool_calls", "index": 0, "message": {
            "role": "assistant", "content": "Checking.", "reasoning_content": "need weather",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": "{\"city\": \"Paris\"}"},
                 "id": "call_a1"},
                {"type": "function", "function": {"name": "get_time", "arguments": "{}"},
                 "id": "call_b2"}]}}],
        "created": 1795963640, "model": "demo", "system_fingerprint": "b1-0c1e570",
        "object": "chat.completion", "usage": USAGE, "id": "chatcmpl-x",
        "timings": {"prompt_n": 14, "predicted_n": 30}}


def test_the_ollama_fold_reads_the_same_tool_call_fragments():
    st = StreamState(t_start_ns=0)
    for ev in TOOL_EVENTS:
        st.fold_chat(ev)
    assert st.tool_calls == {0: {"id": "call_a1", "name": "get_weather",
                                 "arguments": "{\"city\": \"Paris\"}"},
                             1: {"id": "call_b2", "name": "get_time", "arguments": "{}"}}


def test_only_tool_calls_gives_empty_string_content_not_null():
    got = fold([TOOL_EVENTS[0], *TOOL_EVENTS[4:]], chat=True)
    msg = got["choices"][0]["message"]
    assert msg["content"] == "" and "reasoning_content" not in msg and len(msg["tool_calls"]) == 2


def test_an_error_event_mid_stream_raises_the_status_it_carries():
    f = OpenAIFold(chat=True)
    f.add(TOOL_EVENTS[0])
    f.add(_chunk({"content": "par"}))
    with pytest.raises(UpstreamError) as e:
        f.add({"error": {"code": 500, "message": "Could not decode token", "type": "server_error"}})
    assert (e.value.status, e.value.message, e.value.kind) == (500, "Could not decode token",
                                                               "server_error")
    with pytest.raises(UpstreamError) as e:
        OpenAIFold(chat=False).add({"error": {"code": 400, "message": "bad",
                                              "type": "exceed_context_size_error"}})
    assert (e.value.status, e.value.kind) == (400, "exceed_context_size_error")
    with pytest.raises(UpstreamError) as e:
        OpenAIFold(chat=False).add({"error": "plain text"})
    assert (e.value.status, e.value.message) == (500, "plain text")


@pytest.mark.parametrize("cut", [0, 3, 9])
def test_a_stream_that_ends_before_every_finish_chunk_is_a_502_not_an_answer(cut):
    f = OpenAIFold(chat=True)
    for ev in TOOL_EVENTS[:cut]:
        f.add(ev)
    with pytest.raises(UpstreamError) as e:
        f.result()
    assert e.value.status == 502 and "stopped in the middle" in e.value.message


def test_one_choice_of_two_unfinished_is_a_502():
    events = [ev for ev in RECORDED["completion_n2_logprobs"]["events"]
              if not (ev["choices"] and ev["choices"][0]["index"] == 1
                      and ev["choices"][0]["finish_reason"])]
    with pytest.raises(UpstreamError):
        fold(events, chat=False)


def test_prompt_progress_chunks_add_nothing():
    progress = _chunk({"role": "assistant", "content": None},
                      prompt_progress={"total": 14, "cache": 0, "processed": 14, "time_ms": 1})
    assert fold([progress, *TOOL_EVENTS], chat=True) == fold(TOOL_EVENTS, chat=True)


def test_only_chat_with_logprobs_and_tools_goes_up_non_streamed():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert needs_non_streamed_upstream({"logprobs": True, "tools": tools}, chat=True)
    assert not needs_non_streamed_upstream({"logprobs": True, "tools": []}, chat=True)
    assert not needs_non_streamed_upstream({"logprobs": True}, chat=True)
    assert not needs_non_streamed_upstream({"tools": tools}, chat=True)
    assert not needs_non_streamed_upstream({"logprobs": 2, "tools": tools}, chat=False)


def test_null_start_markers_of_later_tasks_are_skipped():
    events = RECORDED["completion_two_prompts"]["events"]
    assert None in events  # what the worker really sends (``data: null``) for a second task
    assert fold(events, chat=False)["choices"][1]["text"] == " c c c c"
