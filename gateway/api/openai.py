"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

llama-server already speaks this dialect, so completions are relayed: the request body goes up
with the model name canonicalised; a stream is relayed event by event with usage normalised
(see ``_relay_stream``). A non-streamed request is streamed from the worker too and folded into
the object llama-server would have answered (``openai_fold``), so a client that leaves stops
the worker within about 0.5 s and the first-byte watchdog covers it; only chat with
``logprobs`` and ``tools``, which llama-server refuses to stream, goes up non-streamed. A chat
with a JSON ``response_format`` runs as a completion of the rendered chat template
(``openai_structured``).
``/v1/completions`` answers get OpenAI's legacy ``logprobs`` shape and ``cmpl-`` ids
(``openai_legacy``).
Errors use the OpenAI error object (Ollama openai.NewError shape); a model that is not served
or that the API key may not use is OpenAI's 404 ``model_not_found``
(gateway/api/errors.py ``model_not_found_v1``).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from gateway.admission import QueueFull, QueueTimeout, Unavailable
from gateway.scheduling import ModelRemoved
from gateway.api.common import (make_ticket, note_upstream_error, operator_sampling,
                                read_json, start_stream, visible_names)
from gateway.api import openai_checks, openai_structured, worker_ints
from gateway.api.answer_again import answer_again
from gateway.api.capabilities import model_capabilities
from gateway.api.errors import (admission_error, json_body, model_not_found_v1, openai_error,
                                openai_error_body, resolve_v1_model, upstream_headers)
from gateway.api.ollama_mapping import OLLAMA_DEFAULTS
from gateway.config import normalize_model_name
from gateway.api.openai_fold import OpenAIFold, needs_non_streamed_upstream
from gateway.api.openai_legacy import LegacyCompletions, check_logprobs
from gateway.api.openai_usage import UsageSum
from gateway.api.render import render_prompt
from gateway.metrics import note_first_byte, note_lease, note_openai_usage, note_usage
from gateway import sizing
from gateway.upstream import UpstreamError, error_event, iter_sse_batches, read_all


def _gw(request: web.Request):
    return request.app["gw"]


async def _relay_completion(request: web.Request, path: str, required: str) -> web.StreamResponse:
    gw = _gw(request)
    body = await read_json(request)
    entry = resolve_v1_model(gw.inventory, body)
    stream, so, include_usage = await openai_checks.check_request(gw, entry, body, required)
    asked = body["model"]  # answers name the model as asked, as Ollama's /v1 and /v1/embeddings
    body["model"] = entry.name
    # llama-server names the model it was sent (the canonical name); the events are relayed as
    # bytes, so the name is swapped in them as bytes (JSON-escaped text cannot contain it)
    rename = None if asked == entry.name else (_model_field(entry.name), _model_field(asked))
    convert = None  # a completion's events turned into chat chunks (openai_structured)
    legacy = None  # /v1/completions: OpenAI's legacy logprobs and id (openai_legacy)
    # logprobs without alternatives: llama-server sends no logprobs at all for top_logprobs
    # 0 (its n_probs 0) and 20 alternatives when it is not given; OpenAI and Ollama's /v1
    # send each token's with top_logprobs [] for both (fresh testers' finds). One alternative
    # is asked for and dropped from the answer.
    no_tops = required == "messages" and body.get("logprobs") is True \
        and body.get("top_logprobs") in (None, 0)
    if no_tops:
        body["top_logprobs"] = 1
    prefilled_format = required == "messages" and openai_structured.prefilled_format(body)
    if required == "messages":
        body, path, convert = await _chat_route(gw, entry, body, path)
    else:
        openai_structured.completions_format(body)
        legacy = LegacyCompletions(check_logprobs(body))
    # A non-streamed request is streamed from the worker and folded (module doc); its
    # stream_options change nothing the client sees, as llama-server ignores them then.
    per_prompt = sizing.choices(body)  # tasks per prompt, which groups the usages to sum
    fold = None if stream or needs_non_streamed_upstream(body, required == "messages") else \
        OpenAIFold(chat=required == "messages", per_prompt=per_prompt)
    if stream or fold is not None:  # always ask upstream; the client's view is decided in _relay_stream
        body["stream"] = True
        body["stream_options"] = {**(so or {}), "include_usage": True}
    _bound_max_tokens(gw, body)
    operator_set = operator_sampling(gw, entry.name)
    for k, v in V1_SAMPLING_DEFAULTS.items():
        if body.get(k) is None and k not in operator_set:
            body[k] = v
    worker_ints.bound(body, gw.context_per_slot(entry.name))
    entry.touch(None)
    mcfg = gw.model_config(entry.name)
    ticket = make_ticket(request, entry.name, mcfg.priority if mcfg else 0, gw.config.queue.timeout_s,
                         body=body)
    if required == "prompt" or convert is not None:  # after the ticket: the same slots, and
        spread_empty_prompts(body)                      # n's own limit still checked
    out: web.StreamResponse | None = None
    started: list[web.StreamResponse] = []  # the client's stream, once its first event is out
    for tries in (1, 2):
        if tries == 2:  # the answer again (answer_again): its folding state afresh
            if fold is not None:
                fold = OpenAIFold(chat=required == "messages", per_prompt=per_prompt)
            if convert is not None:
                convert = openai_structured.ChatChunks()
            if legacy is not None:
                legacy = LegacyCompletions(legacy.top)
        try:
            async with gw.upstream.request(ticket, path, body) as (lease, resp):
                note_lease(request, lease)
                if fold is not None:
                    answer = await _fold_stream(request, resp, fold, convert)
                    if legacy is not None:
                        legacy.answer(answer)
                    answer["model"] = asked
                    if no_tops:
                        _clear_top_logprobs(answer)
                    note_usage(request, answer["usage"])
                    return json_body(orjson.dumps(answer))
                if not stream:
                    data = await read_all(resp)
                    note_openai_usage(request, data)
                    if rename is not None:
                        data = data.replace(*rename)
                    if no_tops:
                        data = orjson.dumps(_clear_top_logprobs(orjson.loads(data)))
                    return json_body(data)
                if not resp.progress and not started:
                    # A short prompt: its stream starts with the worker's headers, as before its
                    # first token (0.08-0.12 ms of TTFT on the 2-core development machine, README
                    # "Same-run comparisons"); a long one with its first event (_relay_stream).
                    started.append(await start_stream(request, "text/event-stream"))
                await _relay_stream(request, resp, started, include_usage, UsageSum(per_prompt),
                                    legacy.events if legacy is not None else convert,
                                    chat=per_prompt if required == "messages" and convert is None
                                    else 0, rename=rename, no_tops=no_tops)
                out = started[0]
        except (Unavailable, QueueFull, QueueTimeout) as e:  # admission will not run it
            # a model a reload removed while this waited: OpenAI's own words, as for a request
            # that names it afterwards, and the name as asked (a fresh tester's find)
            err = model_not_found_v1(asked) if isinstance(e, ModelRemoved) else \
                admission_error(e, gw.config.queue.retry_after_s)
            return openai_error(err.status, err.message, err.headers, code=err.code, type=err.type)
        except UpstreamError as e:
            if prefilled_format and e.status == 400 and \
                    e.message.startswith(openai_structured.SAMPLER_INIT_FAILED):
                e.message = openai_structured.PREFILL_OUTSIDE_FORMAT + e.message
            # nothing of the answer out yet (a stream's headers at most): once more elsewhere
            if tries == 1 and not request.get(_EVENTS_OUT) and answer_again(gw, ticket, e, request):
                continue
            out = started[0] if started else None
            status = 400 if e.kind == "exceed_context_size_error" else (
                e.status if 400 <= e.status < 500 or e.status in (502, 503, 504) else 500)
            note_upstream_error(request, e.message, out is not None, e)
            if out is None:
                return openai_error(status, e.message,
                                    upstream_headers(status, gw.config.queue.retry_after_s))
            await out.write(_sse(openai_error_body(status, e.message)))
        break
    await out.write_eof()
    return out


#: Request key set once an event of the answer was written to the client's stream: from then
#: on a broken answer is not run again.
_EVENTS_OUT = "v1_events_out"


async def _chat_route(gw, entry, body: dict, path: str):
    """Where a chat ``body`` runs: llama-server's chat route (``body``, ``path``, None) or a
    completion of its rendered template (the completion body, ``/v1/completions``, a
    ``ChatChunks`` converter) for a JSON ``response_format`` or for ``n`` ≥ 2 with a chat that
    renders to nothing (gateway/api/openai_structured.py). Raises ApiError from the render."""
    schema = openai_structured.completion_schema(body)
    structured = schema is not None and "thinking" not in await model_capabilities(gw, entry)
    if not structured and sizing.choices(body) < 2:
        return body, path, None
    prompt = await render_prompt(gw, entry.name, body["messages"],
                                 template_fields=openai_structured.template_fields(body))
    if not structured and prompt:
        return body, path, None
    return (openai_structured.completion_body(body, prompt, schema if structured else None),
            "/v1/completions", openai_structured.ChatChunks())


#: Sampling of a ``/v1`` request that leaves these fields out (or null), as Ollama's ``/v1``
#: samples it: its ``DefaultOptions`` (api/types.go, ``ollama_mapping.OLLAMA_DEFAULTS``) with
#: ``temperature`` and ``top_p`` 1.0, OpenAI's defaults (openai/openai.go ``FromChatRequest`` /
#: ``FromCompleteRequest``). llama-server's own (temperature 0.8, top_p 0.95, min_p 0.05) made
#: the same request sample differently than behind Ollama (a fresh tester's find).
V1_SAMPLING_DEFAULTS = {**{k: v for k, v in OLLAMA_DEFAULTS.items() if k not in ("num_keep", "seed")},
                        "temperature": 1.0, "top_p": 1.0}


# llama-server extensions a client must not set through the gateway: ``id_slot`` would pin a
# slot the gateway's accounting may have leased to another request.
_GATEWAY_OWNED = ("id_slot",)


#: The generation-budget keys llama-server reads (it prefers ``n_predict``).
_BUDGET_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")


def _bound_max_tokens(gw, body: dict) -> None:
    """``max_tokens`` (or ``max_completion_tokens``) bounded by config.generation: the default
    when absent, the maximum when over it or unbounded. llama-server's own ``n_predict`` (which
    it prefers to ``max_tokens``) is bounded the same way, so the cap cannot be bypassed. A
    ``max_tokens`` / ``max_completion_tokens`` of 0 is no limit, as Ollama's ``/v1`` runs it.
    Raises ApiError(400) for a non-integer or out-of-range value."""
    gen = gw.config.generation
    cap = gen.num_predict_max
    for k in _GATEWAY_OWNED:
        body.pop(k, None)
    # Whichever of the three keys llama-server ends up using, each present one is bounded
    # (a null counts as absent); with none, max_tokens carries the default.
    budgeted = False
    for k in _BUDGET_KEYS:
        if k not in body:
            continue
        v = body[k]
        if v is None:
            del body[k]
            continue
        openai_checks.check_int(k, v)
        budgeted = True
        if v == 0 and k != "n_predict":  # Ollama's /v1 sends it as num_predict 0: no limit
            v = body[k] = -1              # (llama-server made 1 token; n_predict is its own)
        if cap is not None and (v < 0 or v > cap):
            body[k] = cap
    if not budgeted:
        # config validation keeps num_predict_default <= num_predict_max
        if gen.num_predict_default > 0:
            body["max_tokens"] = gen.num_predict_default
        elif cap is not None:
            body["max_tokens"] = cap


def _is_empty_prompt(p) -> bool:
    """Whether ``p``, one prompt of a ``/v1/completions`` body, has no tokens: ``""``, ``[]``,
    or llama-server's object form ``{"prompt_string": ..., "multimodal_data": [...]}`` with an
    empty ``prompt_string`` (``""`` or ``[]``, a mixed list) and no (or empty/null)
    ``multimodal_data`` (tools/server/server-common.cpp ``tokenize_input_subprompt``; with
    files, the prompt has the files' tokens; a model without a projector answers 400 at once
    to any ``multimodal_data`` key, which a repeated prompt still gets)."""
    if p == "" or p == []:
        return True
    return isinstance(p, dict) and "prompt_string" in p \
        and p["prompt_string"] in ("", []) and not p.get("multimodal_data")


def spread_empty_prompts(body: dict) -> None:
    """Rewrite a ``/v1/completions`` body with ``n`` (or ``n_cmpl``) ≥ 2 and an empty prompt
    (:func:`_is_empty_prompt`: ``""``, ``{"prompt_string": ""}``, or one of those or ``[]`` in
    a list of prompts) into the same prompts each repeated ``n`` times, with ``n`` 1. The
    pinned llama-server never answers the original: the extra choices of a prompt wait for its
    evaluation to be copied to them, and a prompt with no tokens is never evaluated (seen on
    the pinned build, standalone: choice 0 comes, then nothing). The repeated prompts give the
    same choices in the same order (prompt-major indexes, prompt ``p``'s copies at ``p * n`` …
    ``p * n + n - 1``), on as many slots. Other bodies are left as they are (``"prompt": []``
    is answered 400 by llama-server at once)."""
    n = sizing.choices(body)
    if n < 2:
        return
    prompts = sizing.prompts_of(body)
    if prompts is None:
        p = body.get("prompt")
        if p == [] or not _is_empty_prompt(p):
            return
        prompts = [p]
    elif not any(_is_empty_prompt(p) for p in prompts):
        return
    body["prompt"] = [p for p in prompts for _ in range(n)]
    body.pop("n_cmpl", None)
    body["n"] = 1


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _model_field(name: str) -> bytes:
    """``"model":"<name>"`` as llama-server's compact JSON (and orjson) write it."""
    return b'"model":' + orjson.dumps(name)


async def _relay_stream(request: web.Request, resp, started: list,
                        include_usage: bool, usage: UsageSum, convert=None,
                        chat: int = 0, rename: tuple[bytes, bytes] | None = None,
                        no_tops: bool = False) -> None:
    """Relay upstream SSE events, normalising usage (OpenAI ``stream_options.include_usage``):
    with it, usage comes only in a last chunk with ``choices: []`` before ``[DONE]``; without
    it, no usage at all. llama-server's ``/v1/completions`` puts usage on the finish chunk
    itself, which is split off here. With several tasks (``n > 1``, several prompts) llama-server
    sends a usage per task, in the middle of the stream; they are summed into ``usage`` (the
    whole request's, as OpenAI reports it: ``openai_usage``) and sent once, last, in the head
    (``id``, ``created``, …) of the first. llama-server's ``data: null`` events (it
    starts a several-prompt stream with one) are dropped: OpenAI never sends them and its
    client fails on them. An upstream ``{"error": …}`` event ends the stream (raised as
    UpstreamError so the caller writes an OpenAI error event).

    Unless the caller started it, the client's 200 stream starts (``start_stream``, appended to
    ``started``) with the first event to send: a failure before it, such as ``first_byte_s``
    running out while the worker computes a long prompt (its stream has begun: headers and
    progress events), is still answered with its status and an OpenAI error object.
    ``convert``: applied to each batch of payloads first (``openai_structured.ChatChunks``, or
    ``openai_legacy.LegacyCompletions.events`` for ``/v1/completions``).

    ``chat``: the number of choices of a chat stream (0: not a chat). llama-server sends a
    choice's ``{"role": "assistant"}`` delta only with its first token's event or in the
    prompt-progress events (server-task.cpp ``to_json_oaicompat_chat_stream``: ``first ||
    is_progress``, ``first`` being ``n_decoded == 1``). The gateway drops the progress events (it
    asked for them, the client did not), and a first token that ends inside a UTF-8 character
    sends no event at all, so a choice could start without its role (3 of 40 seeds on the demo
    model; the ``openai`` client's stream helper then builds a message with ``role`` None; a
    fresh tester's find). A role chunk is put before each choice's first chunk that has none.

    ``rename``: (``"model":"<canonical>"``, ``"model":"<asked>"``) as bytes, swapped in every
    write, or None. ``no_tops``: each logprobs entry's ``top_logprobs`` is emptied
    (:func:`_clear_top_logprobs`)."""
    head: dict | None = None  # the first usage event, less its choices, usage and timings
    roles_due = set(range(chat))  # choices whose role has not been sent yet

    async def write(data: bytes) -> None:
        if not started:
            started.append(await start_stream(request, "text/event-stream"))
        request[_EVENTS_OUT] = True
        await started[0].write(data.replace(*rename) if rename is not None else data)

    async for batch in iter_sse_batches(resp):
        note_first_byte(request)
        if convert is not None:
            batch = convert(batch)
        parts: list[bytes] = []
        for data in batch:
            if no_tops and b'"top_logprobs"' in data:
                data = orjson.dumps(_clear_top_logprobs(orjson.loads(data)))
            if chat and b'"role"' in data and b'"error"' not in data:
                data = _without_repeated_roles(data, roles_due)
                if data is None:
                    continue
            if roles_due and data != b"null" and b'"error"' not in data:
                ev = orjson.loads(data)
                lacking = []
                for c in ev.get("choices") or ():
                    i = c.get("index", 0)
                    if i in roles_due:
                        roles_due.discard(i)
                        if "role" not in (c.get("delta") or {}):
                            lacking.append(i)
                if lacking:
                    parts.append(_sse(_role_chunk(ev, lacking)))
            if b'"usage"' not in data and b'"error"' not in data:
                if data != b"null":
                    parts.append(b"data: " + data + b"\n\n")  # hot path: pass it through
                continue
            ev = orjson.loads(data)
            if "error" in ev:
                if parts:
                    await write(b"".join(parts))
                raise error_event(ev["error"])
            task_usage = ev.pop("usage", None)
            if ev.get("choices"):
                parts.append(_sse(ev))
            if task_usage is not None:
                usage.add(task_usage, ev["choices"][0].get("index") if ev.get("choices") else None)
                note_usage(request, usage.total())
                if head is None:
                    head = {k: v for k, v in ev.items() if k not in ("choices", "timings")}
        if parts:  # everything that arrived together goes out in one write
            await write(b"".join(parts))
    last = b""
    if include_usage and head is not None:
        last = _sse(head | {"choices": [], "usage": usage.total()})
    await write(last + b"data: [DONE]\n\n")


def _clear_top_logprobs(ev: dict) -> dict:
    """Chat answer or chunk ``ev`` (changed in place and returned) with every
    ``choices[].logprobs.content[].top_logprobs`` empty: OpenAI's answer for
    ``top_logprobs: 0``."""
    for c in ev.get("choices") or () if isinstance(ev, dict) else ():
        for e in (c.get("logprobs") or {}).get("content") or ():
            if isinstance(e, dict):
                e["top_logprobs"] = []
    return ev


def _without_repeated_roles(data: bytes, roles_due: set[int]) -> bytes | None:
    """Chat chunk ``data`` without a ``role`` delta of a choice whose role was sent already (not
    in ``roles_due``), or None when nothing else is left of it. With the prompt-progress events
    the gateway asks for, llama-server sends a choice's role chunk twice, once ahead and once
    with its first token (server-task.cpp ``first || is_progress``), and the client got both
    (a fresh tester's find)."""
    ev = orjson.loads(data)
    if not isinstance(ev, dict):
        return data
    kept, changed = [], False
    for c in ev.get("choices") or ():
        delta = c.get("delta") or {}
        if "role" in delta and c.get("index", 0) not in roles_due:
            changed = True
            delta = {k: v for k, v in delta.items() if k != "role"}
            if not any(v is not None for v in delta.values()) and c.get("finish_reason") is None \
                    and not c.get("logprobs"):
                continue
            c = {**c, "delta": delta}
        kept.append(c)
    if not changed:
        return data
    if not kept and not ev.get("usage"):
        return None
    return orjson.dumps({**ev, "choices": kept})


def _role_chunk(ev: dict, indices: list[int]) -> dict:
    """The ``{"role": "assistant", "content": null}`` chunk llama-server starts a chat stream
    with, for the choices ``indices`` and with the head (``id``, ``created``, …) of chunk
    ``ev``."""
    head = {k: v for k, v in ev.items() if k not in ("choices", "usage", "timings")}
    return {**head, "choices": [{"finish_reason": None, "index": i,
                               "delta": {"role": "assistant", "content": None}}
                              for i in indices]}


async def _fold_stream(request: web.Request, resp, fold: OpenAIFold, convert=None) -> dict:
    """Read the worker's whole stream into ``fold``; returns the non-streamed answer object
    (``OpenAIFold.result``, which always has ``usage``). ``convert``: as ``_relay_stream``'s.
    Raises UpstreamError for an error event, a broken stream or one that ended early."""
    async for batch in iter_sse_batches(resp):
        note_first_byte(request)
        for data in convert(batch) if convert is not None else batch:
            fold.add(orjson.loads(data))
    return fold.result()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _relay_completion(request, "/v1/chat/completions", "messages")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _relay_completion(request, "/v1/completions", "prompt")


def _model_obj(e, name: str | None = None) -> dict:
    """OpenAI's model object of entry ``e`` under ``name`` (its full name, or an alias as
    configured: ``gpt-4o``, not ``gpt-4o:latest``). ``owned_by`` is the name's namespace, as
    Ollama's ``ToModel`` gives it (``model.ParseName(m).Namespace``): the part before the
    model's own, ``library`` for a bare name."""
    name = name or e.name
    parts = name.split("/")
    owner = parts[-2] if len(parts) >= 2 else "library"
    return {"id": name, "object": "model", "created": int(e.modified_at.timestamp()),
            "owned_by": owner}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list",
                              "data": [_model_obj(e, shown)
                                       for e, _, shown in visible_names(request)]},
                             dumps=lambda o: orjson.dumps(o).decode())


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the model object with ``id`` the name as asked (``Demo`` for
    ``demo:latest``), as Ollama's ``RetrieveMiddleware`` answers (``ToModel(show, c.Param("model"))``)
    and as the inference routes echo the asked name. A model that is not served and one the API
    key may not use both get OpenAI's 404 ``model_not_found``, as the inference routes answer
    them. An id that names a configured model is its metrics ``model`` label, refused or not
    (gateway.metrics)."""
    gw = _gw(request)
    name = request.match_info["model"]
    e = gw.inventory.resolve(name)
    if e is not None:
        request["model"] = e.name
    wanted = normalize_model_name(name)
    shown = next((shown for v, full, shown in visible_names(request)
                  if v is e and normalize_model_name(full) == wanted), None)
    if e is None or shown is None:
        raise model_not_found_v1(name)
    return web.json_response(_model_obj(e, name), dumps=lambda o: orjson.dumps(o).decode())


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/completions", completions),
            web.get("/v1/models", models), web.get("/v1/models/{model:.*[^/]}", model)]
