"""``/v1/completions`` answers in OpenAI's legacy completion shape, where llama-server's differ.

llama-server answers ``/v1/completions`` with its chat-style ``logprobs`` (``{"content": [{"id",
"token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes", "logprob"}]}]}``,
server-task.cpp ``probs_vector_to_json``) and an ``id`` of ``chatcmpl-…``. OpenAI's completions
API, its ``openai`` client (``CompletionChoice.logprobs``: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and Ollama's ``/v1/completions`` (``cmpl-N`` ids) use::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{token: logprob}],
     "text_offset": [int]}

``text_offset`` is each token's character offset in the choice's generated text (counted from
the start of the completion, as vLLM does without ``echo``); ``top_logprobs`` holds the
``logprobs`` most likely tokens plus the sampled one ("up to logprobs+1 elements", OpenAI's API
reference). Logprobs are natural logarithms, as llama-server gives them.
"""

from __future__ import annotations

import orjson

from gateway.api.errors import ApiError

#: Most alternatives per token a client may ask for (Ollama's ``top_logprobs`` bound; OpenAI's
#: completions API allows 5).
MAX_LOGPROBS = 20

_CHAT_ID = b'"id":"chatcmpl-'
_CMPL_ID = b'"id":"cmpl-'


def check_logprobs(body: dict) -> int | None:
    """Check a ``/v1/completions`` body's ``logprobs`` (OpenAI: an integer, the alternatives
    per token) and ask llama-server for them (``n_probs``, at least 1 so that the sampled token's
    own logprob comes too). Returns the number asked for, or None when none was.
    Raises ApiError(400) for a boolean, a non-integer or a value outside 0..MAX_LOGPROBS, and
    for ``echo: true`` (or an ``echo`` that is not a boolean)."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(400, f"echo must be a boolean, got {orjson.dumps(echo).decode()[:40]}")
    if echo:  # llama-server ignored it without a word; it computes no prompt logprobs either
        raise ApiError(400, "echo is not supported on /v1/completions by this gateway "
                            "(llama-server returns neither the prompt nor its logprobs)")
    lp = body.get("logprobs")
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be an integer between 0 and {MAX_LOGPROBS} on "
                            f"/v1/completions, got {orjson.dumps(lp).decode()[:40]}")
    body.setdefault("n_probs", max(lp, 1))
    return lp


class LegacyCompletions:
    """Turns llama-server's ``/v1/completions`` events (streamed) or folded answer into OpenAI's
    legacy shape (module doc). ``top``: the client's ``logprobs`` (None: keep every alternative
    llama-server sent, e.g. for a client that asked with llama-server's ``n_probs``)."""

    def __init__(self, top: int | None):
        self.top = top
        self._offset: dict[int, int] = {}  # choice index -> characters generated so far

    def events(self, batch: list[bytes]) -> list[bytes]:
        """One batch of SSE payloads (bytes, as ``iter_sse_batches`` gives them), converted.
        Events without logprobs only get their ``id`` prefix changed, without parsing."""
        out = []
        for data in batch:
            if b'"logprobs":{' in data:
                ev = orjson.loads(data)
                for ch in ev.get("choices") or ():
                    self._convert(ch)
                if isinstance(ev.get("id"), str):
                    ev["id"] = cmpl_id(ev["id"])
                out.append(orjson.dumps(ev))
            else:
                out.append(data.replace(_CHAT_ID, _CMPL_ID, 1))
        return out

    def answer(self, obj: dict) -> dict:
        """A folded non-streamed answer (``OpenAIFold.result``), converted in place; returns it."""
        for ch in obj.get("choices") or ():
            self._convert(ch)
        if isinstance(obj.get("id"), str):
            obj["id"] = cmpl_id(obj["id"])
        return obj

    def _convert(self, ch: dict) -> None:
        lp = ch.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
            return
        idx = ch.get("index", 0)
        offset = self._offset.get(idx, 0)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for e in lp["content"]:
            tok, logprob = e.get("token", ""), e.get("logprob")
            tokens.append(tok)
            token_logprobs.append(logprob)
            alts = e.get("top_logprobs") or []
            if self.top is not None:
                alts = alts[:self.top]
            top = {a.get("token", ""): a.get("logprob") for a in alts}
            top.setdefault(tok, logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(tok)
        self._offset[idx] = offset
        ch["logprobs"] = {"tokens": tokens, "token_logprobs": token_logprobs,
                          "top_logprobs": tops, "text_offset": offsets}


def cmpl_id(value: str) -> str:
    """``chatcmpl-X`` → ``cmpl-X`` (OpenAI's and Ollama's completion id prefix)."""
    return "cmpl-" + value[len("chatcmpl-"):] if value.startswith("chatcmpl-") else value
