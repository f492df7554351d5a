"""Ollama API routes: ``/api/generate``, ``/api/chat``, ``/api/tags``, ``/api/ps``,
``/api/version``, ``/api/show`` and ``GET|HEAD /``.

Handlers translate and nothing more: parse → ticket → ``Upstream.request`` → fold the SSE
events (``ollama_mapping.StreamState``) → NDJSON lines, or one JSON object for ``stream:false``.
Shapes follow Ollama's api/types.go and routes.go (see shared/reference/ollama-api.md).

``/api/generate`` renders its prompt as Ollama does for native models: the chat template via
the worker's ``/apply-template`` (skipped for ``raw``), an incoming ``context`` detokenized and
prepended, then ``/completion`` (``/infill`` with ``suffix``); the final chunk's ``context`` is
``/tokenize`` of rendered prompt + response, asked of the worker that generated it while that
one is in rotation (side calls: ``gateway.worker_calls``). A request that admission would refuse
at once (full queue, no worker can serve) gets that answer before any side call.
``/api/chat`` goes to ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import copy
import time
from datetime import datetime

import orjson
from aiohttp import web

from gateway import __version__
from gateway.admission import QueueFull, QueueTimeout, Unavailable
from gateway.api import worker_ints
from gateway.api.answer_again import answer_again
from gateway.api.capabilities import model_capabilities, model_template, require
from gateway.api.common import (make_ticket, note_upstream_error, operator_sampling, optional,
                                read_json, stream_response, t0_ns, visible_entries,
                                visible_names)
from gateway.api.errors import (ApiError, admission_error, json_body, ollama_error,
                                 upstream_headers)
from gateway.api.grammar_checks import check_tools
from gateway.api.render import render_prompt, upstream_error_text
from gateway.api.ollama_mapping import (
    StreamState,
    format_fields,
    is_unload,
    map_options,
    parse_keep_alive,
    parse_logprobs,
    parse_think,
    tool_call_out,
)
from gateway.inventory import GGUFFacts, ModelEntry, now_utc_z
from gateway.logs import get_logger
from gateway.metrics import note_first_byte, note_lease, worker_state
from gateway.thinking_split import ThinkingSplit, think_tags
from gateway.upstream import UpstreamError, iter_sse_batches, read_all
from gateway.worker_calls import apply_template, tokenize

log = get_logger("gateway.api.ollama")

# The Ollama version this API corresponds to (clients such as Open WebUI read /api/version).
OLLAMA_COMPAT_VERSION = "0.12.6"
# When this gateway module was loaded: the "load time" of models no request has touched yet.
_STARTED_AT = datetime.now().astimezone()
# llama-server's default multimodal marker (mtmd_default_marker) for images in a /completion prompt.
MEDIA_MARKER = "<__media__>"


def _gw(request: web.Request):
    return request.app["gw"]


def resolve_model(request: web.Request, body: dict, *, missing_status: int) -> ModelEntry:
    """The served model named by ``body["model"]``. Raises ApiError: 404 ``model '' not found``
    (generate/embed style) or 400 ``model is required`` (chat/show style) when it is missing,
    404 ``model '<name>' not found`` when it is not served."""
    name = body.get("model")
    if name is None or name == "":
        if missing_status == 404:
            raise ApiError(404, "model '' not found")
        raise ApiError(400, "model is required")
    if not isinstance(name, str):
        raise ApiError(400, "model must be a string")
    entry = _gw(request).inventory.resolve(name)
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    return entry


def _stream_flag(body: dict) -> bool:
    s = body.get("stream", True)
    if s is not None and not isinstance(s, bool):
        raise ApiError(400, "stream must be a boolean")
    return s is not False


def _sampling(gw, request: web.Request, body: dict, entry: ModelEntry) -> dict:
    """``body``'s Ollama ``options`` as llama-server sampling fields (``map_options``); the
    ones it ignores are logged once (``request.options_ignored``)."""
    cfg = gw.config.generation
    ignored: list[str] = []
    out = map_options(body.get("options"), num_predict_default=cfg.num_predict_default,
                      num_predict_max=cfg.num_predict_max, ignored=ignored,
                      operator_set=operator_sampling(gw, entry.name))
    if ignored:
        log.warning("request.options_ignored", options=ignored, request_id=request.get("request_id"))
    return out


def _images(value, where: str) -> list[str]:
    """Base64 image strings (Ollama ``images``); ApiError(400) on anything else."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, str) and i for i in value):
        raise ApiError(400, f"{where} must be a list of base64 strings")
    return value


def _image_mime(b64: str) -> str:
    head = b64[:16]
    if head.startswith("iVBOR"):
        return "image/png"
    if head.startswith("R0lG"):
        return "image/gif"
    if head.startswith("UklG"):
        return "image/webp"
    return "image/jpeg"


def _messages(body: dict) -> tuple[list[dict], bool]:
    """Ollama chat messages → OpenAI-style messages for llama-server; also whether any image came."""
    msgs = body.get("messages")
    if msgs is None:
        return [], False
    if not isinstance(msgs, list):
        raise ApiError(400, "messages must be a list")
    out, any_image = [], False
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string")
        content = m.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string")
        for k in ("thinking", "tool_name", "tool_call_id"):  # Ollama's string fields
            if m.get(k) is not None and not isinstance(m[k], str):
                raise ApiError(400, f"messages[{i}].{k} must be a string")
        images = _images(m.get("images"), f"messages[{i}].images")
        msg: dict = {"role": role.lower(), "content": content}
        if images:
            any_image = True
            msg["content"] = [{"type": "text", "text": content}] + [
                {"type": "image_url", "image_url": {"url": f"data:{_image_mime(b)};base64,{b}"}}
                for b in images]
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(tc, dict) and isinstance(tc.get("function"), dict)
                for tc in calls)):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list of objects, each with "
                                f"an object function")
        if calls:
            msg["tool_calls"] = [
                {"id": tc.get("id") or f"call_{i}_{j}", "type": "function",
                 "function": {"name": (tc.get("function") or {}).get("name", ""),
                              "arguments": _args_text((tc.get("function") or {}).get("arguments"))}}
                for j, tc in enumerate(calls)]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out, any_image


def _args_text(args) -> str:
    """Ollama tool-call ``arguments`` (an object) → the JSON string llama-server expects."""
    if isinstance(args, str):
        return args
    return orjson.dumps(args if args is not None else {}).decode()


async def _think_default(gw, entry: ModelEntry, think, fmt) -> object:
    """``/api/chat``'s ``think`` as the template gets it: left out on a model with the
    ``thinking`` capability, True, as Ollama forces it (routes.go;
    shared/reference/ollama-api.md). The worker's own default was off for templates
    llama-server does not take for reasoning ones, so such a model never thought unless asked
    (a fresh tester's find). Not with a ``format``, whose grammar would cover the reasoning
    too; as before."""
    if think is None and not fmt and "thinking" in await model_capabilities(gw, entry):
        return True
    return think


async def _thinking_split(gw, entry: ModelEntry, think,
                          prompt: str | None) -> ThinkingSplit | None:
    """Ollama's thinking parser for an answer with ``think`` on, when the model's chat template
    names its reasoning tags (``thinking_split.think_tags``), else None. A ``prompt`` (the
    rendered text sent to ``/completion``) that ends with the opening tag has opened the
    reasoning already (Ollama GenerateHandler: the tag is fed to the parser first). ``/api/chat``
    does not see its rendered prompt (None): whether the template ends its generation prompt
    with the opening tag (DeepSeek-R1 style) is learned once per worker process from a rendered
    sample chat; the reasoning and its closing tag came back in ``content`` from a worker that
    does not take such a template for a reasoning one (a fresh tester's find)."""
    if think is None or think is False:
        return None
    tags = think_tags(await model_template(gw, entry))
    if tags is None:
        return None
    split = ThinkingSplit(*tags)
    if prompt is None:
        opens = await _template_opens(gw, entry, tags[0])
    else:
        opens = prompt.rstrip().endswith(tags[0])
    if opens:
        split.add(tags[0])
        split.raw.clear()  # the prompt's, not the answer's
    return split


async def _template_opens(gw, entry: ModelEntry, opening: str) -> bool:
    """Whether ``entry``'s template ends its generation prompt with ``opening`` (cached in
    ``ModelEntry.opens_reasoning``; a failed render is asked again next time)."""
    if entry.opens_reasoning is None:
        try:
            sample = await apply_template(gw, entry.name, [{"role": "user", "content": "hi"}],
                                          chat_template_kwargs={"enable_thinking": True})
        except UpstreamError:
            return False
        entry.opens_reasoning = sample.rstrip().endswith(opening)
    return entry.opens_reasoning


def _think_kwargs(think) -> dict:
    """Ollama runner: ``think`` → ``chat_template_kwargs {enable_thinking, reasoning_effort?}``."""
    if think is None:
        return {}
    kw: dict = {"enable_thinking": think is not False}
    if isinstance(think, str):
        kw["reasoning_effort"] = think
    return {"chat_template_kwargs": kw}


async def _common_checks(gw, body: dict, entry: ModelEntry, kind: str):
    """Validation shared by generate and chat; returns (think, logprobs, top_logprobs, keep_alive_s).
    A ``think`` left out is None here (see :func:`_think_default`)."""
    for k in ("truncate", "shift"):  # ignored (README), but booleans in Ollama's API
        optional(body, k, bool, "a boolean")
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    think = parse_think(body.get("think"))
    lp, top = parse_logprobs(body)
    await require(gw, entry, kind, body["model"])
    if think is not None and think is not False:
        await require(gw, entry, "thinking", body["model"])
    return think, lp, top, keep_alive


def _done_only(gw, entry: ModelEntry, name: str, keep_alive: float | None,
               chat: bool) -> web.Response:
    """Ollama's answer to an empty prompt / empty messages: load (or unload with keep_alive 0).
    A load while the model cannot serve (every worker failed or drained, the gateway shutting
    down: admission's ``Unavailable``) gets the 503 a real request gets, as Ollama answers a
    load that fails with an error; a full queue does not refuse it (it runs nothing)."""
    reason = "unload" if is_unload(keep_alive) else "load"
    why = gw.admission.would_refuse(entry.name) if reason == "load" else None
    if isinstance(why, Unavailable):
        return _refused(gw, why)
    entry.touch(keep_alive)
    obj = {"model": name, "created_at": now_utc_z()}
    if chat:
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    obj.update(done=True, done_reason=reason)
    return web.json_response(obj, dumps=_dumps)


async def _relay(request: web.Request, entry: ModelEntry, path: str, upstream_body: dict,
                 stream: bool, chunk, final, echoed: str = "",
                 split: ThinkingSplit | None = None):
    """Run one generation on a leased worker and answer in Ollama's shape.

    ``chunk(st, content, thinking) -> dict`` builds a ``done:false`` object for a piece;
    ``final(st) -> dict`` (may be a coroutine) the ``done:true`` object. Errors before the first
    byte are HTTP errors; after it, an ``{"error": …}`` line ends the stream (Ollama routes.go
    streamResponse). ``echoed``: text the worker repeats at the start of its answer that is not
    part of it (:func:`_unecho`). ``split``: the reasoning tags to take out of the worker's
    content into ``thinking`` (:func:`_thinking_split`).
    """
    gw = _gw(request)
    worker_ints.bound(upstream_body, gw.context_per_slot(entry.name))
    mcfg = gw.model_config(entry.name)
    ticket = make_ticket(request, entry.name, mcfg.priority if mcfg else 0, gw.config.queue.timeout_s,
                         body=upstream_body)
    is_chat = path.endswith("chat/completions")
    out: web.StreamResponse | None = None
    first_split, first_echo = (copy.deepcopy(split) if split is not None else None), echoed
    for tries in (1, 2):
        st = StreamState(t_start_ns=t0_ns(request))
        failure: UpstreamError | None = None
        try:
            async with gw.upstream.request(ticket, path, upstream_body) as (lease, resp):
                # Ollama's load_duration ends once a runner has the request (a slot here), not
                # at the worker's headers, which come with the first token after the prefill
                # (tester S: load_duration held the whole prompt evaluation)
                st.t_loaded_ns = int(lease.granted_at * 1e9)
                note_lease(request, lease)
                fold = st.fold_chat if is_chat else st.fold_completion_pair
                lines: list[bytes] = []
                # built while the worker computes, started with the first line (TTFT path)
                ready = ndjson_response(request) if stream else None

                def take(content: str, thinking: str) -> None:
                    if content or thinking:
                        if stream:
                            lines.append(orjson.dumps(chunk(st, content, thinking)))
                        else:
                            st.content.append(content)
                            if thinking:
                                st.thinking.append(thinking)

                async def write_lines() -> None:  # the batch in one write (one syscall)
                    nonlocal out
                    if out is None:
                        out = await prepare_ndjson(request, ready)
                    lines.append(b"")
                    await out.write(ndjson_safe(b"\n".join(lines)))  # newline-delimited
                    lines.clear()

                answers = iter_sse_batches(resp) if upstream_body.get("stream", True) \
                    else _whole_answer(resp)
                async for batch in answers:
                    note_first_byte(request)
                    st.created_at = now_utc_z()  # one timestamp per network read, not per token
                    for data in batch:
                        content, thinking = fold(orjson.loads(data))
                        if st.error:
                            break
                        if echoed and content:
                            content, echoed = _unecho(content, echoed)
                        if split is not None and thinking and split.untouched():
                            split = None  # the worker splits the reasoning itself
                        if split is not None and content:
                            more, content = split.add(content)
                            thinking += more
                        take(content, thinking)
                    if lines:
                        await write_lines()
                    if st.error:
                        break
                if split is not None and not st.error:
                    thinking, content = split.end()
                    take(content, thinking)
                    if lines:
                        await write_lines()
        except (Unavailable, QueueFull, QueueTimeout) as e:  # admission will not run it
            return _refused(gw, e)
        except UpstreamError as e:
            failure = e
            st.error, st.error_status = upstream_error_text(e)
        if tries == 1 and out is None and failure is not None \
                and answer_again(gw, ticket, failure, request):
            split, echoed = (copy.deepcopy(first_split) if first_split else None), first_echo
            continue
        break
    if st.error:
        note_upstream_error(request, st.error, out is not None, failure)
        if out is None:
            return ollama_error(st.error_status, st.error,
                                upstream_headers(st.error_status, gw.config.queue.retry_after_s))
        return await _end_with_error(out, st.error)
    obj = final(st)
    if hasattr(obj, "__await__"):
        try:
            obj = await obj
        except Unavailable as e:  # the model's workers failed while it generated
            return _refused(gw, e) if out is None else await _end_with_error(out, str(e))
        except UpstreamError as e:  # e.g. /tokenize for ``context`` failed
            msg, status = upstream_error_text(e)
            return ollama_error(status, msg) if out is None else await _end_with_error(out, msg)
    request["eval_count"], request["prompt_eval_count"] = obj.get("eval_count"), obj.get("prompt_eval_count")
    if not stream:
        return json_body(orjson.dumps(obj))
    if out is None:
        out = await prepare_ndjson(request)
    await out.write_eof(ndjson_safe(orjson.dumps(obj)) + b"\n")  # last line and end of stream in one write
    return out


async def _whole_answer(resp):
    """A non-streamed worker answer as one batch of one payload, as ``iter_sse_batches``
    yields them: ``StreamState.fold_chat`` reads a ``message`` as a ``delta``. Raises
    UpstreamError when the connection breaks (``upstream.read_all``)."""
    yield [await read_all(resp)]


def _unecho(content: str, echoed: str) -> tuple[str, str]:
    """``content`` less what is left of ``echoed`` at its start; returns (content, the rest of
    ``echoed`` still expected). Text that does not match ends the stripping (kept whole)."""
    if content.startswith(echoed):
        return content[len(echoed):], ""
    if echoed.startswith(content):
        return "", echoed[len(content):]
    return content, ""


async def _end_with_error(out: web.StreamResponse, message: str) -> web.StreamResponse:
    """End a started NDJSON stream with Ollama's ``{"error": message}`` line (routes.go
    streamResponse); returns ``out``."""
    await out.write(ndjson_safe(orjson.dumps({"error": message})) + b"\n")
    await out.write_eof()
    return out


def _refused(gw, e: Exception) -> web.Response:
    """Admission's refusal (``QueueFull``, ``QueueTimeout`` or an ``Unavailable``, see
    ``errors.admission_error``) as Ollama's ``{"error": ...}`` with its status and Retry-After."""
    err = admission_error(e, gw.config.queue.retry_after_s)
    return ollama_error(err.status, err.message, err.headers)


#: Characters JSON may carry raw that Python's ``str.splitlines`` ends a line at, and so
#: httpx's ``iter_lines``, which the ``ollama`` Python client (and LangChain's, through it)
#: reads NDJSON with: a model's U+2028 cut the line and the client failed with
#: ``JSONDecodeError`` mid-answer (a fresh tester's find). Go's encoder, Ollama's, escapes
#: U+2028 and U+2029; U+0085 too here. orjson already escapes the other ones (below U+0020).
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"),
                (b"\xc2\x85", b"\\u0085"))


def ndjson_safe(data: bytes) -> bytes:
    """``data`` (orjson output: valid UTF-8 JSON) with :data:`_LINE_BREAKS` written as
    ``\\uXXXX`` escapes, so that no JSON line of a stream is split by a client."""
    if b"\xe2\x80" in data or b"\xc2\x85" in data:
        for raw, escaped in _LINE_BREAKS:
            data = data.replace(raw, escaped)
    return data


def ndjson_response(request: web.Request) -> web.StreamResponse:
    """A 200 ``application/x-ndjson`` stream with the no-buffering headers, not started yet
    (``common.stream_response``)."""
    return stream_response(request, "application/x-ndjson")


async def prepare_ndjson(request: web.Request,
                         out: web.StreamResponse | None = None) -> web.StreamResponse:
    """Start a 200 ``application/x-ndjson`` chunked stream with the no-buffering headers:
    ``out`` (an :func:`ndjson_response` built ahead), else a new one."""
    out = out if out is not None else ndjson_response(request)
    await out.prepare(request)
    return out


async def chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    entry = resolve_model(request, body, missing_status=400)
    stream = _stream_flag(body)
    msgs, any_image = _messages(body)
    gw = _gw(request)
    think, lp, top, keep_alive = await _common_checks(gw, body, entry, "chat")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "tools must be a list of tool objects")
    if tools:
        await require(gw, entry, "tools", body["model"])
        check_tools(tools)
    if any_image:
        await require(gw, entry, "vision", body["model"])
    name = body["model"]
    if not msgs:
        return _done_only(gw, entry, name, keep_alive, chat=True)
    entry.touch(keep_alive)
    fmt = format_fields(body.get("format"), chat=False)  # also the check of ``format``
    echoed = ""
    split = None
    if fmt and not any_image and not think:
        # Structured output as Ollama runs it: the chat template applied (with the tools, which
        # the format's grammar leaves no room to call, as on llama-server's chat route), then a
        # completion under the format's grammar. llama-server's own chat route parses the
        # finished answer once more and answered 500 "The model produced output that does not
        # match the expected peg-native format" for about a quarter of grammar-conforming
        # answers (a fresh tester's find; /api/generate, which takes this path, never failed).
        path = "/completion"
        rendered = await render_prompt(gw, entry.name, msgs, template_fields={
            **_think_kwargs(think), **({"tools": tools} if tools else {})})
        up = {"stream": True, "cache_prompt": True, "prompt": rendered,
              **_sampling(gw, request, body, entry), **fmt}
        if lp or top:
            up["n_probs"] = max(top, 1)
    else:
        path = "/v1/chat/completions"
        think = await _think_default(gw, entry, think, fmt)
        split = await _thinking_split(gw, entry, think, None)
        up = {"model": entry.name, "messages": msgs, "stream": True,
              "stream_options": {"include_usage": True}, **_sampling(gw, request, body, entry),
              **format_fields(body.get("format"), chat=True), **_think_kwargs(think)}
        if lp or top:
            up["logprobs"] = True
            up["top_logprobs"] = max(top, 1)  # as Ollama's runner: llama-server needs >= 1
        if tools:
            up["tools"] = tools
            if lp or top:
                # llama-server refuses to stream this one ("logprobs is not supported with
                # tools + stream", a 400 for every such chat, streamed or not; a fresh
                # tester's find): asked non-streamed, its answer relayed as one piece
                # (openai_fold.needs_non_streamed_upstream, as on /v1)
                up["stream"] = False
                del up["stream_options"]
        if msgs[-1]["role"] == "assistant" and isinstance(msgs[-1]["content"], str):
            # llama-server continues a last assistant message (prefill) and repeats it at the
            # start of its answer; Ollama answers with the continuation only
            echoed = msgs[-1]["content"]

    def chunk(st, content, thinking):
        msg = {"role": "assistant", "content": content}
        if thinking:
            msg["thinking"] = thinking
        obj = {"model": name, "created_at": st.created_at, "message": msg, "done": False}
        if lp or top:
            obj["logprobs"] = st.take_logprobs(top)
        return obj

    def final(st):
        msg = {"role": "assistant", "content": "".join(st.content)}
        if st.thinking:
            msg["thinking"] = "".join(st.thinking)
        if st.tool_calls:
            msg["tool_calls"] = [tool_call_out(i, tc) for i, tc in sorted(st.tool_calls.items())]
        obj = {"model": name, "created_at": now_utc_z(), "message": msg, "done": True,
               "done_reason": st.done_reason or "stop", **st.metrics()}
        if lp or top:
            obj["logprobs"] = st.take_logprobs(top)
        return obj

    return await _relay(request, entry, path, up, stream, chunk, final, echoed, split)


def _context_tokens(value, n_vocab: int) -> list[int]:
    """The ``context`` token ids, checked against the vocabulary (0 <= id < n_vocab; an id
    outside it would make the worker's /detokenize fail with a C++ range error).
    Raises ApiError(400)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in value):
        raise ApiError(400, "context must be a list of integers")
    bad = [t for t in value if t < 0 or (n_vocab and t >= n_vocab)]
    if bad:
        raise ApiError(400, f"context contains invalid token ids (e.g. {bad[0]}); the model's "
                            f"vocabulary has {n_vocab} tokens")
    return value


async def generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    entry = resolve_model(request, body, missing_status=404)
    stream = _stream_flag(body)
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string")
    system = optional(body, "system", str, "a string", "")
    suffix = optional(body, "suffix", str, "a string", "")
    template = optional(body, "template", str, "a string", "")
    raw = optional(body, "raw", bool, "a boolean", False)
    if template and not raw:  # was dropped without a word (a fresh tester's find)
        raise ApiError(400, "template is not supported by this gateway: prompts are rendered "
                            "with the model's own chat template (a --chat-template-file in the "
                            "model's args sets another); render the prompt yourself and send it "
                            "with raw: true")
    context = _context_tokens(body.get("context"), entry.facts.n_vocab)
    if raw and (system or template or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    images = _images(body.get("images"), "images")
    gw = _gw(request)
    think, lp, top, keep_alive = await _common_checks(gw, body, entry, "generate")
    fmt = format_fields(body.get("format"), chat=False)  # its 400 before any availability
    # answer, as /api/chat (a fresh tester's find)
    if suffix:
        await require(gw, entry, "insert", body["model"])
    if images:
        await require(gw, entry, "vision", body["model"])
    name = body["model"]
    if not prompt and not suffix:
        return _done_only(gw, entry, name, keep_alive, chat=False)
    entry.touch(keep_alive)
    sampling = _sampling(gw, request, body, entry)
    msgs = None  # raw and suffix (FIM) prompts go as they are
    if not raw and not suffix:
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
    if think is None and not fmt and not suffix and think_tags(await model_template(gw, entry)):
        # left out: on, as Ollama forces it (and /api/chat here), where the answer can be split;
        # a template without known tags keeps the worker's default, or the reasoning would
        # land in ``response``
        think = True
    rendered = await render_prompt(gw, entry.name, msgs, template_fields=_think_kwargs(think),
                                   text=prompt, context=context)
    split = None if suffix else await _thinking_split(gw, entry, think, rendered)
    up: dict = {"stream": True, "cache_prompt": True, **sampling, **fmt}
    if lp or top:
        up["n_probs"] = max(top, 1)
    if suffix:
        path = "/infill"
        up.update(input_prefix=rendered, input_suffix=suffix, prompt="")
    else:
        path = "/completion"
        if images:
            up["prompt"] = {"prompt_string": MEDIA_MARKER * len(images) + rendered,
                            "multimodal_data": images}
        else:
            up["prompt"] = rendered

    def chunk(st, content, thinking):
        obj = {"model": name, "created_at": st.created_at, "response": content, "done": False}
        if thinking:
            obj["thinking"] = thinking
        if lp or top:
            obj["logprobs"] = st.take_logprobs(top)
        return obj

    async def final(st):
        response = "".join(st.content)
        obj = {"model": name, "created_at": now_utc_z(), "response": "",
               "done": True, "done_reason": st.done_reason or "stop"}
        if not stream:
            obj["response"] = response
        if st.thinking:
            obj["thinking"] = "".join(st.thinking)
        if not raw:  # Ollama tokenizes the answer as generated, reasoning and tags included
            said = "".join(split.raw) if split is not None else response
            try:
                obj["context"] = await tokenize(gw, entry.name, rendered + said,
                                                prefer=request.get("worker"))
            except UpstreamError as e:
                # the answer is whole: it ends with its done object, without ``context``,
                # rather than an error in its place (a fresh tester's find: a stream of a
                # finished answer ended with an error line as the only worker that could
                # tokenize it crashed)
                log.warning("generate.context_failed", request_id=request.get("request_id"),
                            model=entry.name, error=e.message)
        obj.update(st.metrics())
        if lp or top:
            obj["logprobs"] = st.take_logprobs(top)
        return obj

    if stream and split is None:
        # The final object needs the whole response for ``context``: keep the pieces.
        def chunk_keep(st, content, thinking):
            st.content.append(content)
            return chunk(st, content, thinking)
        return await _relay(request, entry, path, up, stream, chunk_keep, final)
    return await _relay(request, entry, path, up, stream, chunk, final, split=split)


def _dumps(obj) -> str:
    return orjson.dumps(obj).decode()


async def tags(request: web.Request) -> web.Response:
    gw = _gw(request)
    models = []
    names = visible_names(request)  # aliases listed as Ollama lists copies
    entries = list({id(e): e for e, _, _ in names}.values())
    digests = dict(zip(map(id, entries),
                       await asyncio.gather(*(e.digest_soon() for e in entries))))
    for e, name, _ in names:  # the digest waits overlap
        models.append({"name": name, "model": name, "modified_at": e.modified_at.isoformat(),
                       "size": e.size, "digest": digests[id(e)], "details": e.details(),
                       "capabilities": await model_capabilities(gw, e)})
    return web.json_response({"models": models}, dumps=_dumps)


#: supervisor states in which a worker has no model loaded nor is about to (``/api/ps``)
_NOT_LOADED = frozenset({"failed", "stopped"})


async def ps(request: web.Request) -> web.Response:
    """Every served model with a worker (the gateway keeps them loaded; a model with none, as
    none is planned here or a reload could not start it, is not), sorted by ``expires_at``
    descending. A model whose every worker is ``stopped`` is not listed. One whose workers are
    all crash-loop ``failed`` is, with their state and detail ("crash loop: …; next try in N
    s") and no ``size_vram``: field case 13 asks that ``/api/ps`` show a worker that cannot
    start (hiding it, as Ollama lists only loaded models, left ``ollama ps`` empty with no word
    why; a fresh tester's find).

    ``expires_at``: never, as Ollama shows a model kept forever (``ModelEntry.expires_at``: about
    292 years after the last request), since the gateway does not unload whatever ``keep_alive``
    says; the most recently used model comes first. ``size_vram`` is 0 for CPU workers, else
    the file size per GPU worker. ``context_length`` is the per-slot context read from ``/slots``.
    """
    gw = _gw(request)
    models = []
    entries = visible_entries(request)
    digests = await asyncio.gather(*(e.digest_soon() for e in entries))  # waits overlap
    for e, digest in zip(entries, digests):
        workers = [w for w in gw.fleet.supervisors.values() if w.spec.alias == e.name]
        if not workers:  # no worker planned here, or a reload's that did not start: not loaded
            continue
        if all(w.state == "stopped" for w in workers):
            continue
        gpu_workers = [w for w in workers if w.spec.gpus and w.state not in _NOT_LOADED]
        models.append({
            "name": e.name, "model": e.name, "size": e.size, "digest": digest,
            "details": e.details(),
            "expires_at": e.expires_at(_STARTED_AT).isoformat(),
            "size_vram": e.size * len(gpu_workers),
            "context_length": gw.context_per_slot(e.name),
            # "draining" as /gateway/api/workers says it: "ready" while every request of the
            # model got 503 "drained" (a fresh tester's find)
            "workers": [{"id": w.id, "state": worker_state(gw, w), "detail": w.detail_now,
                         "gpus": list(w.spec.gpus),
                         "slots": getattr(w, "actual_slots", w.spec.slots),  # as /slots says
                         "restarts": w.restarts} for w in workers],
        })
    models.sort(key=lambda m: m["expires_at"], reverse=True)
    return web.json_response({"models": models}, dumps=_dumps)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_COMPAT_VERSION,
                              "gateway": f"llama-gateway {__version__}"}, dumps=_dumps)


async def _model_info(entry: ModelEntry, ctx: int, verbose: bool) -> dict:
    """GGUF key/values as Ollama's ``model_info``: arrays longer than 5 emptied (``[]``), or
    whole with ``verbose``; always includes ``general.architecture``,
    ``general.parameter_count`` and the context length."""
    mi = {k: v for k, v in entry.facts.kv.items() if v is not None and not k.startswith("tokenizer.chat")}
    if verbose:
        try:
            mi.update(await asyncio.to_thread(GGUFFacts.read_long_arrays, entry.path))
        except (OSError, ValueError) as e:  # the file changed since the gateway started
            raise ApiError(500, f"cannot read {entry.path}: {e}") from None
    arch = entry.facts.architecture or "unknown"
    mi["general.architecture"] = arch
    mi["general.parameter_count"] = entry.facts.n_params
    mi.setdefault(f"{arch}.context_length", entry.context_length or ctx)
    return mi


async def show(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not body.get("model") and body.get("name"):
        body["model"] = body["name"]
    entry = resolve_model(request, body, missing_status=400)
    verbose = body.get("verbose")
    if verbose is not None and not isinstance(verbose, bool):  # Ollama: a JSON unmarshal 400
        raise ApiError(400, "verbose must be a boolean")
    gw = _gw(request)
    ctx = gw.context_per_slot(entry.name)
    caps = await model_capabilities(gw, entry)
    template = entry.worker_template if entry.worker_template is not None else entry.facts.chat_template
    mcfg = gw.model_config(entry.name)
    params = [f"num_ctx                        {ctx}"]
    if gw.config.generation.num_predict_default != -1:
        params.append(f"num_predict                    {gw.config.generation.num_predict_default}")
    args = " ".join(mcfg.args) if mcfg and mcfg.args else ""
    return web.json_response({
        "license": str(entry.facts.kv.get("general.license") or ""),
        "modelfile": f"# served by llama-gateway from gateway.yaml\nFROM {entry.path}\n"
                     + (f"# llama-server args: {args}\n" if args else ""),
        "parameters": "\n".join(params),
        "template": template, "system": "", "details": entry.details(),
        "model_info": await _model_info(entry, ctx, verbose is True),
        "capabilities": caps,
        "modified_at": entry.modified_at.isoformat(),
    }, dumps=_dumps)


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running", content_type="text/plain")


def routes() -> list[web.RouteDef]:
    """GET routes answer HEAD too (aiohttp ``allow_head``), as Ollama's ``HEAD /`` heartbeat needs."""
    return [
        web.get("/", root),
        web.post("/api/generate", generate), web.post("/api/chat", chat),
        web.get("/api/tags", tags), web.get("/api/ps", ps), web.get("/api/version", version),
        web.post("/api/show", show),
    ]
