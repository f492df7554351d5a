"""Model inventory: names as Ollama resolves them, and facts read from the GGUF file.

Name resolution follows Ollama: ``demo`` means ``demo:latest`` and matching is
case-insensitive (server ``getExistingName`` uses ``strings.EqualFold``); aliases from config
resolve to the same model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import functools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from gateway.config import normalize_model_name
from gateway.logs import get_logger
from gateway.template_shapes import TemplateShapes
from gateway.thinking_split import think_tags

log = get_logger("gateway.inventory")


def full_name(name: str) -> str:
    """``demo`` -> ``demo:latest``; a name with a tag is kept. Raises nothing."""
    name = name.strip()
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else name + ":latest"


def _fmt_params(n: int) -> str:
    """Ollama's parameter_size style: ``7.6B``, ``494.03M``, ``215.30K``."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if unit == "B" else f"{v:.2f}{unit}"
    return str(n)


_FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
           10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
           16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 24: "IQ1_S",
           25: "IQ4_NL", 26: "IQ3_S", 28: "IQ4_XS", 32: "BF16"}


@functools.cache
def _bounded_reader():
    """gguf's GGUFReader (the class, made once: gguf is imported when first needed), whose every read (``_get``, through which it reads the header, the
    tensor infos and each tensor's data) is first checked against the file's size: a file cut
    short (an interrupted download or copy) was reported in numpy's words, "cannot reshape
    array of size 3908 into shape (559,64)" or an IndexError (a fresh tester's find)."""
    import numpy as np
    from gguf import GGUFReader

    class BoundedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise ValueError(
                    f"the file is cut short: it has {len(self.data):,} bytes and its GGUF "
                    f"header describes data up to byte {end:,} (an interrupted download or "
                    f"copy?)")
            return super()._get(offset, dtype, count, override_order)
    return BoundedReader


def _open_gguf(path: Path):
    """gguf's GGUFReader on ``path`` (reads checked against the file's size:
    ``_bounded_reader``). Raises OSError, or ValueError for a file that is not GGUF (no
    magic), that is cut short, or that it cannot parse otherwise: a cut-short file made it
    raise IndexError (a traceback and exit 1 at start, a 500 on reload; a fresh tester's
    find)."""
    with open(path, "rb") as f:  # the parser's own words for another file were numpy's
        magic = f.read(4)
    if magic != b"GGUF":  # (a reshape error; a fresh tester's find)
        size = os.path.getsize(path)
        raise ValueError(f"not a GGUF file: it does not begin with the GGUF magic "
                         f"(first bytes {magic!r}, {size} bytes in all)")
    try:
        return _bounded_reader()(str(path), "r")
    except (OSError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 — the parser's own failures on a malformed file
        raise ValueError(f"malformed GGUF ({type(e).__name__}: {e})") from None


@dataclass
class GGUFFacts:
    """Metadata read once from the GGUF header (via the ``gguf`` package's GGUFReader).

    ``kv`` holds scalar and short-array key/values (``general.architecture``,
    ``<arch>.context_length`` …); ``n_params`` counts tensor elements.
    """

    architecture: str = ""
    kv: dict = field(default_factory=dict)
    n_params: int = 0
    file_type: str = ""
    chat_template: str = ""
    has_fim: bool = False    # vocab has fill-in-the-middle tokens (the ``insert`` capability)
    n_vocab: int = 0         # tokens in the vocabulary (len of tokenizer.ggml.tokens)
    #: Longest vocabulary piece in UTF-8 bytes, for tokenizers that keep every input byte
    #: (byte-level BPE ``gpt2``, SentencePiece ``llama``); 0 for others (WordPiece, Unigram
    #: normalise text and may drop characters). See :meth:`min_tokens`.
    max_token_bytes: int = 0

    def min_tokens(self, text_bytes: int) -> int:
        """The fewest tokens a text of ``text_bytes`` UTF-8 bytes can take (0: unknown). A
        byte-level BPE piece spells the bytes it stands for with one or two UTF-8 bytes each,
        and a SentencePiece one spells a space as the 3-byte ``▁``, so no token stands for more
        bytes than its piece has."""
        return -(-text_bytes // self.max_token_bytes) if self.max_token_bytes else 0

    @classmethod
    def read(cls, path: Path) -> "GGUFFacts":
        from gguf.constants import GGUFValueType

        r = _open_gguf(path)
        kv: dict = {}
        has_fim = any(k in r.fields for k in _FIM_KEYS)
        tok_field = r.fields.get("tokenizer.ggml.tokens")
        n_vocab = len(tok_field.data) if tok_field is not None else 0
        max_token_bytes = _max_piece_bytes(r, tok_field)
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                t = f.types[0] if f.types else None
                if name == "tokenizer.ggml.tokens" and not has_fim:
                    has_fim = _vocab_has_fim(f)
                if t == GGUFValueType.ARRAY and len(f.data) > 5:
                    kv[name] = []  # emptied, as Ollama's /api/show does without ``verbose``
                    continue
                kv[name] = f.contents()
            except Exception:  # an odd field must not stop the gateway
                continue
        n_params = sum(int(t.n_elements) for t in r.tensors)
        ft = kv.get("general.file_type")
        facts = cls(architecture=str(kv.get("general.architecture", "")), kv=kv,
                    n_params=n_params, file_type=_FTYPES.get(ft, str(ft) if ft is not None else ""),
                    chat_template=str(kv.get("tokenizer.chat_template") or ""), has_fim=has_fim, n_vocab=n_vocab,
                    max_token_bytes=max_token_bytes)
        kv.pop("tokenizer.chat_template", None)
        return facts

    @staticmethod
    def read_long_arrays(path: Path) -> dict:
        """The arrays longer than 5 that :meth:`read` empties (``tokenizer.ggml.tokens``,
        ``merges``, ``token_type`` …), whole: ``/api/show`` with ``verbose`` (Ollama's
        ``getModelData`` loads them then). Reads the file again (memory-mapped); the vocabulary
        of a large model takes about a second. Raises OSError/ValueError as ``read``."""
        from gguf.constants import GGUFValueType

        out = {}
        for name, f in _open_gguf(path).fields.items():
            if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > 5:
                out[name] = f.contents()
        return out

    @property
    def context_length(self) -> int:
        """Context the model was trained for (``<arch>.context_length``, tokens; 0 unknown)."""
        return int(self.kv.get(f"{self.architecture}.context_length") or 0)


# GGUF keys naming FIM tokens (llama.cpp llama-vocab.cpp LLM_KV_TOKENIZER_FIM_*_ID) and the
# token texts llama.cpp recognises as FIM prefix/suffix/middle when those keys are absent.
_FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id")
_FIM_TEXTS = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|fim_begin|>",
              "<｜fim▁begin｜>", "<|fim▁begin|>"}


#: ``tokenizer.ggml.model`` values whose tokenizers keep every input byte (llama.cpp
#: llama-vocab.cpp: byte-level BPE, and SentencePiece with byte fallback).
_LOSSLESS_TOKENIZERS = ("gpt2", "llama")


def _max_piece_bytes(r, tok_field) -> int:
    """``GGUFFacts.max_token_bytes`` of the open GGUF ``r``."""
    try:
        model = r.fields.get("tokenizer.ggml.model")
        if tok_field is None or model is None or model.contents() not in _LOSSLESS_TOKENIZERS:
            return 0
        return max((len(tok_field.parts[i]) for i in tok_field.data), default=0)
    except Exception:  # an odd vocab must not stop the gateway
        return 0


def _vocab_has_fim(f) -> bool:
    try:
        return any(bytes(f.parts[i]).decode("utf-8", "replace") in _FIM_TEXTS for i in f.data)
    except Exception:  # an odd vocab must not stop the gateway
        return False


#: Go's largest ``time.Duration`` (``math.MaxInt64`` ns, about 292 years): what Ollama keeps a
#: model loaded for after a request with a negative ``keep_alive`` (api/types.go
#: ``Duration.UnmarshalJSON``), and so how far its ``/api/ps`` ``expires_at`` lies after that
#: request (server/sched.go: ``expiresAt = time.Now().Add(sessionDuration)``).
GO_MAX_DURATION = timedelta(microseconds=(2 ** 63 - 1) // 1000)


def capabilities(*, embeddings: bool, template: str, has_fim: bool, vision: bool) -> list[str]:
    """Ollama capability names (types/model/capability.go) for a model as the gateway serves it.

    ``embedding`` for ``embeddings: true`` models; otherwise ``completion``, plus ``tools`` when
    the chat template mentions tools, ``insert`` when the vocab has FIM tokens, ``vision`` when
    a projector (``--mmproj``) is configured, ``thinking`` when the template handles reasoning
    (``<think>``, ``enable_thinking``, ``reasoning_content`` or another tag pair of
    ``thinking_split.TAG_PAIRS``).
    """
    return list(_capabilities(embeddings, template, has_fim, vision))


@functools.lru_cache(maxsize=64)
def _capabilities(embeddings: bool, template: str, has_fim: bool, vision: bool) -> tuple[str, ...]:
    """:func:`capabilities`, remembered: every generate and chat request asks, and each answer
    searched the whole chat template (kilobytes for many models) four times."""
    if embeddings:
        return ("embedding",)
    caps = ["completion"]
    if "tools" in template:
        caps.append("tools")
    if has_fim:
        caps.append("insert")
    if vision:
        caps.append("vision")
    if any(k in template for k in ("<think>", "enable_thinking", "reasoning_content")) \
            or think_tags(template):
        caps.append("thinking")
    return tuple(caps)


#: Longest wait (s) of ``/api/tags`` / ``/api/ps`` for a model file's hash still being computed.
DIGEST_WAIT_S = 1.0


def file_id(path: Path) -> tuple:
    """(device, inode, size, mtime ns) of the file at ``path``: another file moved over it (a
    new inode) or one rewritten in place (size or time) reads as changed. Raises OSError."""
    return _stat_id(path.stat())


def _stat_id(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class ModelEntry:
    """One served model as the Ollama inventory endpoints show it."""

    name: str                # full name, e.g. demo:latest
    path: Path
    aliases: tuple[str, ...] = ()
    facts: GGUFFacts = field(default_factory=GGUFFacts)
    size: int = 0            # bytes on disk
    modified_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    embeddings: bool = False
    _digest: str | None = None
    _digest_job: concurrent.futures.Future | None = None  # the background hash, once started
    _digest_waited: bool = False  # a listing already waited for the unfinished hash
    worker_template: str | None = None   # chat template a worker reported in /props, if asked
    worker_vision: bool = False          # a worker reported modalities.vision in /props
    #: whether the template's generation prompt ends with its opening reasoning tag (asked
    #: once with a rendered sample, api/ollama.py ``_thinking_split``), dropped with it too
    opens_reasoning: bool | None = None
    #: chat-template renders learned by shape (api/render.py), dropped with worker_template
    template_shapes: TemplateShapes = field(default_factory=TemplateShapes)
    last_used_s: float | None = None      # time.time() of the last request (touch)
    #: the file as loaded (device, inode, size, mtime ns): a reload reads a model whose file
    #: changed in place again and restarts its workers (:func:`file_id`)
    file_id: tuple = ()

    def touch(self, keep_alive_s: float | None = None) -> None:
        """Record a request (a float timestamp: this runs on every request's path, and a
        local-time ``datetime`` is built only when ``/api/ps`` asks). Its Ollama ``keep_alive``
        (seconds; the handlers validate it) changes nothing: the gateway keeps every model
        loaded (``expires_at``)."""
        self.last_used_s = time.time()

    def expires_at(self, loaded_at: datetime) -> datetime:
        """When ``/api/ps`` says the model unloads: never, shown as Ollama shows a model kept
        forever (``keep_alive`` < 0): the last request (or ``loaded_at``) + Go's largest duration,
        about 292 years later. The gateway never unloads a model it serves, whatever
        ``keep_alive`` a request gave, so any nearer time would be a time it did not unload at."""
        last = (datetime.fromtimestamp(self.last_used_s).astimezone()
                if self.last_used_s is not None else loaded_at)
        return last + GO_MAX_DURATION

    @classmethod
    def load(cls, name: str, path: Path, aliases=(), embeddings: bool = False) -> "ModelEntry":
        st = path.stat()
        e = cls(name=full_name(name), path=path, aliases=tuple(full_name(a) for a in aliases),
                facts=GGUFFacts.read(path), size=st.st_size,
                modified_at=datetime.fromtimestamp(st.st_mtime).astimezone(),
                embeddings=embeddings, file_id=_stat_id(st))
        return e

    async def digest_soon(self, wait_s: float = DIGEST_WAIT_S) -> str:
        """The ``digest`` that ``/api/tags`` and ``/api/ps`` show: the hex sha256 of the file,
        hashed once in a background thread (:meth:`compute_digest_in_background`, at start-up
        and when a reload adds the model; about 1.7 s per GiB on the 2-core development
        machine, minutes for a 40 GB model). Never hashes on the event loop: it waits at most
        ``wait_s`` seconds for that thread, then answers :func:`provisional_digest` (stable
        while the file is unchanged), so a client listing models right after start-up is
        answered at once and every other request keeps being served. Ollama's own digest is its
        manifest's sha256: clients treat the value as an opaque id. Only the first listing
        that finds the hash unfinished waits; later ones answer the provisional digest at once
        (each waited 1 s while a 4 GiB file was hashed; a fresh tester's find)."""
        job = self.compute_digest_in_background()
        if job is None:
            return self._digest
        if self._digest_waited:  # one listing waited already: the others answer at once
            wait_s = 0.0
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), wait_s)
        except (TimeoutError, OSError):  # still hashing, or the file cannot be read now
            self._digest_waited = True
            return provisional_digest(self.path)

    def compute_digest_in_background(self) -> concurrent.futures.Future | None:
        """Start hashing the file in a daemon thread (once; a daemon so that a hash of a large
        file never holds up the gateway's exit; its result is cached in ``digests.json``).
        Returns the hash's future (the one already running, if any), None once it is known."""
        if self._digest is not None:
            return None
        if self._digest_job is not None:
            return self._digest_job
        job: concurrent.futures.Future = concurrent.futures.Future()
        self._digest_job = job

        def run() -> None:
            try:
                self._digest = cached_sha256(self.path)
                job.set_result(self._digest)
            except OSError as e:
                log.warning("inventory.digest_failed", model=self.name, path=str(self.path),
                            error=str(e))
                self._digest_job = None  # a later request tries again
                job.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"digest-{self.name}").start()
        return job

    def details(self) -> dict:
        """Ollama's ``details`` of a model, as ``/api/tags``, ``/api/show`` and ``/api/ps`` give
        it (Ollama's ``api.ModelDetails``: ``parent_model`` has no ``omitempty``, so it is
        always there, ``""`` for a model that was not made from another)."""
        arch = self.facts.architecture or "unknown"
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                "parameter_size": _fmt_params(self.facts.n_params),
                "quantization_level": self.facts.file_type or "unknown"}

    @property
    def context_length(self) -> int:
        """Trained context of the model (``GGUFFacts.context_length``; 0 unknown)."""
        return self.facts.context_length


def provisional_digest(path: Path) -> str:
    """Hex sha256 of ``path|size|mtime_ns`` (the digest cache's key): the ``digest`` shown while
    the file's own hash is still being computed; the same for an unchanged file."""
    try:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        key = str(path)
    return hashlib.sha256(key.encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _digest_cache_file() -> Path:
    from workers.provision import cache_root
    return cache_root() / "digests.json"


_cache_lock = threading.Lock()


def cached_sha256(path: Path, cache_file: Path | None = None) -> str:
    """sha256 (hex) of ``path``, remembered in ``<cache>/digests.json`` keyed by
    ``path|size|mtime_ns`` so a restart does not rehash large files; a changed file is rehashed."""
    cache_file = cache_file or _digest_cache_file()
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    with _cache_lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if isinstance(cache.get(key), str):
            return cache[key]
    digest = _sha256(path)
    with _cache_lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        cache[key] = digest
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
        except OSError as e:
            log.warning("inventory.digest_cache_unwritable", path=str(cache_file), error=str(e))
    return digest


class Inventory:
    """All served models by name, case-insensitive, aliases included."""

    def __init__(self, entries: list[ModelEntry]):
        self.entries = entries
        self._by_name: dict[str, ModelEntry] = {}
        for e in entries:
            for n in (e.name, *e.aliases):
                self._by_name[normalize_model_name(n)] = e

    def resolve(self, name: str | None) -> ModelEntry | None:
        """The entry ``name`` means (``config.normalize_model_name``), or None."""
        if not name or not isinstance(name, str):
            return None
        return self._by_name.get(normalize_model_name(name))


def rfc3339(dt: datetime) -> str:
    """Go's RFC 3339 with nanosecond precision style, e.g. ``2025-05-10T08:06:48.639712-07:00``."""
    return dt.isoformat()


_second: list = [-1, ""]  # [whole second, its "%Y-%m-%dT%H:%M:%S" text]: formatted once a second


def now_utc_z() -> str:
    """``created_at`` as Ollama writes it: UTC with ``Z``, e.g. ``2023-08-04T19:22:45.499127Z``.
    (Called once per streamed network read, so the date part is formatted once a second.)"""
    t = time.time()
    sec = int(t)
    if sec != _second[0]:
        _second[0], _second[1] = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    return f"{_second[1]}.{int((t - sec) * 1e6):06d}Z"


__all__ = ["Inventory", "ModelEntry", "GGUFFacts", "capabilities", "cached_sha256", "full_name",
           "now_utc_z", "rfc3339", "FOREVER"]
