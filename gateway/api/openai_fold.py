"""Fold llama-server's streamed ``/v1`` answer into the object it returns non-streamed.

A non-streamed ``/v1/chat/completions`` or ``/v1/completions`` request is sent to the worker
with ``stream: true`` (llama-server stops a stream within about 0.5 s of the gateway closing
it, and the first-byte watchdog can time it) and its SSE events are folded here into the JSON
object llama-server itself would have answered. Shapes follow the pinned llama-server source
(llama.cpp ``0c1e570``, ``tools/server/server-task.cpp``):

* chat, ``to_json_oaicompat_chat``: ``{"choices": [{"finish_reason", "index", "message":
  {"role", "content", "reasoning_content"?, "tool_calls"?}, "logprobs"?}], "created", "model",
  "system_fingerprint", "object": "chat.completion", "usage", "id", "timings"?}``.
  ``content`` is ``""`` when nothing was generated (never null); a tool call is
  ``{"type": "function", "function": {"name", "arguments"}, "id"?}`` (``common_chat_msg::
  to_json_oaicompat``); ``logprobs`` is present only when tokens carried some.
* completions, ``to_json_oaicompat``: ``{"choices": [{"text", "index", "logprobs",
  "finish_reason"}], "created", "model", "system_fingerprint", "object": "text_completion",
  "usage", "id", "timings"?}`` with ``logprobs`` null unless requested.
* ``n > 1`` (and several prompts): one choice per index in index order, with ``timings`` and
  ``created`` of choice 0, as ``handle_completions_impl`` merges its results. ``usage`` is not
  llama-server's (task 0's only) but the whole request's, as OpenAI reports it
  (``openai_usage.UsageSum`` over every choice's usage). A chat stream's usage chunk
  (``choices: []``) follows the finish chunk of its own choice.

Differences the stream cannot avoid (what llama-server streams lacks the facts; checked on
the pinned build): an answer cut by ``max_tokens`` inside a multi-byte character ends,
non-streamed, with U+FFFD for the incomplete bytes, which are never streamed
(``process_token`` holds them back); a chat answer that the template's parser turns into an
empty message (e.g. only whitespace with a tool-aware template) is ``""`` here where
non-streamed llama-server returns the raw text; with ``logprobs`` and a ``stop`` string that
ends the answer, a completion lists the stop string's tokens too (the non-streamed answer
drops them) and a chat answer lacks the tokens held back while matching it (they produce no
chunk). ``__verbose`` (the ``verbose`` debug field) is not rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.api.openai_usage import UsageSum
from gateway.upstream import BROKE_MESSAGE, UpstreamError, error_event


def fold_tool_call_deltas(acc: dict[int, dict], deltas) -> None:
    """Add the ``delta.tool_calls`` fragments of one chat chunk to ``acc``.

    ``acc`` maps a tool call's ``index`` to ``{"id", "name", "arguments"}`` strings; llama-server
    sends ``id`` and ``name`` with a call's first fragment and ``function.arguments`` in pieces
    (``server_chat_msg_diff_to_json_oaicompat``), so every field is concatenated.
    """
    for tc in deltas or ():
        slot = acc.setdefault(tc.get("index", len(acc)), {"id": "", "name": "", "arguments": ""})
        slot["id"] += tc.get("id") or ""
        fn = tc.get("function") or {}
        slot["name"] += fn.get("name") or ""
        slot["arguments"] += fn.get("arguments") or ""


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    logprobs: list | None = None
    finish_reason: str | None = None
    created: int | None = None
    usage: dict | None = None
    timings: dict | None = None


class OpenAIFold:
    """Accumulates one streamed answer; :meth:`add` each event, then :meth:`result`.

    Args:
        chat: True for ``/v1/chat/completions`` chunks, False for ``/v1/completions``.
        per_prompt: tasks per prompt (the body's ``n``; ``gateway.sizing.choices``), which
            groups the choices' usages by prompt.
    """

    def __init__(self, chat: bool, per_prompt: int = 1):
        self.chat = chat
        self.per_prompt = per_prompt
        self.head: dict = {}
        self.choices: dict[int, _Choice] = {}
        self._finished: _Choice | None = None  # the choice whose finish chunk came last

    def add(self, ev: dict) -> None:
        """Fold one parsed SSE event. Raises UpstreamError for an ``{"error": …}`` event (status
        = its ``code``, as llama-server would have answered the non-streamed request).
        Anything but an object is skipped: llama-server writes ``data: null`` for the start
        marker of every task but the first (``n > 1``, several prompts)."""
        if not isinstance(ev, dict):
            return
        if "error" in ev:
            raise error_event(ev["error"])
        if not self.head:
            self.head = {"id": ev.get("id"), "model": ev.get("model"),
                         "system_fingerprint": ev.get("system_fingerprint")}
        target = self._finished  # a chunk without choices belongs to the choice that just ended
        for ch in ev.get("choices") or ():
            idx = ch.get("index", 0)
            c = self.choices.get(idx)
            if c is None:
                c = self.choices[idx] = _Choice(idx)
            target = c
            if self.chat:
                delta = ch.get("delta") or {}
                if delta.get("content"):
                    c.text.append(delta["content"])
                if delta.get("reasoning_content"):
                    c.reasoning.append(delta["reasoning_content"])
                if delta.get("tool_calls"):
                    fold_tool_call_deltas(c.tool_calls, delta["tool_calls"])
            elif ch.get("text"):
                c.text.append(ch["text"])
            lp = ch.get("logprobs")
            if isinstance(lp, dict) and lp.get("content"):
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(lp["content"])
            if ch.get("finish_reason"):
                c.finish_reason, c.created = ch["finish_reason"], ev.get("created")
                self._finished = c
        if target is not None:
            if "usage" in ev:
                target.usage = ev["usage"]
            if "timings" in ev:
                target.timings = ev["timings"]

    def result(self) -> dict:
        """The non-streamed answer. Raises UpstreamError(502) when the stream ended before
        every choice had its finish chunk and usage (the worker went away mid-answer; usage is
        always asked for, and follows the finish chunk)."""
        if not self.choices or any(c.finish_reason is None or c.usage is None
                                   for c in self.choices.values()):
            raise UpstreamError(502, BROKE_MESSAGE, "stream_incomplete")
        ordered = [self.choices[i] for i in sorted(self.choices)]
        first = ordered[0]
        usage = UsageSum(self.per_prompt)
        for c in ordered:
            usage.add(c.usage, c.index)
        out = {"choices": [self._choice(c) for c in ordered], "created": first.created,
               "model": self.head.get("model"),
               "system_fingerprint": self.head.get("system_fingerprint"),
               "object": "chat.completion" if self.chat else "text_completion",
               "usage": usage.total(), "id": self.head.get("id")}
        if first.timings is not None:
            out["timings"] = first.timings
        return out

    def _choice(self, c: _Choice) -> dict:
        logprobs = {"content": c.logprobs} if c.logprobs else None
        if not self.chat:
            return {"text": "".join(c.text), "index": c.index, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}
        msg: dict = {"role": "assistant", "content": "".join(c.text)}
        if c.reasoning:
            msg["reasoning_content"] = "".join(c.reasoning)
        if c.tool_calls:
            msg["tool_calls"] = [_tool_call(c.tool_calls[i]) for i in sorted(c.tool_calls)]
        out = {"finish_reason": c.finish_reason, "index": c.index, "message": msg}
        if logprobs:
            out["logprobs"] = logprobs
        return out


def _tool_call(tc: dict) -> dict:
    out = {"type": "function", "function": {"name": tc["name"], "arguments": tc["arguments"]}}
    if tc["id"]:
        out["id"] = tc["id"]
    return out


def needs_non_streamed_upstream(body: dict, chat: bool) -> bool:
    """True for the one request llama-server refuses to stream although it answers it
    non-streamed: chat with ``logprobs: true`` and a non-empty ``tools`` list ("logprobs is not
    supported with tools + stream", ``oaicompat_chat_params_parse``). Such a request is
    forwarded non-streamed as the client sent it."""
    tools = body.get("tools")
    return chat and body.get("logprobs") is True and isinstance(tools, list) and bool(tools)
