"""``/v1/chat/completions`` run as a completion of the chat template: the template applied by
the gateway (``render.render_prompt``), then the worker's ``/v1/completions``, its events turned
back into chat chunks. Two kinds of chat take this route:

* **A JSON ``response_format``**, as Ollama runs structured output: the completion runs under
  the schema's grammar. llama-server's chat route parses the finished answer once more against
  the format's PEG parser (common/chat.cpp ``common_chat_peg_parse``) and answers 500 "The
  model produced output that does not match the expected peg-native format" for answers its
  own grammar let through (seen on the pinned build for 10 of 24 seeds of ``json_object`` on
  the demo model: text that is not valid UTF-8 inside a JSON string, answers cut by
  ``max_tokens``). The completion route does not parse the answer: it is the text the grammar
  allowed. ``logprobs`` come along (the completion route's entries have the chat route's
  shape; llama-server's streamed chat route under a format's grammar dropped the text of
  answers with ``logprobs``: ``content: ""`` for 5 tokens, a fresh tester's find). Taken only
  where it gives what the chat route would: no last assistant message (a prefill, which the chat route's grammar continues), no
  llama-server ``grammar`` / ``json_schema`` of the client's own, text-only messages (media
  need the chat route's projector handling), and a model whose chat template has no reasoning
  (``thinking`` capability), whose chat-route grammar lets it reason before the JSON. ``tools``
  are rendered into the prompt; with a ``response_format`` the chat route cannot call them
  either (its grammar and parser are the format's only, common/chat-auto-parser-generator.cpp).
* **``n`` ≥ 2 and a chat that renders to an empty prompt** (only an empty assistant message):
  llama-server never answers the extra choices of a prompt without tokens (the same fault as
  ``openai.spread_empty_prompts`` works around for ``/v1/completions``), so the request held
  ``n`` slots until the watchdog's ``inter_token_s`` (a fresh tester's find). As a completion
  the empty prompt is repeated ``n`` times and answered at once, as ``n`` 1 is.
"""

from __future__ import annotations

import orjson

#: ``/apply-template`` fields of a chat body that change the rendered prompt (llama-server
#: ``oaicompat_chat_params_parse``); everything else of the chat body is sampling or output.
TEMPLATE_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                   "add_generation_prompt", "continue_final_message", "reasoning_effort")

#: Chat-only fields the completion body drops (they are rendered into the prompt, or are the
#: format itself, given as ``json_schema``).
_CHAT_ONLY = ("messages", "response_format", "reasoning_format") + TEMPLATE_FIELDS


def completion_schema(body: dict) -> dict | None:
    """The JSON schema a ``/v1/chat/completions`` ``body`` asks for when it can run as a
    completion (module doc; ``{}``: any JSON object), else None. The model's ``thinking``
    capability is the caller's to check. ``body`` was validated (``openai._check_response_format``)."""
    rf = body.get("response_format")
    if format_schema(rf) is None:
        return None
    if "grammar" in body or "json_schema" in body:
        return None
    msgs = body.get("messages") or ()
    if msgs and msgs[-1].get("role") == "assistant":
        # a prefill: llama-server's chat route continues it under the grammar (its parser
        # counts the prefill in); a completion would start a new JSON value after it
        return None
    for m in msgs:
        c = m.get("content")
        if isinstance(c, list) and any(p.get("type", "text") != "text" for p in c):
            return None
    return format_schema(rf)


#: The start of llama-server's error when a request's grammar could not be set up: among other
#: faults, when the chat's continued last assistant message (a prefill) is not the start of
#: what the output format allows (common/sampling.cpp feeds the generation prompt to an
#: output-format grammar and rethrows its error as a bare ``std::exception``).
SAMPLER_INIT_FAILED = "Failed to initialize samplers"
PREFILL_OUTSIDE_FORMAT = ("the last assistant message is continued (a prefill) under the "
                          "response_format's grammar, so it must itself start what the format "
                          "allows (such as '{\"answer\": \"'), and it does not; llama-server: ")


def prefilled_format(body: dict) -> bool:
    """Whether chat ``body`` continues its last assistant message under a JSON
    ``response_format`` (or llama-server's ``json_schema``): a :data:`SAMPLER_INIT_FAILED`
    answer to it is :data:`PREFILL_OUTSIDE_FORMAT` (llama-server said only ``std::exception``;
    a fresh tester's find)."""
    msgs = body.get("messages") or ()
    last = msgs[-1] if isinstance(msgs, list) and msgs else None
    return isinstance(last, dict) and last.get("role") == "assistant" and (
        format_schema(body.get("response_format")) is not None or "json_schema" in body)


def format_schema(rf) -> dict | None:
    """The JSON schema of a validated ``response_format`` (``{}``: any JSON object), or None
    for ``text`` / none."""
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        return None
    if rf["type"] == "json_schema":
        return rf["json_schema"].get("schema") or {}
    return rf.get("schema") or {}


def completions_format(body: dict) -> None:
    """``/v1/completions``: llama-server reads no ``response_format`` there (only its own
    ``json_schema`` / ``grammar``), so a valid one was checked and then dropped without a word
    (a fresh tester's find); it becomes ``json_schema``, unless the body has its own."""
    schema = format_schema(body.get("response_format"))
    if schema is not None and "json_schema" not in body and "grammar" not in body:
        body["json_schema"] = schema
        del body["response_format"]


def template_fields(body: dict) -> dict:
    """The chat body's fields that ``/apply-template`` needs besides ``messages``."""
    return {k: body[k] for k in TEMPLATE_FIELDS if k in body}


def completion_body(body: dict, prompt: str, schema: dict | None) -> dict:
    """The ``/v1/completions`` body for a chat ``body``: its sampling and output fields, the
    rendered ``prompt`` and, unless ``schema`` is None, ``json_schema`` (llama-server turns an
    empty schema into "any object", server-schema.cpp ``json_schema``). The chat's
    ``logprobs: true`` is the completion's ``n_probs``: ``top_logprobs``, 20 when not given,
    as llama-server's chat route sets it (server-common.cpp ``oaicompat_chat_params_parse``;
    ``openai`` sets 1 for a chat without it, and drops the alternatives from the answer);
    an empty prompt generates nothing."""
    up = {k: v for k, v in body.items() if k not in _CHAT_ONLY + ("logprobs", "top_logprobs")}
    if body.get("logprobs") is True:
        top = body.get("top_logprobs")
        up["n_probs"] = top if top is not None else 20
    up["prompt"] = prompt
    if schema is not None:
        up["json_schema"] = schema
    return up


class ChatChunks:
    """Turns the SSE payloads of llama-server's streamed ``/v1/completions`` answer into those
    its ``/v1/chat/completions`` sends (shapes from the pinned build, recorded in
    tests/api/openai_sse_recorded.json): each choice starts with a ``{"role": "assistant",
    "content": null}`` delta; ``text`` becomes ``delta.content`` (``{}`` when empty) and a
    choice's ``logprobs`` (``{"content": [...]}``, the same entries on both routes) stay;
    ``object`` is ``chat.completion.chunk``; the ``usage`` (and ``timings``) that a completion
    puts on its finish chunk come after it in a chunk of their own with ``choices: []``.
    Payloads without choices (an error event) are left as they are.

    Call it with one network read's batch (``upstream.iter_sse_batches``); returns the new
    batch (bytes payloads)."""

    def __init__(self) -> None:
        self._started: set[int] = set()

    def __call__(self, batch: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for data in batch:
            ev = orjson.loads(data)
            if not isinstance(ev, dict) or not ev.get("choices"):
                out.append(data)
                continue
            usage, timings = ev.pop("usage", None), ev.pop("timings", None)
            head = {k: v for k, v in ev.items() if k != "choices"}
            head["object"] = "chat.completion.chunk"
            for c in ev["choices"]:
                i = c.get("index", 0)
                if i not in self._started:
                    self._started.add(i)
                    out.append(orjson.dumps({"choices": [{
                        "finish_reason": None, "index": i,
                        "delta": {"role": "assistant", "content": None}}], **head}))
                text, probs = c.get("text") or "", c.get("logprobs")
                if not text and c.get("finish_reason") is None and not probs:
                    continue  # nothing to say (llama-server's chat stream sends no such chunk)
                choice = {"finish_reason": c.get("finish_reason"), "index": i,
                          "delta": {"content": text} if text else {}}
                if probs:
                    choice["logprobs"] = probs
                out.append(orjson.dumps({"choices": [choice], **head}))
            if usage is not None:
                tail = {"choices": [], **head, "usage": usage}
                if timings is not None:
                    tail["timings"] = timings
                out.append(orjson.dumps(tail))
        return out
