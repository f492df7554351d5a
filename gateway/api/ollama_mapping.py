"""Ollama request/response mapping onto llama-server (one translation per direction).

Requests: Ollama ``options`` → llama-server sampling fields, every field sent explicitly so
Ollama's defaults win over llama-server's (Ollama runner ``llm/llama_server.go`` does the same;
``api/types.go`` ``DefaultOptions`` gives the defaults below).

Responses: llama-server SSE events (``/completion`` chunks or ``/v1/chat/completions`` deltas)
are folded into a ``StreamState`` and turned into Ollama NDJSON objects. Streaming and
non-streaming share this code: non-streaming is the stream collected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.api.errors import ApiError

# api/types.go DefaultOptions (the ones Ollama always sends to its runner).
OLLAMA_DEFAULTS: dict = {
    "num_keep": 4, "seed": -1, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
    "repeat_last_n": 64, "temperature": 0.8, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
_INT = {"num_keep", "seed", "top_k", "repeat_last_n", "num_predict", "num_ctx", "num_batch",
        "num_gpu", "main_gpu", "num_thread", "draft_num_predict"}
_FLOAT = {"top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
          "frequency_penalty"}
_BOOL = {"use_mmap", "numa", "penalize_newline"}
# Process-level options: accepted (as Ollama accepts them) but they cannot change a running worker.
_PROCESS_LEVEL = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
                  "draft_num_predict"}
# llama-server field name for each forwarded option.
_RENAME = {"num_keep": "n_keep", "num_predict": "n_predict"}


def map_options(options: object, *, num_predict_default: int, num_predict_max: int | None,
                ignored: list[str] | None = None) -> dict:
    """Ollama ``options`` → llama-server body fields.

    Returns a dict with every sampling field set (Ollama defaults filled in) plus ``n_predict``.
    Unknown keys are skipped and appended to ``ignored`` (Ollama logs ``invalid option
    provided``); ``null`` values are skipped. Raises ApiError(400) on a wrong type, e.g.
    ``option "top_k" must be of type integer``.
    """
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, "options must be an object")
    out = dict(OLLAMA_DEFAULTS)
    num_predict = num_predict_default
    for k, v in options.items():
        if v is None:
            continue
        if k in _INT:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ApiError(400, f'option "{k}" must be of type integer')
            v = int(v)
        elif k in _FLOAT:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ApiError(400, f'option "{k}" must be of type float')
            v = float(v)
        elif k in _BOOL:
            if not isinstance(v, bool):
                raise ApiError(400, f'option "{k}" must be of type boolean')
        elif k == "stop":
            if isinstance(v, str):
                v = [v]
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
    if num_predict is None or num_predict < 0:
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

    # --- folding one upstream event -------------------------------------------------------
    def fold_completion(self, ev: dict) -> str:
        """A ``/completion`` chunk; returns the content piece. ``stop_type`` gives done_reason
        (``limit`` → ``length``, ``eos``/``word`` → ``stop``; server-task.cpp)."""
        if "error" in ev:
            self.error = _err_text(ev["error"])
            return ""
        piece = ev.get("content") or ""
        if ev.get("stop"):
            st = ev.get("stop_type")
            self.done_reason = "length" if st == "limit" else "stop"
            self.timings = ev.get("timings") or self.timings
        return piece

    def fold_chat(self, ev: dict) -> tuple[str, str]:
        """A ``/v1/chat/completions`` chunk; returns (content, thinking) pieces."""
        if "error" in ev:
            self.error = _err_text(ev["error"])
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
        for tc in delta.get("tool_calls") or ():
            slot = self.tool_calls.setdefault(tc.get("index", len(self.tool_calls)),
                                              {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.get("id") or ""
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        fr = ch.get("finish_reason")
        if fr:
            self.done_reason = "length" if fr == "length" else "stop"
        return delta.get("content") or "", delta.get("reasoning_content") or ""

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
