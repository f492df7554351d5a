"""Ollama request/response mapping onto llama-server (one translation per direction).

Requests: Ollama ``options`` → llama-server sampling fields, every field sent explicitly so
Ollama's defaults win over llama-server's (Ollama runner ``llm/llama_server.go`` does the same;
``api/types.go`` ``DefaultOptions`` gives the defaults below).

Responses: llama-server SSE events (``/completion`` chunks or ``/v1/chat/completions`` deltas)
are folded into a ``StreamState`` and turned into Ollama NDJSON objects. Streaming and
non-streaming share this code: non-streaming is the stream collected.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import orjson

from gateway.api.errors import CONTEXT_OVERFLOW_MESSAGE, ApiError
from gateway.api.grammar_checks import check_schema
from gateway.api.openai_fold import fold_tool_call_deltas
from gateway.upstream import error_event

# api/types.go DefaultOptions (the ones Ollama always sends to its runner).
OLLAMA_DEFAULTS: dict = {
    "num_keep": 4, "seed": -1, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
    "repeat_last_n": 64, "temperature": 0.8, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
_INT = {"num_keep", "seed", "top_k", "repeat_last_n", "num_predict", "num_ctx", "num_batch",
        "num_gpu", "main_gpu", "num_thread", "draft_num_predict"}
_FLOAT = {"top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
          "frequency_penalty"}
_BOOL = {"use_mmap", "numa", "penalize_newline"}
# Process-level options: accepted (as Ollama accepts them) but they cannot change a running worker.
_PROCESS_LEVEL = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
                  "draft_num_predict"}
# Ollama runner text for a prompt that does not fit (context shift off), shared/reference A10.
# llama-server field name for each forwarded option.
_RENAME = {"num_keep": "n_keep", "num_predict": "n_predict"}


#: llama-server's sampling flags (common/arg.cpp; its parser takes a value as the next
#: argument only) and the request field whose default each sets.
SAMPLING_FLAGS = {"--temp": "temperature", "--top-k": "top_k", "--top-p": "top_p",
                  "--min-p": "min_p", "--typical": "typical_p",
                  "--repeat-last-n": "repeat_last_n", "--repeat-penalty": "repeat_penalty",
                  "--presence-penalty": "presence_penalty",
                  "--frequency-penalty": "frequency_penalty", "-s": "seed", "--seed": "seed"}


def sampling_set_by(args) -> frozenset[str]:
    """The request fields whose default the operator chose with llama-server flags in ``args``
    (``models[].args``, ``llama_server.extra_args``): the gateway sends no default of its own
    for them, so the worker's applies, as an Ollama Modelfile's ``PARAMETER`` lines are the
    model's defaults."""
    return frozenset(SAMPLING_FLAGS[a] for a in args if a in SAMPLING_FLAGS)


def past_int64(v) -> bool:
    """Whether ``v`` is a whole float at least 2**63 in size: an integer literal orjson could
    not keep as an integer (it reads those past 64 bits as floats, and the float nearest
    -2**63 - 1 is -2**63, which a range check lets through)."""
    return isinstance(v, float) and v.is_integer() and abs(v) >= 2.0 ** 63


def map_options(options: object, *, num_predict_default: int, num_predict_max: int | None,
                ignored: list[str] | None = None, operator_set: frozenset = frozenset()) -> dict:
    """Ollama ``options`` → llama-server body fields.

    Returns a dict with every sampling field set (Ollama defaults filled in, except the fields
    in ``operator_set``, whose default the worker's own flags give: :func:`sampling_set_by`)
    plus ``n_predict``.
    Unknown keys are skipped and appended to ``ignored`` (Ollama logs ``invalid option
    provided``); ``null`` values are skipped. Raises ApiError(400) on a wrong type, e.g.
    ``option "top_k" must be of type integer``.
    """
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    out = {k: v for k, v in OLLAMA_DEFAULTS.items() if k not in operator_set}
    num_predict = num_predict_default
    for k, v in options.items():
        if v is None:
            continue
        if k in _INT:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ApiError(400, f'option "{k}" must be of type integer')
            if past_int64(v) or not INT64_MIN <= v <= INT64_MAX:  # Go's int is 64-bit; so is
                # llama-server's JSON
                raise ApiError(400, f'option "{k}" is out of range for a 64-bit integer')
            v = int(v)
            if k == "num_keep" and v < -1:  # llama-server's 400 named its own field, n_keep
                raise ApiError(400, f'option "num_keep" must be -1 (the whole prompt) or more, '
                                    f'got {v}')
        elif k in _FLOAT:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ApiError(400, f'option "{k}" must be of type float')
            v = float(v)
        elif k in _BOOL:
            if not isinstance(v, bool):
                raise ApiError(400, f'option "{k}" must be of type boolean')
        elif k == "stop":  # a plain string too is Ollama's 400 (api/types.go FromMap)
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise ApiError(400, 'option "stop" must be of type array of strings')
        else:
            if ignored is not None:
                ignored.append(k)
            continue
        if k == "num_predict":
            num_predict = v
            continue
        if k in _PROCESS_LEVEL or k in _BOOL:
            continue
        out[k] = v
    # 0 is "no limit" as for a negative value: Ollama's runners stop only at
    # ``numPredict > 0 && numPredicted >= numPredict`` (ollamarunner/llamarunner); llama-server
    # made 1 token of n_predict 0 (a fresh tester's find)
    if num_predict is None or num_predict <= 0:
        num_predict = -1
    if num_predict_max is not None and (num_predict < 0 or num_predict > num_predict_max):
        num_predict = num_predict_max
    out["n_predict"] = num_predict
    out["n_keep"] = out.pop("num_keep")
    if out.get("seed", -1) == -1:
        out.pop("seed", None)
    return out


@dataclass
class StreamState:
    """What the upstream stream has told us so far (both endpoint shapes).

    Times are ``time.monotonic_ns()`` values; ``timings`` is llama-server's ``timings`` object
    (``prompt_n``, ``cache_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms`` …).
    """

    t_start_ns: int
    t_loaded_ns: int = 0
    done_reason: str | None = None
    timings: dict = field(default_factory=dict)
    usage: dict = field(default_factory=dict)
    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    error: str | None = None
    created_at: str = ""  # Ollama ``created_at`` for the chunks of the current network read
    error_status: int = 500
    logprobs: list[dict] = field(default_factory=list)   # Ollama-shaped, pending for the next chunk

    # --- folding one upstream event -------------------------------------------------------
    def fold_completion(self, ev: dict) -> str:
        """A ``/completion`` chunk; returns the content piece. ``stop_type`` gives done_reason
        (``limit`` → ``length``, ``eos``/``word`` → ``stop``; server-task.cpp)."""
        if "error" in ev:
            self._fold_error(ev["error"])
            return ""
        piece = ev.get("content") or ""
        if ev.get("completion_probabilities"):
            self.logprobs.extend(ollama_logprobs(ev["completion_probabilities"]))
        if ev.get("stop"):
            st = ev.get("stop_type")
            self.done_reason = "length" if st == "limit" else "stop"
            self.timings = ev.get("timings") or self.timings
        return piece

    def fold_completion_pair(self, ev: dict) -> tuple[str, str]:
        """``fold_completion`` shaped like ``fold_chat``: (content, thinking="")."""
        return self.fold_completion(ev), ""

    def fold_chat(self, ev: dict) -> tuple[str, str]:
        """A ``/v1/chat/completions`` chunk; returns (content, thinking) pieces."""
        if "error" in ev:
            self._fold_error(ev["error"])
            return "", ""
        if ev.get("timings"):
            self.timings = ev["timings"]
        if ev.get("usage"):
            self.usage = ev["usage"]
        choices = ev.get("choices") or ()
        if not choices:
            return "", ""
        ch = choices[0]
        delta = ch.get("delta") or ch.get("message") or {}
        if (ch.get("logprobs") or {}).get("content"):
            self.logprobs.extend(ollama_logprobs(ch["logprobs"]["content"]))
        fold_tool_call_deltas(self.tool_calls, delta.get("tool_calls"))
        fr = ch.get("finish_reason")
        if fr:
            self.done_reason = "length" if fr == "length" else "stop"
        return delta.get("content") or "", delta.get("reasoning_content") or ""

    def _fold_error(self, err) -> None:
        self.error = _err_text(err)
        if isinstance(err, dict) and err.get("type") == "exceed_context_size_error":
            self.error, self.error_status = CONTEXT_OVERFLOW_MESSAGE, 400
        elif (e := error_event(err)).kind == "kv_exhausted" or 400 <= e.status < 500:
            # load: 503; a 500 that is the request's fault: 400 (upstream.error_event)
            self.error, self.error_status = e.message, e.status

    def take_logprobs(self, top: int = 20) -> list[dict]:
        """The logprobs gathered since the last call; ``top_logprobs`` dropped when ``top`` is 0
        (upstream is always asked for at least one alternative)."""
        out, self.logprobs = self.logprobs, []
        if top == 0:
            for e in out:
                e.pop("top_logprobs", None)
        return out

    # --- Ollama final fields ------------------------------------------------------------------
    def metrics(self) -> dict:
        """Ollama's final-chunk metrics, all integer ns / token counts, non-zero durations.

        ``prompt_eval_count = timings.cache_n + timings.prompt_n`` (Ollama promptEvalCount),
        ``*_duration = *_ms × 1e6``; ``total_duration`` is the gateway's wall clock from
        receipt to now; ``load_duration`` from receipt until the worker was leased.
        """
        t = self.timings
        now = time.monotonic_ns()
        prompt_n = int(t.get("prompt_n", 0) or 0) + int(t.get("cache_n", 0) or 0)
        if not prompt_n and self.usage:
            prompt_n = int(self.usage.get("prompt_tokens", 0) or 0)
        eval_n = int(t.get("predicted_n", 0) or 0) or int(self.usage.get("completion_tokens", 0) or 0)
        loaded = self.t_loaded_ns or now
        return {
            "total_duration": max(1, now - self.t_start_ns),
            "load_duration": max(1, loaded - self.t_start_ns),
            "prompt_eval_count": prompt_n,
            "prompt_eval_duration": max(1, int(float(t.get("prompt_ms", 0) or 0) * 1e6)),
            "eval_count": eval_n,
            "eval_duration": max(1, int(float(t.get("predicted_ms", 0) or 0) * 1e6)),
        }


def _err_text(err) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


# --- request field validation (Ollama api/types.go, routes.go) ---------------------------------

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
             "h": 3600.0}
_GO_DURATION = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
#: Go's time.Duration is int64 nanoseconds: ParseDuration refuses a longer one ("invalid
#: duration"), as Ollama then does a keep_alive such as "9999999h".
_GO_DURATION_MAX_S = (2**63 - 1) / 1e9


def parse_go_duration(text: str) -> float:
    """Go ``time.ParseDuration`` → seconds (``"5m"``, ``"1h30m"``, ``"-1s"``, ``"0"``, ``".5s"``,
    ``"5.s"``). Raises ValueError on anything else, and past Go's int64 nanoseconds (~292
    years)."""
    s = text.strip()
    sign = 1.0
    if s[:1] in "+-" and s:
        sign, s = (-1.0 if s[0] == "-" else 1.0), s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(text)
    pos, total = 0, 0.0
    for m in _GO_DURATION.finditer(s):
        if m.start() != pos:
            raise ValueError(text)
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or total > _GO_DURATION_MAX_S:
        raise ValueError(text)
    return sign * int(total * 1e9) / 1e9  # whole nanoseconds, as Go's: "0.1ns" is 0


def parse_keep_alive(value) -> float | None:
    """Ollama ``keep_alive`` → seconds (None when absent). A number is seconds, a string a Go
    duration; negative means forever (types.go ``Duration.UnmarshalJSON``).
    Raises ApiError(400) ``invalid keep_alive: …`` otherwise (Ollama: ``Unsupported type`` /
    ``time: invalid duration``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ApiError(400, f"invalid keep_alive: unsupported type {type(value).__name__}")
    if isinstance(value, (int, float)):
        # whole seconds: Ollama takes int(t) * time.Second, so 0.5 is 0 (unload)
        return float(value) if value < 0 or math.isinf(value) else float(int(value))
    if isinstance(value, str):
        try:
            return parse_go_duration(value)
        except ValueError:
            # Go's time.ParseDuration says which: a number without a unit is its own error
            why = ("missing unit in duration" if value.strip().lstrip("+-").replace(".", "", 1).isdigit()
                   else "invalid duration")
            raise ApiError(400, f'invalid keep_alive: time: {why} "{value}"') from None
    raise ApiError(400, "invalid keep_alive: unsupported type")


def is_unload(keep_alive_s: float | None) -> bool:
    return keep_alive_s is not None and keep_alive_s == 0


THINK_LEVELS = ("low", "medium", "high", "max")


def parse_think(value) -> bool | str | None:
    """Ollama ``think``: bool or ``"low"|"medium"|"high"|"max"`` (types.go ``ThinkValue``).
    ``"true"``/``"false"`` strings count as bools. Raises ApiError(400) ``invalid think value``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value in THINK_LEVELS:
            return value
        if value in ("true", "false"):
            return value == "true"
    raise ApiError(400, f"invalid think value: {orjson.dumps(value).decode()} "
                        f'(must be a boolean or "low", "medium", "high", "max")')


def parse_logprobs(body: dict) -> tuple[bool, int]:
    """(``logprobs``, ``top_logprobs``); top_logprobs outside 0..20 → ApiError(400) with Ollama's
    text ``top_logprobs must be between 0 and 20``."""
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):  # "", [], {} too (Ollama: a decoding 400)
        raise ApiError(400, "logprobs must be a boolean")
    top = body.get("top_logprobs")
    top = 0 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20")
    return lp is True, top


def format_fields(fmt, *, chat: bool) -> dict:
    """Ollama ``format`` → llama-server fields (Ollama runner mapping): ``"json"`` →
    ``response_format json_object`` (chat) / ``json_schema {}`` (/completion); a schema object →
    ``response_format json_schema`` / ``json_schema``. Raises ApiError(400) otherwise, and for a
    schema the pinned llama-server cannot take (``grammar_checks.check_schema``)."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}} if chat else {"json_schema": {}}
    if isinstance(fmt, dict):
        check_schema(fmt, "format", rewrite=True)  # bounds that would freeze the worker: 400
        if chat:
            return {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "schema", "schema": fmt}}}
        return {"json_schema": fmt}
    raise ApiError(400, f'invalid format: {orjson.dumps(fmt).decode()}; expected "json" or a '
                        f'valid JSON Schema object')


def ollama_logprobs(items: list[dict]) -> list[dict]:
    """llama-server ``completion_probabilities`` / chat ``logprobs.content`` entries → Ollama
    ``logprobs`` entries ``{token, logprob, bytes, top_logprobs:[{token, logprob, bytes}]}``."""
    out = []
    for it in items or ():
        e = {"token": it.get("token", ""), "logprob": float(it.get("logprob", 0.0))}
        if it.get("bytes") is not None:
            e["bytes"] = it["bytes"]
        tops = it.get("top_logprobs")
        if tops:
            e["top_logprobs"] = [{"token": t.get("token", ""), "logprob": float(t.get("logprob", 0.0)),
                                  **({"bytes": t["bytes"]} if t.get("bytes") is not None else {})}
                                 for t in tops]
        out.append(e)
    return out


def tool_call_out(index: int, tc: dict) -> dict:
    """A gathered streamed tool call ``{id, name, arguments:<JSON string>}`` → Ollama's
    ``{"id"?, "function": {"index", "name", "arguments": {object}}}``. Arguments that are not a
    JSON object are kept as ``{"_raw": text}`` (clients require an object)."""
    try:
        args = orjson.loads(tc["arguments"]) if tc["arguments"] else {}
    except orjson.JSONDecodeError:
        args = {"_raw": tc["arguments"]}
    if not isinstance(args, dict):
        args = {"_raw": tc["arguments"]}
    out = {"function": {"index": index, "name": tc["name"], "arguments": args}}
    if tc.get("id"):
        out["id"] = tc["id"]
    return out
