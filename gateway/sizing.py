"""Request size estimates and prefix keys for admission tickets (no I/O).

The gateway does not tokenize on the hot path. It estimates a prompt's tokens from its UTF-8
size and a bytes-per-token ratio: the configured ``scheduler.bytes_per_token`` until the fleet
has measured the model's tokenizer on a worker (``/tokenize`` of a sample text,
``gateway.fleet``). For the up-front "cannot fit" refusal the estimate is divided by
``REFUSE_SAFETY`` (1.25) so that text that tokenizes better than the sample is not refused
wrongly; the worker itself still refuses what slips through (llama-server
``exceed_context_size_error``, relayed as 400).

The prefix key hashes the head of the prompt (system prompt and first messages, up to
``scheduler.prefix_bytes`` bytes): requests sharing it are sent to the same worker (prefix
affinity, gateway/scheduling/scorer.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

REFUSE_SAFETY = 1.25
_MSG_OVERHEAD_BYTES = 8  # chat template tokens per message (e.g. ChatML "<|im_start|>role\n")


@dataclass(frozen=True)
class SizeEstimate:
    """prompt_tokens: estimated prompt tokens (for the up-front refusal, already divided by
    REFUSE_SAFETY); est_tokens: KV tokens the request may occupy (prompt + generation);
    prefix_key: 64-bit hash of the prompt head, None when there is no prompt."""

    prompt_tokens: int
    est_tokens: int
    prefix_key: int | None


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_head_and_size(body: dict) -> tuple[bytes, int]:
    """(flattened prompt bytes up to any length, total prompt bytes) of an upstream body with
    ``messages`` (chat) or ``prompt`` (completion: a string or a list of token ids)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                parts.append(str(m.get("role", "")).encode() + b"\0" + _text_of(m.get("content")).encode())
        flat = b"\1".join(parts)
        return flat, len(flat) + _MSG_OVERHEAD_BYTES * len(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        b = prompt.encode()
        return b, len(b)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return repr(prompt[:256]).encode(), -len(prompt)  # negative: already tokens
    return b"", 0


def estimate(body: dict, *, bytes_per_token: float, prefix_bytes: int,
             unknown_num_predict: int, n_ctx: int = 0) -> SizeEstimate:
    """Size estimate of one upstream request body. ``n_predict`` / ``max_tokens`` /
    ``max_completion_tokens`` give the generation budget; when absent or < 0,
    ``unknown_num_predict`` tokens are assumed (capped by ``n_ctx`` if known)."""
    flat, size = prompt_head_and_size(body)
    if size < 0:
        prompt = -size
        refuse = prompt
    else:
        prompt = math.ceil(size / bytes_per_token)
        refuse = math.floor(size / (bytes_per_token * REFUSE_SAFETY))
    gen = body.get("n_predict", body.get("max_tokens", body.get("max_completion_tokens")))
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        gen = unknown_num_predict
    est = prompt + gen
    if n_ctx:
        est = min(est, n_ctx)
    key = None
    if flat:
        key = int.from_bytes(hashlib.blake2b(flat[:prefix_bytes], digest_size=8).digest(), "big")
    return SizeEstimate(prompt_tokens=refuse, est_tokens=est, prefix_key=key)
