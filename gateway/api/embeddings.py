"""Embedding routes: Ollama ``/api/embed`` and legacy ``/api/embeddings``, OpenAI ``/v1/embeddings``.

Each input is its own ticket/lease (so a batch spreads over workers) and its own upstream
``POST /v1/embeddings {"input": text}`` (as Ollama's runner does, one request per text);
results are gathered in input order. Vectors are L2-normalised again here and, with
``dimensions``, cut and normalised again (Ollama routes.go ``normalize``).

Too-long inputs: llama-server embeds a whole input in one micro-batch, so the limit is
min(per-slot context, ``-ub`` (default 512), the worker's whole ``-c``; ``input_limit``). With
``truncate`` (default true) the input is tokenized and cut to the limit; with ``truncate:false``
→ 400 ``the input length exceeds the context length`` (Ollama text). That ``/tokenize`` is not
asked when admission would refuse the request at once (full queue, no worker can serve it): the
request gets that 503 without waiting for the side call (``embed_many``). Workers need
``embeddings: true`` and a pooling type other than ``none`` (the demo model needs
``args: [--pooling, mean]``).

Empty strings in a batch: sent to the worker like any input, as Ollama's ``EmbedHandler`` does
(routes.go; only a whole ``input: ""`` is the "load the model" answer ``embeddings: []``).
llama-server embeds an empty text when its tokenizer adds a BOS token; otherwise it refuses it
(400 ``Input content cannot be empty``, server ``handle_embeddings``), and the gateway answers
400 naming the input's index (``input[i] is empty ...``) instead of the worker's bare text.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import struct
import time

import orjson
from aiohttp import web

from gateway.admission import QueueFull, QueueTimeout, Unavailable
from gateway.api.capabilities import require
from gateway.api.common import make_ticket, note_upstream_error, optional, read_json, t0_ns
from gateway.api.errors import ApiError, admission_error, json_body, resolve_v1_model
from gateway.api.ollama import resolve_model
from gateway.api.ollama_mapping import map_options, parse_keep_alive
from gateway.inventory import ModelEntry
from gateway.upstream import UpstreamError, read_all
from gateway.worker_calls import refuse_early, tokenize

TOO_LONG = "the input length exceeds the context length"
_UBATCH_DEFAULT = 512  # llama-server -ub default (common.h n_ubatch)


def normalize(vec: list[float], dimensions: int = 0) -> list[float]:
    """Cut to ``dimensions`` when 0 < dimensions < len, then L2-normalise (zero vector kept)."""
    if 0 < dimensions < len(vec):
        vec = vec[:dimensions]
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else list(vec)


def _ubatch(gw, entry: ModelEntry) -> int:
    mcfg = gw.model_config(entry.name)
    args = list(gw.config.llama_server.extra_args) + (list(mcfg.args) if mcfg else [])
    for i, a in enumerate(args[:-1]):
        if a in ("-ub", "--ubatch-size"):
            try:
                return int(args[i + 1])
            except ValueError:
                pass
    return _UBATCH_DEFAULT


def input_limit(gw, entry: ModelEntry) -> int:
    """Most tokens one input may have: min(per-slot context, micro-batch, the worker's whole
    ``-c``). The last matters for tiny contexts: llama-server cuts a causal model's batch (and
    so its micro-batch) to the ``-c`` it was given (src/llama-context.cpp: ``n_batch =
    min(n_ctx, n_batch)``) before it rounds the context up to a multiple of 256, so with 2
    slots of 64 tokens ``/slots`` says 256 per slot but an input over 128 tokens is refused
    ("too large to process ... current batch size: 128"; field case 25). The smallest ``-c``
    of the model's workers counts (``WorkerPlan.total_context``; ``slots_per_gpu`` can differ)."""
    ctx = gw.context_per_slot(entry.name) or _UBATCH_DEFAULT
    fleet = getattr(gw, "fleet", None)
    totals = [p.total_context for p in fleet.plans.values() if p.model == entry.name] \
        if fleet else []
    return min([ctx, _ubatch(gw, entry), *totals])


def _is_too_long(e: UpstreamError) -> bool:
    m = e.message.lower()
    return ("too large" in m or "context size" in m or "exceeds" in m
            or e.kind == "exceed_context_size_error")


async def _embed_one(request: web.Request, entry: ModelEntry, text, truncate: bool,
                     index: int, follow_on: bool, on_admitted=None) -> tuple[list[float], int]:
    """Input number ``index`` of a request → (vector, prompt tokens). The first input's ticket is
    the request's admission; the others are ``follow_on`` (``embed_many``). ``on_admitted``: see
    ``Upstream.request``. A worker's failure of the input is logged as for chat and generate
    (``note_upstream_error``: one ``request.upstream_error`` naming that worker), also when the
    gateway answers it as the client's error (too long, empty). Raises ApiError /
    UpstreamError, and admission's refusals (``QueueFull``, ``Unavailable``,
    ``QueueTimeout``)."""
    gw = request.app["gw"]
    limit = input_limit(gw, entry)
    payload = text
    # A byte-level token is at least one byte, so only texts this long can exceed the limit.
    size = len(text.encode()) if isinstance(text, str) else 0  # bytes (a long text: once)
    if isinstance(text, str) and size + 2 > limit:
        least = entry.facts.min_tokens(size)
        if least > limit:  # too long whatever the tokenizer makes of it
            if not truncate:
                raise ApiError(400, TOO_LONG)
            # its first `limit` tokens lie within this many bytes (characters are >= 1 byte);
            # 16 tokens more keep the cut away from them: tens of MB are not sent to
            # /tokenize (they outlasted every try, and the worker tokenized on after the
            # client left; a fresh tester's find)
            text = text[:(limit + 16) * entry.facts.max_token_bytes]
        # with the special tokens the worker's embedding route adds (BOS, a BERT's CLS and
        # SEP; server handle_embeddings tokenizes with add_special), so that the count is the
        # worker's: a reserved token for a BOS the demo model does not add cut a 512-token
        # text to 511 (a fresh tester's find). Ids are sent as they are (none added again).
        toks = await tokenize(gw, entry.name, text, add_special=True)
        if len(toks) > limit:
            if not truncate:
                raise ApiError(400, TOO_LONG)
            payload = toks[:limit]
    mcfg = gw.model_config(entry.name)
    ticket = make_ticket(request, entry.name, mcfg.priority if mcfg else 0, gw.config.queue.timeout_s)
    ticket.follow_on = follow_on
    try:
        async with gw.upstream.request(ticket, "/v1/embeddings", {"input": payload},
                                       on_admitted) as (lease, resp):
            try:
                data = orjson.loads(await read_all(resp))
            except UpstreamError as e:  # its connection broke mid-answer
                e.worker = lease.worker.id
                raise
            request.setdefault("workers_used", []).append(lease.worker.id)
    except UpstreamError as e:
        note_upstream_error(request, e.message, False, e)
        if _is_too_long(e):
            raise ApiError(400, TOO_LONG) from None
        if e.status == 400 and not text:
            raise ApiError(400, f"input[{index}] is empty, which model '{entry.name}' cannot "
                                f"embed: its tokenizer adds no token to an empty text (worker: "
                                f"{e.message}); remove it or send some text") from None
        raise
    item = (data.get("data") or [{}])[0]
    n = int((data.get("usage") or {}).get("prompt_tokens") or item.get("tokens_evaluated") or 0)
    return item.get("embedding") or [], n


async def embed_many(request: web.Request, entry: ModelEntry, inputs: list, truncate: bool,
                     dimensions: int) -> tuple[list[list[float]], int]:
    """Embed ``inputs`` concurrently (one lease each), in input order; (vectors, total tokens).

    The request is admitted once, as one request (Ollama's ``OLLAMA_MAX_QUEUE`` counts
    requests, not inputs): its first input's ticket is an ordinary one (a slot, a place in the
    queue, or the queue's 503 at once), and only once admission took it do the other inputs
    start, as ``follow_on`` tickets: they wait for slots like any ticket, but a full queue never
    refuses them and they do not count toward ``queue.max_pending`` (``AdmissionQueue.requests``;
    they show as ``waiting_inputs`` in ``/gateway/api/workers``), so an accepted batch is not cut
    off halfway
    (``refuse_early`` first spares a long first input its ``/tokenize`` when the queue would
    refuse the request anyway). At most as many inputs of
    one request are in flight (queued or running) as the model has slots in total, so a long
    batch spreads over every worker and bounds what it adds to the queue. When one input fails,
    the others are cancelled (their slots freed), and the request gets that input's error.
    Raises ApiError (400 too long, 503 busy) or UpstreamError."""
    gw = request.app["gw"]
    width = max(1, sum(w.slots for w in gw.dispatcher.workers_for(entry.name)))
    gate = asyncio.Semaphore(width)

    held = id(request)  # gw.inputs_held[held]: inputs not yet past the gate (waiting_inputs;
    # one 400-input batch showed 0 waiting: a fresh tester's find)

    async def one(i, text, on_admitted=None):
        async with gate:
            if i > 0:
                gw.inputs_held[held] -= 1
            return await _embed_one(request, entry, text, truncate, i, follow_on=i > 0,
                                    on_admitted=on_admitted)

    tasks: list[asyncio.Task] = []
    batch = gw.open_batches.running(entry.name) if len(inputs) > 1 else contextlib.nullcontext()
    try:
        refuse_early(gw, entry.name)
        with batch:  # a reload that removes the model lets it end (gateway.open_batches)
            admitted = asyncio.Event()
            tasks = [asyncio.ensure_future(one(0, inputs[0], admitted.set))]
            try:
                waiter = asyncio.ensure_future(admitted.wait())
                try:  # the first input was admitted (slot or queue place), or it already failed
                    await asyncio.wait((tasks[0], waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                if admitted.is_set():
                    gw.inputs_held[held] = len(inputs) - 1
                    tasks += [asyncio.ensure_future(one(i, t)) for i, t in enumerate(inputs) if i]
                results = await asyncio.gather(*tasks)
            finally:  # an input failed, or the client left: the others stop and free their slots
                gw.inputs_held.pop(held, None)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    except (Unavailable, QueueFull, QueueTimeout) as e:  # admission will not run it
        raise admission_error(e, gw.config.queue.retry_after_s) from None
    except UpstreamError as e:
        raise ApiError(e.status if e.status in (400, 502, 503, 504) else 500, e.message) from None
    request["worker"] = ",".join(request.get("workers_used", []))
    return [normalize(v, dimensions) for v, _ in results], sum(n for _, n in results)


def _dimensions(body: dict) -> int:
    d = optional(body, "dimensions", int, "a non-negative integer", 0)
    if d < 0:
        raise ApiError(400, "dimensions must be a non-negative integer")
    return d


async def _check_embedding(request: web.Request, body: dict, entry: ModelEntry) -> None:
    """Checks shared by the three routes once ``entry`` (the model ``body`` names) is found:
    ``keep_alive`` parses and the model embeds. Raises ApiError."""
    parse_keep_alive(body.get("keep_alive"))
    # read by nothing here, but typed as on /api/chat (``option "temperature" must be of
    # type float`` there, 200 here before; a fresh tester's find)
    map_options(body.get("options"), num_predict_default=-1, num_predict_max=None)
    await require(request.app["gw"], entry, "embedding", body["model"])


def _json(obj, status: int = 200) -> web.Response:
    return json_body(orjson.dumps(obj), status)


async def api_embed(request: web.Request) -> web.Response:
    """Ollama ``POST /api/embed`` → ``{"model","embeddings","total_duration","load_duration",
    "prompt_eval_count"}`` (durations ns)."""
    body = await read_json(request)
    entry = resolve_model(request, body, missing_status=404)
    await _check_embedding(request, body, entry)
    # checked first: the load answer below took any truncate (a fresh tester's find)
    truncate = optional(body, "truncate", bool, "a boolean", True)  # null: unset, so true
    raw = body.get("input")
    if raw is None or raw == "" or raw == []:
        entry.touch(parse_keep_alive(body.get("keep_alive")))
        return _json({"model": body["model"], "embeddings": []})
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
        raise ApiError(400, "invalid input type")
    entry.touch(parse_keep_alive(body.get("keep_alive")))
    t_loaded = time.monotonic_ns()
    vecs, n = await embed_many(request, entry, inputs, truncate, _dimensions(body))
    request["prompt_eval_count"] = n  # metrics and request.done (they had no count)
    now = time.monotonic_ns()
    return _json({"model": body["model"], "embeddings": vecs,
                  "total_duration": max(1, now - t0_ns(request)),
                  "load_duration": max(1, t_loaded - t0_ns(request)), "prompt_eval_count": n})


async def api_embeddings(request: web.Request) -> web.Response:
    """Legacy Ollama ``POST /api/embeddings {model, prompt}`` → ``{"embedding": [...]}``."""
    body = await read_json(request)
    entry = resolve_model(request, body, missing_status=400)
    await _check_embedding(request, body, entry)
    prompt = optional(body, "prompt", str, "a string", "")
    entry.touch(parse_keep_alive(body.get("keep_alive")))
    if not prompt:
        return _json({"embedding": []})
    vecs, request["prompt_eval_count"] = await embed_many(request, entry, [prompt], True, 0)
    return _json({"embedding": vecs[0]})


def _b64(vec: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


async def v1_embeddings(request: web.Request) -> web.Response:
    """OpenAI ``POST /v1/embeddings`` (input string | [string] | [int] | [[int]];
    ``encoding_format`` float|base64; ``dimensions``) → ``{"object":"list","data":[{"object":
    "embedding","embedding","index"}],"model","usage"}``. Errors in the OpenAI shape."""
    body = await read_json(request)
    entry = resolve_v1_model(request.app["gw"].inventory, body)
    name = body["model"]
    await _check_embedding(request, body, entry)
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, str) or (
            isinstance(t, list) and all(isinstance(x, int) for x in t)) for t in raw):
        inputs = raw
    else:
        raise ApiError(400, "invalid input type: expected a string, a list of strings or token arrays")
    for i, t in enumerate(inputs):
        if t == []:
            raise ApiError(400, f"input[{i}] is an empty token array")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"invalid encoding_format: {fmt!r} (expected float or base64)")
    entry.touch(None)
    vecs, n = await embed_many(request, entry, inputs, True, _dimensions(body))
    request["prompt_eval_count"] = n
    data = [{"object": "embedding", "embedding": _b64(v) if fmt == "base64" else v, "index": i}
            for i, v in enumerate(vecs)]
    return _json({"object": "list", "data": data, "model": name,
                  "usage": {"prompt_tokens": n, "total_tokens": n}})


def routes() -> list[web.RouteDef]:
    return [web.post("/api/embed", api_embed), web.post("/api/embeddings", api_embeddings),
            web.post("/v1/embeddings", v1_embeddings)]
