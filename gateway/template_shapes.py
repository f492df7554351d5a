"""Chat-template renders reused by the shape of a chat (pure; no I/O).

``/api/generate`` (and a chat run as a completion: ``format``, ``response_format``) sends its
prompt through the model's chat template with a side call to a worker's ``/apply-template``
before the completion, one round trip on every request's path. The pinned llama-server spends
about 2 ms of its HTTP thread on it (``oaicompat_chat_params_parse`` →
``common_chat_templates_apply``; 2.0 ms p50 measured on this 2-core machine, beside 0.16 ms for
``/health``), so it more than doubled the gateway's added TTFT of a short ``/api/generate``.

A *shape* is the chat's roles in order plus the template fields (``chat_template_kwargs`` …).
The first chat of a shape is rendered with a sentinel text in place of each message's content.
When every sentinel comes back verbatim (so the template neither trims, escapes, re-cases nor
drops the content), the render is kept as literal parts and content slots, and later chats of
that shape are filled in locally. Otherwise the shape is remembered as not reusable and its
chats go to ``/apply-template`` as before.

What a sentinel cannot show is a template that *branches* on the content: Qwen3's
``content.startswith('<tool_response>')``, reasoning templates that split on ``</think>``,
SmolLM3's ``'/no_think' in system_message``. Such tests look for markup, so only contents
without ``<``, ``>``, ``[``, ``]``, ``{``, ``}`` and ``/``, not empty and without leading or
trailing whitespace (Llama 3's ``content | trim``) are filled in; only ``system``, ``user`` and
``assistant`` roles; no ``tools`` (whose formats llama-server handles per model family). Any
other chat is rendered by the worker. Entries last :data:`TTL_S` (templates that print the date,
Llama 3.1's ``strftime_now``) and are dropped when a new worker process of the model is ready
(``Gateway._forget_props``: a reload may change ``--chat-template-file``).
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import Callable

#: Seconds a learned shape is reused.
TTL_S = 60.0
#: Shapes kept per model (least recently used dropped).
MAX_SHAPES = 256

_ROLES = frozenset(("system", "user", "assistant"))
_MARKUP = "<>[]{}/\x02\x03"
# Content stand-in for message i: a quote, a backslash, a newline and mixed case, so that
# escaping (tojson), re-casing or newline handling by the template shows as a missing sentinel.
_SENTINEL = "\x02LgW{}\"\\'\nsEnT\x03"
_SENTINEL_RE = re.compile(re.escape("\x02LgW") + r"(\d+)" + re.escape("\"\\'\nsEnT\x03"))

Parts = tuple  # literal strings and int content indices, in order


class TemplateShapes:
    """Learned renders of one model's chat template, keyed by :meth:`key`.

    ``clock``: monotonic seconds (injected for tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = TTL_S,
                 max_shapes: int = MAX_SHAPES):
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_shapes = max_shapes
        self._shapes: OrderedDict[tuple, tuple[float, Parts | None]] = OrderedDict()

    @staticmethod
    def key(messages: list, fields: dict | None) -> tuple | None:
        """The shape of ``messages`` with the ``/apply-template`` ``fields``, or None when the
        chat may not be filled in (see the module docstring)."""
        if fields and "tools" in fields:
            return None
        roles = []
        for m in messages:
            if type(m) is not dict or len(m) != 2:
                return None
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES or type(content) is not str or not content:
                return None
            if content[0].isspace() or content[-1].isspace():
                return None
            for c in _MARKUP:
                if c in content:
                    return None
            roles.append(role)
        if not roles:
            return None
        return tuple(roles), (json.dumps(fields, sort_keys=True) if fields else "")

    @staticmethod
    def sentinel_messages(messages: list) -> list[dict]:
        """``messages`` with each content replaced by its sentinel (to learn the shape)."""
        return [{"role": m["role"], "content": _SENTINEL.format(i)}
                for i, m in enumerate(messages)]

    def known(self, key: tuple) -> bool | None:
        """True: the shape is learned and reusable; False: learned as not reusable (render
        each chat at the worker); None: not learned, or expired."""
        got = self._shapes.get(key)
        if got is None:
            return None
        if self._clock() - got[0] > self.ttl_s:
            del self._shapes[key]
            return None
        self._shapes.move_to_end(key)
        return got[1] is not None

    def fill(self, key: tuple, messages: list) -> str:
        """The render of ``messages`` from the learned shape ``key`` (:meth:`known` True)."""
        parts = self._shapes[key][1]
        return "".join(p if type(p) is str else messages[p]["content"] for p in parts)

    def learn(self, key: tuple, rendered: str, n_messages: int) -> bool:
        """Keep ``rendered``, the render of :meth:`sentinel_messages` of a chat of shape
        ``key``; True when every message's sentinel came back verbatim (the shape is
        reusable), else it is kept as not reusable."""
        pieces = _SENTINEL_RE.split(rendered)
        parts: list = []
        seen = set()
        for i, piece in enumerate(pieces):
            if i % 2:
                idx = int(piece)
                seen.add(idx)
                parts.append(idx)
            elif piece:
                parts.append(piece)
        literal = "".join(p for p in parts if type(p) is str)
        ok = seen == set(range(n_messages)) and "\x02" not in literal and "\x03" not in literal
        self._shapes[key] = (self._clock(), tuple(parts) if ok else None)
        self._shapes.move_to_end(key)
        while len(self._shapes) > self.max_shapes:
            self._shapes.popitem(last=False)
        return ok

    def clear(self) -> None:
        self._shapes.clear()
