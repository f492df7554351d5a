"""Bounds on one request, checked before it reaches admission.

* body: ``limits.max_body_bytes`` (413, also for what a gzip/deflate body decodes to) read
  within ``timeouts.body_read_s`` (408); other content codings 415, undecodable bodies 400;
* ``messages``: at most ``limits.max_messages`` entries (400);
* prompt length: a prompt that cannot fit one slot's context is refused with 400
  (field cases 4, 5) instead of occupying a slot. Cheap first: a byte-level BPE or
  byte-fallback tokenizer never makes more tokens than the text has UTF-8 bytes, so text of at
  most ``context`` bytes always fits; longer text is counted with a ready worker's own
  tokenizer (llama-server ``POST /tokenize`` ``{"content"}`` → ``{"tokens": [...]}``), which
  needs no slot. If no worker can count it, the worker's own check (HTTP 400
  ``exceed_context_size_error``) stays the backstop.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.api.common import loads_body
from gateway.api.errors import ApiError, context_overflow
from gateway.logs import get_logger
from gateway.scheduling import Unavailable
from gateway.sizing import Ratios, content_text
from gateway.texts import header_text
from gateway.upstream import UpstreamError
from gateway.worker_calls import tokenize

if TYPE_CHECKING:
    from gateway.inventory import ModelEntry

log = get_logger("gateway.limits")

#: Inference routes (POST): what per-key concurrency and rate limits and the in-flight gauge
#: count; a model list or ``/api/show`` polled by a UI during a stream is not inference.
INFERENCE_ROUTES = ("/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
                    "/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: Routes whose JSON body is parsed and checked by the guard (the model a key may use, messages,
#: prompt length): the inference routes and the two that name one model (extend as endpoints
#: are added).
JSON_ROUTES = INFERENCE_ROUTES + ("/api/show", "/api/pull")


#: Content codings a request body may use (RFC 9110 §8.4.1); ``x-gzip`` is gzip (§8.4.1.3).
BODY_ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")


class _Decoder:
    """Bounded decoding of one request body in ``encoding`` (one of :data:`BODY_ENCODINGS`).

    ``feed`` never produces more than ``max_bytes`` + 1 decoded bytes in all (zlib's
    ``max_length``), so a small compressed body that expands far past the limit costs at most
    the limit in memory before it is refused. An ``identity`` body is only collected:
    :func:`read_body` bounds the bytes received before they reach ``feed``. ``deflate`` is
    the zlib format (RFC 9110 §8.4.1.2); a raw deflate stream is accepted too, as aiohttp and
    browsers do. A gzip body may be several members, decoded one after the other; anything
    after a deflate stream, or after a gzip member that is not another member, is invalid
    data.
    Raises ApiError 413 (decoded size over ``max_bytes``) or 400 (not valid data).
    """

    def __init__(self, encoding: str, max_bytes: int):
        self.encoding, self.max_bytes = encoding, max_bytes
        self.out = bytearray()
        self._z = None
        if encoding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def feed(self, data: bytes) -> None:
        if self.encoding == "identity":  # read_body has bounded it already
            self.out += data
            return None
        if self._z is None:  # deflate: zlib header or raw stream, told by the first byte
            if not data:
                return None
            wbits = zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS
            self._z = zlib.decompressobj(wbits)
        while data:
            if self._z.eof:
                if self.encoding == "deflate":
                    raise ApiError(400, f"request body is not valid {self.encoding} data: "
                                        "data after the end of the compressed stream")
                # gzip: the next member (RFC 1952 §2.2, a file is a series of members; what
                # ``cat a.gz b.gz`` makes and ``gzip -d`` decodes whole)
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                piece = self._z.decompress(data, self.max_bytes + 1 - len(self.out))
            except zlib.error as e:
                raise ApiError(400, f"request body is not valid {self.encoding} data: {e}") \
                    from None
            self.out += piece
            if len(self.out) > self.max_bytes:
                raise _too_large(self.max_bytes, " (decompressed)")
            # input zlib has not read yet: held back by max_length, or past the member's end
            data = self._z.unconsumed_tail or self._z.unused_data

    def finish(self) -> bytes:
        if self._z is not None and not self._z.eof:
            raise ApiError(400, f"request body is not valid {self.encoding} data: "
                                "the compressed stream is incomplete")
        return bytes(self.out)


#: Headers of a refusal that leaves the body unread (413, 408): the connection is closed after
#: it (gateway.api.errors.error_response), as the rest of the body, or the next request a
#: client sends on it, cannot be told apart; aiohttp otherwise read on for up to its 10 s
#: lingering time and answered nothing sent meanwhile (a fresh tester's find).
CLOSE = {"Connection": "close"}


def _too_large(max_bytes: int, what: str = "") -> ApiError:
    """The 413 for a body found over ``max_bytes`` bytes while reading (``what``: e.g. the
    " (decompressed)" note)."""
    return ApiError(413, f"request body too large, the limit is {max_bytes} bytes{what}",
                    dict(CLOSE))


def declared_too_large(request: web.Request, max_bytes: int) -> ApiError | None:
    """The 413 for a body whose ``Content-Length`` is over ``max_bytes`` bytes, else None."""
    length = request.content_length  # parsed from the header on every read
    if length is not None and length > max_bytes:
        return ApiError(413, f"request body too large: {length} bytes, the limit is {max_bytes}",
                        dict(CLOSE))
    return None


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, decoded from its ``Content-Encoding``; the caller keeps it in
    ``request["raw_body"]`` for the handler (gateway/api/common.py ``read_json``).

    The gateway reads the body itself (the aiohttp server runs with ``auto_decompress=False``)
    so that the current ``max_bytes`` applies to every body, chunked ones included, and to
    what a compressed body decodes to, while it is read.

    Raises ApiError 413 (``Content-Length``, the bytes received or the decoded size over
    ``max_bytes``), 408 (not received within ``timeout_s`` seconds), 415 (a content coding
    other than :data:`BODY_ENCODINGS`, e.g. ``br`` or ``zstd``: RFC 9110 §15.5.16) or 400 (a
    body that is not valid data in its coding, or whose HTTP framing breaks, e.g. a bad chunk
    size: aiohttp's ``web.RequestPayloadError`` on the body reader, set at once also for
    bytes that come after the headers by gateway/body_errors.py).
    """
    try:
        return await _read_body(request, max_bytes, timeout_s)
    except ApiError as e:
        if e.headers is not None and e.headers.get("Connection") == "close":
            # What is left of the body is not read (aiohttp's lingering read would wait up to
            # 10 s for it); the connection closes once the answer is out.
            request.content.feed_eof()
            request.protocol.close()
        raise


async def _read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    # Repeated header lines are one comma-separated list (RFC 9110 §5.3): "gzip" then "br" on
    # two lines is "gzip, br", which is refused like the same list on one line.
    codings = request.headers.getall("Content-Encoding", ())
    encoding = (", ".join(v.strip() for v in codings if v.strip()).lower()
                if codings else "") or "identity"
    if encoding not in BODY_ENCODINGS:
        raise ApiError(415, f"unsupported Content-Encoding '{header_text(encoding)}': the gateway "
                            "accepts gzip, deflate or an uncompressed body",
                       {"Accept-Encoding": "gzip, deflate"})
    declared = declared_too_large(request, max_bytes)
    if declared is not None:
        raise declared
    content = request.content
    if encoding == "identity" and content.is_eof() and content.exception() is None:
        # The whole body came with the headers (the common small request): take it as it is,
        # without the read loop's timer (on the TTFT path of every request).
        data = content.read_nowait()
        if len(data) > max_bytes:
            raise _too_large(max_bytes)
        return data
    decoder = _Decoder(encoding, max_bytes)
    received = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                received += len(chunk)
                if received > max_bytes:
                    raise _too_large(max_bytes)
                decoder.feed(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s:g} s",
                       dict(CLOSE)) from None
    except web.RequestPayloadError as e:  # broken chunked framing and the like
        raise ApiError(400, f"bad request body: {e}") from None
    return decoder.finish() if received else b""


def parse_object(raw: bytes) -> dict | None:
    """The body as a JSON object, or None (the handler reports bad JSON in its own words)."""
    try:
        data = loads_body(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def check_messages(body: dict, max_messages: int) -> None:
    """Raises ApiError(400) when ``messages`` has more than ``max_messages`` entries."""
    msgs = body.get("messages")
    if isinstance(msgs, list) and len(msgs) > max_messages:
        raise ApiError(400, f"too many messages: {len(msgs)}, the limit is {max_messages}")


def prompt_texts(body: dict, path: str) -> list[str]:
    """The prompt text(s) that ``path`` sends to a worker for ``body``, each of which must fit
    one slot; fields the route ignores are not counted.

    * ``/api/generate``: ``prompt`` and ``suffix``, plus ``system`` unless ``raw`` or ``suffix``
      is set (the handler puts ``system`` into the chat template, which neither uses;
      gateway/api/ollama.py ``generate``).
    * ``/api/chat``, ``/v1/chat/completions``: the message contents only (a top-level
      ``prompt`` or ``system`` is not sent).
    * ``/v1/completions``: ``prompt``, a string or each string of a list (llama-server runs one
      task per prompt).
    * any other route: nothing (embeddings are cut or refused per input in gateway/api/embeddings.py).
    Wrong types are skipped (the handler reports them)."""
    if path == "/api/generate":
        keys = ("prompt", "suffix") if body.get("raw") is True or body.get("suffix") \
            else ("system", "prompt")
        text = "\n".join(v for k in keys if isinstance(v := body.get(k), str) and v)
        return [text] if text else []
    if path in ("/api/chat", "/v1/chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return []
        text = "\n".join(content_text(m.get("content")) for m in msgs if isinstance(m, dict))
        return [text] if text else []
    if path == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, str):
            return [p] if p else []
        if isinstance(p, list):
            return [x for x in p if isinstance(x, str) and x]
    return []


async def check_prompt_length(gw, entry: ModelEntry, body: dict, path: str) -> int | None:
    """Raises ApiError(400) when a prompt ``path`` would send (:func:`prompt_texts`) to
    ``entry`` (the model ``body`` names, resolved by the caller) needs more tokens than one
    slot's context. An embedding model is not checked (embeddings.py cuts or refuses each
    input itself). Returns the prompt's tokens as the worker counted them when the request
    has one prompt text and it was counted (then the scheduler's size estimate uses that
    count, ``gateway.sizing.estimate``), else None.

    A prompt longer than the context in bytes is counted by a worker's ``/tokenize``, unless
    its bytes alone need more tokens than the context (``GGUFFacts.min_tokens``: refused at
    once), or admission would refuse the request at once (``Admission.would_refuse``: full
    queue, no worker can serve it): then nothing is asked and the handler gets admission's
    answer without waiting for that side call (the scheduler's estimate and the worker still refuse a
    prompt that does not fit).

    ``gw`` is the Gateway (fleet, upstream session, ``context_per_slot``).
    """
    if entry.embeddings:
        return None
    ctx = gw.context_per_slot(entry.name)
    if not ctx:
        return None
    texts = prompt_texts(body, path)
    held = context_tokens(body, path)
    counted = None
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        size = len(data)
        if size + held <= ctx:  # fits even at a token per byte
            if held:  # the context's tokens are known; the text's estimated as the scheduler does
                ratios = (gw.fleet.ratios_of(entry.name) if gw.fleet
                          else Ratios(gw.config.scheduler.bytes_per_token))
                counted = held + math.ceil(ratios.tokens(data))
            continue
        least = entry.facts.min_tokens(size)
        if least + held >= ctx:  # too long whatever the tokenizer makes of it: no /tokenize
            # of tens of MB (it outlasted every try and the workers tokenized on after the
            # client left; a fresh tester's find)
            raise ApiError(400, context_overflow(least + held, ctx, at_least=True))
        if gw.admission.would_refuse(entry.name) is not None:
            return None
        n = await _count_tokens(gw, entry.name, text)
        if n is not None and n + held >= ctx:
            raise ApiError(400, context_overflow(n + held, ctx))
        counted = None if n is None else n + held
    if held and not texts:  # a context and no new text
        if held >= ctx:
            raise ApiError(400, context_overflow(held, ctx))
        counted = held
    return counted if len(texts) <= 1 else None


def context_tokens(body: dict, path: str) -> int:
    """Tokens of an ``/api/generate`` ``context`` (Ollama's token ids of the conversation so
    far, which the handler detokenizes in front of the prompt), exactly known: its length;
    0 for other routes or a ``context`` that is not a list of integers (the handler reports
    it). Counted with the prompt: the bytes of the detokenized text badly overestimate them
    (5 bytes a token for a repeated word, 12 for a special token: a context of 8,017 tokens
    was refused as "about 16,641" for a slot of 16,384; a fresh tester's find)."""
    if path != "/api/generate":
        return 0
    ids = body.get("context")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        return 0
    return len(ids)


async def _count_tokens(gw, model: str, text: str) -> int | None:
    """Tokens of ``text`` by the model's own tokenizer (a worker's ``/tokenize``), or None when
    no worker answers within a second (then the scheduler's estimate still guards)."""
    if gw.fleet is None or gw.upstream is None or gw.upstream.session is None:
        return None
    try:
        return len(await tokenize(gw, model, text, wait_s=1.0))
    except UpstreamError as e:
        log.info("limits.tokenize_failed", model=model, error=e.message)
        return None
    except Unavailable:  # no worker can take it: admission answers with why
        return None
