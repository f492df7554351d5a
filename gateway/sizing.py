"""Request size estimates and prefix keys for admission tickets (no I/O).

The gateway does not tokenize on the hot path. It estimates a prompt's tokens from its UTF-8
size and a bytes-per-token ratio: the configured ``scheduler.bytes_per_token`` until the fleet
has measured the model's tokenizer on a worker (``/tokenize`` of a sample text,
``gateway.fleet``). Bytes of non-ASCII characters (CJK, Cyrillic …) have a ratio of their own
(``wide_bytes_per_token``, measured on samples of such text): a tokenizer spends far more
tokens per byte on them (0.9 bytes a token for the demo's byte-level vocabulary against 1.9 for
English), and a ratio measured on English let 4 requests of CJK prompts onto a worker whose KV
cache held 2 (tester S: 503 for the other two). ASCII digits and punctuation have a third
(``dense_bytes_per_token``, measured on digits and code symbols): about a token a byte for the
demo, and at the prose ratio several prompts of numbers or code overflowed a worker's shared
KV cache (tester U). For the up-front "cannot fit" refusal the estimate is divided by
``REFUSE_SAFETY`` (1.25) so that text that tokenizes better than the sample is not refused
wrongly; the worker itself still refuses what slips through (llama-server
``exceed_context_size_error``, relayed as 400).

The prefix key hashes the head of the prompt (system prompt and first messages, up to
``scheduler.prefix_bytes`` bytes). The prefix chain hashes the prompt up to each of its
boundaries (after each chat message; for a plain prompt after ``prefix_bytes`` × 1, 2, 4, …
bytes and at its end), with the estimated tokens up to there: the next turn of a conversation
repeats the previous turn's prompt, so its chain contains the previous turn's last key, and the
scorer finds the worker that served it (prefix affinity, gateway/scheduling/scorer.py).

A ``/v1`` request with ``n`` choices occupies ``n`` slots of its worker (``choices``); a
``/v1/completions`` with several prompts (``prompt`` a list of strings or of token lists)
occupies one slot per prompt and choice (``prompts_of`` × ``choices``).
"""

from __future__ import annotations

import hashlib
import math
import string
from dataclasses import dataclass
from typing import Iterable

REFUSE_SAFETY = 1.25
_MSG_OVERHEAD_BYTES = 8  # chat template tokens per message (e.g. ChatML "<|im_start|>role\n")
CHAIN_HEAD, CHAIN_TAIL = 4, 28  # prefix-chain boundaries kept: the first 4 and the last 28

Chain = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SizeEstimate:
    """prompt_tokens: estimated prompt tokens (for the up-front refusal, already divided by
    REFUSE_SAFETY); prefill_tokens: estimated prompt tokens the worker computes before the
    first token (bytes / bytes per token, rounded up; the token count for a token list);
    est_tokens: KV tokens the request may occupy (prompt + generation);
    prefix_key: 64-bit hash of the prompt head, None when there is no prompt;
    prefix_chain: (64-bit key, estimated tokens) at each prompt boundary, shortest first;
    slots: slots the request takes on its worker (prompts × ``choices``), each holding
    ``est_tokens``; prompts: of those, the prompts (``prompts_of``; slots / prompts choices each).
    With several prompts, ``prompt_tokens`` is the largest one's (each must fit a slot),
    ``prefill_tokens`` their sum (llama-server computes each prompt once, its choices share it)
    and ``est_tokens`` the mean per prompt (so ``est_tokens`` × ``slots`` covers them all)."""

    prompt_tokens: int
    est_tokens: int
    prefix_key: int | None
    prefix_chain: Chain = ()
    prefill_tokens: int = 0
    slots: int = 1
    prompts: int = 1


def choices(body: dict) -> int:
    """Slots an upstream completion body takes on one llama-server: its ``n_cmpl``, else ``n``
    (llama-server reads ``n_cmpl`` first and ``n`` as its alias, server-schema.cpp, and runs
    that many tasks side by side, one slot each, tools/server/server-context.cpp); 1 when both
    are absent or not a number of at least 1 (llama-server then answers 400 itself). A fraction
    counts as its integer part, as llama-server converts it."""
    v = body.get("n_cmpl")
    if v is None:
        v = body.get("n")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 1:
        return int(v)
    return 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def prompts_of(body: dict) -> list | None:
    """The prompts llama-server runs for an upstream ``/v1/completions`` body, one task (times
    ``choices``) each: its ``prompt`` when that is a non-empty list with no integer at its top
    level (a list of strings, of token lists, or of multimodal objects), else None (one prompt:
    a string, a token list, a mixed list of strings and tokens; tools/server/server-common.cpp
    ``tokenize_input_prompts``). A chat body (``messages``) has one prompt, its template's."""
    p = body.get("prompt")
    if isinstance(body.get("messages"), list):
        return None
    if isinstance(p, list) and p and not any(_is_int(e) for e in p):
        return p
    return None


def prefix_chain(parts: Iterable[tuple[bytes, int]]) -> Chain:
    """(key, tokens) after each part of a prompt: ``key`` hashes every part up to and including
    this one (64-bit BLAKE2b, stable across processes), ``tokens`` adds up the parts' token
    counts. Only the first ``CHAIN_HEAD`` and last ``CHAIN_TAIL`` boundaries are kept: the head
    names a shared system prompt, the tail the latest turns of a conversation."""
    h = hashlib.blake2b(digest_size=8)
    out, tokens = [], 0
    for data, n in parts:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        tokens += n
        out.append((int.from_bytes(h.copy().digest(), "big"), tokens))
    if len(out) > CHAIN_HEAD + CHAIN_TAIL:
        out = out[:CHAIN_HEAD] + out[-CHAIN_TAIL:]
    return tuple(out)


def _doubling(n: int, first: int) -> list[int]:
    """Boundaries ``first``, 2 × first, 4 × first … below ``n``, then ``n``."""
    out, b = [], first
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


def content_text(content) -> str:
    """A message's text: a string, or its OpenAI content parts' ``text`` joined (other types
    give "")."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(t for p in content if isinstance(p, dict)
                       and isinstance(t := p.get("text"), str))
    return ""


def _chain_parts(body: dict, ratios: Ratios, prefix_bytes: int,
                 prompt_tokens: int | None = None) -> list[tuple[bytes, int]]:
    """The parts ``prefix_chain`` hashes: one per chat message (role and text), else slices of
    a plain prompt (string or token ids) at doubling boundaries. ``prompt_tokens``: the
    estimated tokens of a string ``prompt`` when the caller has them (then a prompt of at most
    ``prefix_bytes`` bytes, one part, is not estimated again)."""
    msgs = body.get("messages")
    bytes_per_token = ratios.ascii

    def tokens(b: bytes, extra: int = 0) -> int:
        return math.ceil(ratios.tokens(b, extra))
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                b = str(m.get("role", "")).encode() + b"\0" + content_text(m.get("content")).encode()
                parts.append((b, tokens(b, _MSG_OVERHEAD_BYTES)))
        return parts
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        data: bytes | list = prompt.encode()
        if prompt_tokens is not None and len(data) <= prefix_bytes:
            return [(data, prompt_tokens)]
        first = prefix_bytes
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        data = prompt
        first = max(1, math.ceil(prefix_bytes / bytes_per_token))
    else:
        return []
    parts, prev = [], 0
    for b in _doubling(len(data), first):
        chunk = data[prev:b]
        if isinstance(chunk, bytes):
            parts.append((chunk, tokens(chunk)))
        else:
            parts.append((repr(chunk).encode(), b - prev))
        prev = b
    return parts


def prompt_head_and_size(body: dict) -> tuple[bytes, int]:
    """(flattened prompt bytes up to any length, total prompt bytes) of an upstream body with
    ``messages`` (chat) or ``prompt`` (completion: a string or a list of token ids)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                parts.append(str(m.get("role", "")).encode() + b"\0" + content_text(m.get("content")).encode())
        flat = b"\1".join(parts)
        return flat, len(flat) + _MSG_OVERHEAD_BYTES * len(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        b = prompt.encode()
        return b, len(b)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return repr(prompt[:256]).encode(), -len(prompt)  # negative: already tokens
    return b"", 0


_HIGH_BYTES = bytes(range(128, 256))
#: ASCII digits and punctuation: text of them tokenizes far worse than prose
_DENSE_BYTES = (string.digits + string.punctuation).encode()


def wide_bytes(data: bytes) -> int:
    """Bytes of ``data`` (UTF-8) that belong to non-ASCII characters."""
    return len(data) - len(data.translate(None, _HIGH_BYTES))


def dense_bytes(data: bytes) -> int:
    """Bytes of ``data`` that are ASCII digits or punctuation."""
    return len(data) - len(data.translate(None, _DENSE_BYTES))


@dataclass(frozen=True)
class Ratios:
    """UTF-8 bytes per token of a model's tokenizer: ``ascii`` of ASCII letters and
    whitespace (prose), ``wide`` of non-ASCII characters, ``dense`` of ASCII digits and
    punctuation (None: ``ascii`` stands for it). Measured by ``gateway.fleet`` on a worker's
    ``/tokenize``."""

    ascii: float
    wide: float | None = None
    dense: float | None = None

    def tokens(self, data: bytes, extra: int = 0) -> float:
        """Estimated tokens of the text ``data`` plus ``extra`` bytes of prose (no rounding)."""
        return self.tokens_of(len(data) + extra,
                              wide_bytes(data) if self.wide is not None else 0,
                              dense_bytes(data) if self.dense is not None else 0)

    def tokens_of(self, size: int, wide: int = 0, dense: int = 0) -> float:
        """Estimated tokens of ``size`` bytes of text, ``wide`` of them non-ASCII and
        ``dense`` ASCII digits or punctuation (no rounding)."""
        t = (size - wide - dense) / self.ascii
        t += wide / (self.wide or self.ascii)
        return t + dense / (self.dense or self.ascii)


def _prompt_tokens(size: int, data: bytes, ratios: Ratios) -> tuple[int, int]:
    """(estimated tokens, tokens for the up-front refusal) of ``prompt_head_and_size``'s size
    (bytes of the text ``data``, or tokens when negative)."""
    if size < 0:
        return -size, -size
    t = ratios.tokens(data, size - len(data))
    return math.ceil(t), math.floor(t / REFUSE_SAFETY)


def estimate(body: dict, *, bytes_per_token: float, prefix_bytes: int,
             unknown_num_predict: int, n_ctx: int = 0,
             counted_tokens: int | None = None,
             wide_bytes_per_token: float | None = None,
             dense_bytes_per_token: float | None = None) -> SizeEstimate:
    """Size estimate of one upstream request body. ``bytes_per_token``: UTF-8 bytes per token
    of ASCII prose, ``wide_bytes_per_token`` of non-ASCII text, ``dense_bytes_per_token`` of
    ASCII digits and punctuation (None: ``bytes_per_token``; ``Ratios``). ``n_predict`` / ``max_tokens`` /
    ``max_completion_tokens`` give the generation budget; when absent or < 0,
    ``unknown_num_predict`` tokens are assumed (capped by ``n_ctx`` if known).
    ``counted_tokens``: the prompt's tokens as a worker's tokenizer counted them (the prompt
    length check, gateway/limits.py), used instead of the bytes estimate for a single prompt,
    for the refusal as well (a text that tokenizes much worse than the sample, such as a
    word repeated, is otherwise refused while it fits). For a chat it counts the messages'
    contents, not the template's few tokens per message: the worker still refuses what does
    not fit.

    Several prompts (``prompts_of``): each string or token list is sized as a prompt of its
    own (other kinds count 0 tokens: the worker still refuses one too long); the estimate
    combines them as :class:`SizeEstimate` says, with no prefix key (one prompt in a list is
    sized and keyed as that prompt)."""
    return estimate_with(body, Ratios(bytes_per_token, wide_bytes_per_token, dense_bytes_per_token),
                         prefix_bytes=prefix_bytes, unknown_num_predict=unknown_num_predict,
                         n_ctx=n_ctx, counted_tokens=counted_tokens)


def estimate_with(body: dict, ratios: Ratios, *, prefix_bytes: int, unknown_num_predict: int,
                  n_ctx: int = 0, counted_tokens: int | None = None) -> SizeEstimate:
    """:func:`estimate` with a model's :class:`Ratios` as the fleet keeps them (none built per
    request)."""
    several = prompts_of(body)
    if several is not None and len(several) == 1:
        body, several = {**body, "prompt": several[0]}, None
    gen = body.get("n_predict", body.get("max_tokens", body.get("max_completion_tokens")))
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        gen = unknown_num_predict
    if several is not None:
        sizes = []
        for p in several:
            head, size = prompt_head_and_size({"prompt": p})
            sizes.append(_prompt_tokens(size, head, ratios))
        kv = [min(t + gen, n_ctx) if n_ctx else t + gen for t, _ in sizes]
        return SizeEstimate(prompt_tokens=max(r for _, r in sizes),
                            est_tokens=math.ceil(sum(kv) / len(kv)), prefix_key=None,
                            prefill_tokens=sum(t for t, _ in sizes),
                            slots=len(several) * choices(body), prompts=len(several))
    flat, size = prompt_head_and_size(body)
    prompt, refuse = _prompt_tokens(size, flat, ratios)
    estimated = prompt
    if counted_tokens is not None:
        prompt = refuse = counted_tokens
    est = prompt + gen
    if n_ctx:
        est = min(est, n_ctx)
    key = None
    if flat:
        key = int.from_bytes(hashlib.blake2b(flat[:prefix_bytes], digest_size=8).digest(), "big")
    one_text = isinstance(body.get("prompt"), str) and not isinstance(body.get("messages"), list)
    chain = prefix_chain(_chain_parts(body, ratios, prefix_bytes,
                                      estimated if one_text else None))
    return SizeEstimate(prompt_tokens=refuse, est_tokens=est, prefix_key=key, prefix_chain=chain,
                        prefill_tokens=prompt, slots=choices(body))
