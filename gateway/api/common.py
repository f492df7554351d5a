"""Request plumbing shared by the API modules: body parsing, tickets, request ids."""

from __future__ import annotations

import gc
import json
import random
import re
import time

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.ollama_mapping import sampling_set_by
from gateway.config import PRIORITY_LIMIT
from gateway.logs import get_logger
from gateway.scheduling import Ticket, TooLarge, TooManySlots
from gateway.texts import header_text
from gateway.upstream import UpstreamError

log = get_logger("gateway.api")

STREAM_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-cache"}


#: How deep a request body's JSON may nest (objects and arrays). orjson parses up to 1,024
#: levels but writes at most 254, and the gateway forwards client values (a ``format`` schema,
#: ``tools``, unknown ``/v1`` fields) inside up to 3 levels of its own: a body nested deeper
#: than this is a 400, not a failed write to the worker.
MAX_JSON_DEPTH = 128


class JSONTooDeep(orjson.JSONDecodeError):
    """A body nested deeper than :data:`MAX_JSON_DEPTH`; reads as ``invalid JSON: …``."""

    def __str__(self) -> str:
        return self.msg


class JSONTooMany(JSONTooDeep):
    """A body with more than :data:`MAX_JSON_CONTAINERS` arrays and objects (413)."""


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value: 0 for a scalar, 1 for a flat object or array
    (a walk in Python: for tests and small values; bodies go through :func:`too_deep`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in items if isinstance(c, (dict, list)))
    return deepest


#: The deepest nesting orjson writes (its ``dumps`` raises "Recursion limit reached" past it).
ORJSON_WRITE_DEPTH = 254


def too_deep(value) -> bool:
    """Whether a parsed JSON value nests deeper than :data:`MAX_JSON_DEPTH`, found by orjson's
    own writer (C speed) on the value wrapped in ``ORJSON_WRITE_DEPTH - MAX_JSON_DEPTH``
    arrays: a walk in Python took 13.5 s for a 22 MB body of 8 million empty arrays, with the
    event loop blocked (a fresh tester's find)."""
    padded = value
    for _ in range(ORJSON_WRITE_DEPTH - MAX_JSON_DEPTH):
        padded = [padded]
    try:
        orjson.dumps(padded)
    except TypeError as e:  # orjson.JSONEncodeError
        if "Recursion limit" in str(e):
            return True
        raise
    return False


#: Most arrays and objects a request body may hold (its ``[`` and ``{`` bytes, those in
#: strings too). Each is a Python object of 56 bytes and more: a 59 KiB gzip body that
#: decompressed to 64 MiB of ``[]`` took the gateway to 1.2 GiB and blocked it for 18 s (a
#: fresh tester's find). A prompt with this many brackets in its text is past any context.
MAX_JSON_CONTAINERS = 1 << 20


def loads_body(raw: bytes):
    """A request body's JSON value (orjson). Bytes that are not valid UTF-8, and ``\\u``
    escapes of lone UTF-16 surrogates, are read as U+FFFD, as Go's ``encoding/json`` does under
    Ollama (a client that cut a multi-byte character or an emoji's surrogate pair is answered,
    not refused). Raises ``orjson.JSONDecodeError`` for anything else that is not JSON, and
    :class:`JSONTooDeep` (a subclass) for JSON nested deeper than :data:`MAX_JSON_DEPTH`
    (looked for only when the body has that many brackets and braces at all), and
    :class:`JSONTooMany` (another) for a body with more than :data:`MAX_JSON_CONTAINERS`
    of them, before it is parsed. The cyclic garbage collector is off while orjson builds the
    value: its passes over a body's million containers took 4.2 s of the 4.8 s."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise JSONTooMany(f"request body too large: more than {MAX_JSON_CONTAINERS} JSON arrays "
                          f"and objects (brackets and braces in strings count too)", "", 0)
    value = _loads(raw)
    if containers > MAX_JSON_DEPTH and too_deep(value):
        raise JSONTooDeep(f"nested more than {MAX_JSON_DEPTH} levels deep", "", 0)
    return value


def _orjson_loads(raw: bytes):
    collecting = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(raw)
    finally:
        if collecting:
            gc.enable()


def _loads(raw: bytes):
    try:
        return _orjson_loads(raw)
    except orjson.JSONDecodeError as e:
        if str(e).startswith("depth limit exceeded"):  # orjson's own limit (1,024), same words
            raise JSONTooDeep(f"nested more than {MAX_JSON_DEPTH} levels deep", "", 0) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _loads(raw.decode("utf-8", "replace").encode())
        if "surrogate" not in str(e):
            raise
        try:  # the stdlib parser keeps lone surrogates in the strings; Go writes U+FFFD
            return _no_lone_surrogates(json.loads(text, parse_constant=_not_json))
        except ValueError:
            raise e from None


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: the stdlib takes them, JSON does not


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(value):
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_no_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(v) for k, v in value.items()}
    return value


async def read_json(request: web.Request) -> dict:
    """The JSON object body. Raises ApiError(400): ``missing request body`` (empty body, as
    Ollama), ``invalid JSON: …``, or ``request body must be a JSON object``. A JSON ``null``
    gives ``{}`` (Ollama treats it as an empty request). A body the guard middleware already
    parsed (``request["json_body"]``) is not parsed again, and one it read (``raw_body``,
    decoded from its Content-Encoding: gateway/limits.py ``read_body``) is not read again."""
    parsed = request.get("json_body")
    if parsed is not None:
        return parsed
    raw = request.get("raw_body")
    if raw is None:
        raw = await request.read()
    if not raw.strip():
        raise ApiError(400, "missing request body")
    try:
        data = loads_body(raw)
    except JSONTooMany as e:
        raise ApiError(413, str(e)) from None
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


#: An ``X-Request-ID`` the gateway takes over: 1–128 characters of letters, digits and
#: ``-_.:/+=@`` (UUIDs, hex, base64, OpenTelemetry-style ids); anything else (too long, spaces,
#: control or non-ASCII characters) is replaced by a generated id, so logs and the echoed header
#: stay bounded and safe.
_REQUEST_ID = re.compile(r"[A-Za-z0-9\-_.:/+=@]{1,128}")


#: Generated request ids: 128 random bits from a generator seeded once from the OS (an id
#: needs to be unique, not secret; ``uuid4`` cost a system call per request).
_ids = random.Random()


def optional(body: dict, key: str, kind: type | tuple[type, ...], what: str, default=None):
    """``body[key]``, or ``default`` when it is absent or null (Ollama's pointer fields: null is
    unset). Raises ApiError(400) ``<key> must be <what>`` for a value of another type, where
    Ollama's JSON decoding answers 400 (a boolean is not an integer here; ``"", [], {}`` are no
    stand-ins for unset)."""
    v = body.get(key)
    if v is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise ApiError(400, f"{key} must be {what}")
    return v


def request_id(request: web.Request) -> str:
    """The request's id: its ``X-Request-ID`` when that matches :data:`_REQUEST_ID`, else a
    generated one (32 hex digits). Echoed in the response and logged as ``request_id``."""
    rid = request.get("request_id")
    if rid is None:
        given = request.headers.get("X-Request-ID", "")
        rid = given if given and _REQUEST_ID.fullmatch(given) else f"{_ids.getrandbits(128):032x}"
        request["request_id"] = rid
    return rid


def note_upstream_error(request: web.Request, message: str, streamed: bool,
                        error: UpstreamError | None = None) -> None:
    """A worker failed ``request`` (its error answer, an error event mid-stream, a broken or
    silent connection): ``request["error"]`` = ``message``, ``request["worker"]`` = the worker
    (the lease's, from ``note_lease``; else ``error.worker``, a worker that refused before
    answering, so ``request.done`` names it too), and one ``request.upstream_error`` warning
    with request_id, worker (``error.worker`` when set: one input of an embedding batch names
    its own worker; else ``request["worker"]``), gpu (``Fleet.gpu_of``: "0", "1,3", "cpu"; None
    when no worker was leased), error (``message``) and streamed (whether the client's answer
    had begun)."""
    if request.get("worker") is None and error is not None and error.worker:
        request["worker"] = error.worker
    worker = error.worker if error is not None and error.worker else request.get("worker")
    request["error"] = message
    log.warning("request.upstream_error", request_id=request.get("request_id"), worker=worker,
                gpu=request.app["gw"].fleet.gpu_of(worker), error=message, streamed=streamed)


def make_ticket(request: web.Request, model: str, default_priority: int,
                queue_timeout_s: float, est_tokens: int = 0, *, body: dict | None = None) -> Ticket:
    """A ticket for this request. The API key's priority (``auth.keys[].priority``) wins;
    else ``X-Priority`` (integer; unless ``queue.header_priority`` is false) overrides the
    model's default class.

    With ``body`` (the upstream request body), the ticket carries the fleet's size estimate
    (prompt tokens, KV tokens, prefix key, slots for ``n`` choices of each of its prompts;
    ``gateway.sizing``). Raises ApiError(400) for a bad ``X-Priority``, for a prompt that cannot
    fit any worker's per-slot context (field case 4: refused before anything is forwarded) and
    for more choices (``n``) than any worker has slots."""
    prio = request.get("key_priority", default_priority)
    gw = request.app.get("gw")
    hdr = request.headers.get("X-Priority")
    if gw is not None and not gw.config.queue.header_priority:
        hdr = None  # queue.header_priority: false, the header is ignored
    if hdr is not None and "key_priority" not in request:
        try:
            prio = int(hdr) if len(hdr) <= 12 else None
        except ValueError:
            prio = None
        if prio is None or not -PRIORITY_LIMIT <= prio <= PRIORITY_LIMIT:
            shown = header_text(hdr[:40]) + ("…" if len(hdr) > 40 else "")  # not 5,000 digits back
            raise ApiError(400, f"X-Priority must be an integer from -{PRIORITY_LIMIT} to "
                                f"{PRIORITY_LIMIT}, got '{shown}'")
    ticket = Ticket(request_id=request_id(request), model=model, priority=prio,
                    est_tokens=est_tokens, queue_timeout_s=queue_timeout_s)
    # known from here on, also for a request that never gets a worker (request.done, 499/503)
    request["priority"], request["ticket"] = prio, ticket
    fleet = getattr(gw, "fleet", None)
    if body is not None and fleet is not None:
        size = fleet.estimate(model, body, request.get("prompt_tokens_counted"))
        ticket.prompt_tokens, ticket.est_tokens = size.prompt_tokens, size.est_tokens
        ticket.prefill_tokens = size.prefill_tokens
        ticket.prefix_key, ticket.prefix_chain = size.prefix_key, size.prefix_chain
        ticket.slots, ticket.prompts = size.slots, size.prompts
        gw.dispatcher.cut_slots(ticket)  # several prompts: at most the largest worker
        try:
            gw.dispatcher.check_fits(ticket)
        except (TooLarge, TooManySlots) as e:
            raise ApiError(400, str(e)) from None
    return ticket


def t0_ns(request: web.Request) -> int:
    """Monotonic ns when the gateway received the request (set by middleware)."""
    return request.get("t0_ns") or time.monotonic_ns()


class _HeadWithFirstBytes(web.StreamResponse):
    """A stream whose status line and headers leave in the same write as its first body bytes
    (as aiohttp's ``web.Response`` does; for ``StreamResponse`` aiohttp 3.14 reads this class
    attribute). Sent apart, the headers woke the client once on their own while the gateway
    waited for the CPU back: about 0.2 ms of TTFT on the 2-core development machine."""

    _send_headers_immediately = False


def stream_response(request: web.Request, content_type: str) -> web.StreamResponse:
    """A 200 streamed response with the no-buffering headers (field case 19), not started yet
    (``prepare``). Building it changes nothing on ``request``, so a handler can build it while
    the worker computes and drop it if the answer is an error after all.

    Chunked for HTTP/1.1 clients; an HTTP/1.0 client (nginx's default ``proxy_http_version``)
    gets the body delimited by connection close, since it cannot read chunked encoding.
    """
    out = _HeadWithFirstBytes(status=200, headers={"Content-Type": content_type, **STREAM_HEADERS})
    if request.version >= (1, 1):
        out.enable_chunked_encoding()
    else:
        out.force_close()
    return out


async def start_stream(request: web.Request, content_type: str) -> web.StreamResponse:
    """Start a 200 streamed response (:func:`stream_response`)."""
    out = stream_response(request, content_type)
    await out.prepare(request)
    return out


def visible_entries(request: web.Request) -> list:
    """The inventory entries the caller may use: all of them, or with an API key that names
    its models (``auth.keys[].models``) only those it may use by a name or an alias, so
    ``/api/tags``, ``/api/ps`` and ``/v1/models`` do not list models the key would get 403
    for."""
    return list({id(e): e for e, _, _ in visible_names(request)}.values())


def visible_names(request: web.Request) -> list[tuple]:
    """(entry, full name, name as configured) for every name a served model the caller may use
    answers to (an API key allowed one of a model's names may use it by any): the model's own
    (its full name both times), then each of its ``models[].aliases``, as Ollama lists a copy
    (``ollama cp``) beside its source. Aliases were not listed, so a client that checks its
    model against ``/v1/models`` failed on an alias that served, also under a key allowed
    only the alias (a fresh tester's find)."""
    gw = request.app["gw"]
    key = request.get("api_key_state")
    out = []
    for e in gw.inventory.entries:
        if key is not None and not key.allows_model(e.name):
            continue
        m = gw.model_config(e.name)
        out.append((e, e.name, e.name))
        if m is not None:
            out += [(e, full, shown) for full, shown in zip(m.names[1:], m.aliases)]
    return out


def operator_sampling(gw, name: str) -> frozenset[str]:
    """The sampling fields whose default the operator chose for model ``name`` with
    llama-server flags (``llama_server.extra_args`` and its ``models[].args``;
    ``ollama_mapping.sampling_set_by``): a request that leaves them out gets the worker's."""
    m = gw.model_config(name)
    return sampling_set_by([*gw.config.llama_server.extra_args, *(m.args if m else ())])
