"""Workloads for the simulator: request lists (open loop) and closed-loop client generators.

Sources:
- ``azure_trace``: the Azure LLM inference traces 2023 (conv / code; arrival times, prompt and
  output token counts), copied into ``gateway/simulator/data/`` with their README
  (Microsoft Azure Public Dataset, CC BY 4.0).
- ``poisson``: Poisson arrivals with prompt/output lengths sampled from a trace or uniform.
- ``shared_prefix``: Poisson arrivals where each request starts with one of a few long system
  prompts (Zipf popularity) followed by a short user part.
- ``Conversations``: multi-turn chats; each turn's prompt is the whole conversation so far.
- ``ChatClients``: closed-loop clients carrying many multi-turn chats, turn by turn.
- ``ClosedLoop``: N clients, each sends its next request when the previous one ends (the
  "seed scenario": 100 concurrent requests, outputs uniform 10..1000 tokens).

A request's prompt is a sequence of segments ``(content id, tokens)`` (system prompt, user
message, earlier answer …): two prompts share a cached prefix as far as their segments are
equal (``gateway.simulator.host_cache``).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from gateway.simulator.host_cache import Seq

DATA = Path(__file__).with_name("data")


@dataclass
class Request:
    """One simulated request. Times in seconds (virtual), sizes in tokens.

    ``segments``: the prompt's content, adding up to ``prompt_tokens`` (default: one segment of
    its own); ``out_id``: content id of its answer (a later turn's prompt repeats it);
    ``priority``: class for the gateway queue."""

    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    segments: Seq = ()
    out_id: object = None
    priority: int = 0
    client: int = -1

    def __post_init__(self):
        if not self.segments:
            self.segments = ((("u", self.id), self.prompt_tokens),)
        if self.out_id is None:
            self.out_id = ("o", self.id)


def load_trace(name: str = "conv", limit: int | None = None) -> list[tuple[float, int, int]]:
    """(seconds since the first row, context tokens, generated tokens) rows of a trace."""
    rows = []
    with open(DATA / f"azure_{name}.csv", newline="") as f:
        r = csv.reader(f)
        next(r)
        t0 = None
        for row in r:
            ts = datetime.fromisoformat(row[0][:26])
            t0 = t0 or ts
            rows.append(((ts - t0).total_seconds(), int(row[1]), int(row[2])))
            if limit and len(rows) >= limit:
                break
    return rows


def azure_trace(name: str = "conv", limit: int = 2000, speedup: float = 1.0,
                max_prompt: int = 3500) -> list[Request]:
    """The trace's own arrivals (compressed by ``speedup``), prompts capped at ``max_prompt``."""
    return [Request(i, t / speedup, max(1, min(p, max_prompt)), max(1, g))
            for i, (t, p, g) in enumerate(load_trace(name, limit))]


def poisson(rate_per_s: float, duration_s: float, seed: int = 1,
            lengths: Callable[[random.Random], tuple[int, int]] | None = None) -> list[Request]:
    """Open-loop Poisson arrivals; ``lengths(rng) -> (prompt, output)`` (default: sampled
    from the Azure conv trace, prompts capped at 3500)."""
    rng = random.Random(seed)
    if lengths is None:
        rows = load_trace("conv")
        lengths = lambda r: (min(3500, r.choice(rows)[1]), max(1, r.choice(rows)[2]))  # noqa
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        p, o = lengths(rng)
        out.append(Request(i, t, p, o))
        i += 1


def shared_prefix(rate_per_s: float, duration_s: float, n_prefixes: int = 16,
                  prefix_len: tuple[int, int] = (1000, 2000), user_len: tuple[int, int] = (20, 200),
                  out_len: tuple[int, int] = (50, 300), seed: int = 2,
                  zipf_s: float = 1.0) -> list[Request]:
    """Poisson arrivals; each prompt = one of ``n_prefixes`` system prompts (Zipf popularity
    with exponent ``zipf_s``; 0 = all equally popular) + a user part; outputs uniform in
    ``out_len``."""
    rng = random.Random(seed)
    plens = [rng.randint(*prefix_len) for _ in range(n_prefixes)]
    weights = [1 / (k + 1) ** zipf_s for k in range(n_prefixes)]
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        k = rng.choices(range(n_prefixes), weights)[0]
        u = rng.randint(*user_len)
        out.append(Request(i, t, plens[k] + u, rng.randint(*out_len),
                           segments=((("sys", k), plens[k]), (("u", i), u))))
        i += 1


def distinct_prefix_tokens(requests: list[Request]) -> int:
    """Tokens of the distinct first segments (system prompts) of ``requests``; 0 when no two
    requests share one (nothing to cache across requests)."""
    heads = dict(r.segments[0] for r in requests if r.segments)
    return sum(heads.values()) if len(heads) < len(requests) else 0


@dataclass
class Conversations:
    """Multi-turn chats, open loop in conversations, closed loop within each.

    Conversations start as a Poisson process (``rate_per_s``) for ``duration_s``. Turn 1's prompt
    is one of ``n_system`` system prompts (uniform in ``system_len`` tokens) followed by a user
    message, together as long as a prompt of the Azure conv trace (``ContextTokens``, at least
    20 tokens of user message); each later turn's prompt repeats the whole conversation so far
    (every prompt and answer) and adds a user message uniform in ``user_len``. Answers are as
    long as the trace's ``GeneratedTokens``. After each answer the user thinks for an
    exponential time of mean ``think_s`` and goes on with probability ``1 - 1 / mean_turns``
    (geometric number of turns), unless the next turn would not fit ``max_context``.

    Sources and assumptions: mean turns 3.5 as in ShareGPT (3.51 turns per conversation,
    ShareChat paper arXiv:2512.17843, table 1); Azure LLM inference trace 2023 (conv) lengths;
    system prompts, user-message lengths and think time are assumptions.
    """

    rate_per_s: float
    duration_s: float
    n_system: int = 8
    system_len: tuple[int, int] = (200, 800)
    user_len: tuple[int, int] = (20, 200)
    mean_turns: float = 3.5
    think_s: float = 10.0
    max_context: int = 4096
    seed: int = 4

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.rows = load_trace("conv")
        self.sys_len = [self.rng.randint(*self.system_len) for _ in range(self.n_system)]
        self.n = 0
        self.last: dict[int, Request] = {}          # conversation -> its latest turn
        self.turn: dict[int, int] = {}
        self._ctx: dict[int, tuple[float, int]] = {}  # conversation -> (answered at, tokens)
        self._area = 0.0

    def _answer_len(self) -> int:
        return max(1, self.rng.choice(self.rows)[2])

    def _request(self, conv: int, at: float, segments: Seq) -> Request:
        self.n += 1
        n = sum(k for _, k in segments)
        return Request(self.n, at, n, self._answer_len(), segments=segments,
                       out_id=("c", conv, "a", self.turn[conv]), client=conv)

    def initial(self) -> list[Request]:
        out, t, conv = [], 0.0, 0
        while True:
            t += self.rng.expovariate(self.rate_per_s)
            if t >= self.duration_s:
                return out
            k = self.rng.randrange(self.n_system)
            ctx = min(self.rng.choice(self.rows)[1], self.max_context // 2)
            user = max(20, ctx - self.sys_len[k])
            self.turn[conv] = 1
            r = self._request(conv, t, ((("sys", k), self.sys_len[k]), (("c", conv, "u", 1), user)))
            self.last[conv] = r
            out.append(r)
            conv += 1

    def next(self, client: int, now: float) -> Request | None:
        prev = self.last[client]
        if client in self._ctx:
            at, tokens = self._ctx[client]
            self._area += tokens * (now - at)
        self._ctx[client] = (now, prev.prompt_tokens + prev.output_tokens)
        if now >= self.duration_s or self.rng.random() < 1 / self.mean_turns:
            self._ctx.pop(client)
            return None
        self.turn[client] += 1
        segs = prev.segments + ((prev.out_id, prev.output_tokens),
                                (("c", client, "u", self.turn[client]), self.rng.randint(*self.user_len)))
        r = self._request(client, now + self.rng.expovariate(1 / self.think_s), segs)
        if r.prompt_tokens + r.output_tokens > self.max_context:
            self._ctx.pop(client)
            return None
        self.last[client] = r
        return r

    def working_set_tokens(self) -> float:
        """Time-averaged tokens of the conversations waiting for their next turn (prompt and
        answer so far): what the workers must keep cached for the next turns to hit."""
        return self._area / self.duration_s if self.duration_s else 0.0


@dataclass
class ClosedLoop:
    """``clients`` concurrent clients for ``duration_s``; each request's prompt is uniform in
    ``prompt_len`` and output uniform in ``out_len`` (seed scenario: 100, (10, 1000))."""

    clients: int = 100
    duration_s: float = 300.0
    prompt_len: tuple[int, int] = (50, 500)
    out_len: tuple[int, int] = (10, 1000)
    seed: int = 3

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.n = 0

    def next(self, client: int, now: float) -> Request | None:
        if now >= self.duration_s:
            return None
        self.n += 1
        return Request(self.n, now, self.rng.randint(*self.prompt_len),
                       self.rng.randint(*self.out_len), client=client)

    def initial(self) -> list[Request]:
        return [r for c in range(self.clients) if (r := self.next(c, 0.0)) is not None]


@dataclass
class ChatClients:
    """Closed-loop chat clients carrying many conversations turn by turn (how
    ``tests/bench/real_conversations.py`` drives real workers): ``clients`` clients, each sends
    the next turn of one of the ``conversations`` open chats as soon as its previous request
    was answered, so a conversation's next turn comes from whichever client is free, not
    necessarily when a slot of the worker that served its last turn frees. The turn is that of
    a random chat among those not in flight. A chat ends after ``turns`` turns and a new one
    takes its place; clients stop sending at ``duration_s``.

    Turn 1 is one shared system prompt of ``system_tokens`` and a user message; each later
    turn repeats the whole chat so far and adds a user message (uniform in ``user_len``);
    answers are uniform in ``out_len``. All lengths are assumptions."""

    clients: int
    duration_s: float
    conversations: int = 0
    turns: int = 8
    system_tokens: int = 400
    user_len: tuple[int, int] = (50, 200)
    out_len: tuple[int, int] = (20, 300)
    seed: int = 5

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.n = 0
        self.chats = 0
        self.last: dict[int, Request | None] = {}   # chat -> its latest turn (None: not begun)
        self.turn: dict[int, int] = {}
        self.idle: list[int] = []                    # chats whose next turn may be sent
        self.of_client: dict[int, int] = {}          # client -> chat of its request in flight
        self.conversations = self.conversations or 7 * self.clients
        if self.conversations < self.clients:
            raise ValueError("ChatClients needs at least as many conversations as clients")
        for _ in range(self.conversations):
            self._new_chat()

    def _new_chat(self) -> None:
        c = self.chats
        self.chats += 1
        self.last[c], self.turn[c] = None, 0
        self.idle.append(c)

    def _send(self, client: int, now: float) -> Request:
        c = self.idle.pop(self.rng.randrange(len(self.idle)))
        prev = self.last[c]
        self.turn[c] += 1
        user = ((("c", c, "u", self.turn[c]), self.rng.randint(*self.user_len)),)
        segs = (((("sys", 0), self.system_tokens),) + user if prev is None
                else prev.segments + ((prev.out_id, prev.output_tokens),) + user)
        self.n += 1
        r = Request(self.n, now, sum(k for _, k in segs), self.rng.randint(*self.out_len),
                    segments=segs, out_id=("c", c, "a", self.turn[c]), client=client)
        self.last[c] = r
        self.of_client[client] = c
        return r

    def initial(self) -> list[Request]:
        return [self._send(k, 0.0) for k in range(self.clients)]

    def next(self, client: int, now: float) -> Request | None:
        c = self.of_client.pop(client)
        if self.turn[c] < self.turns:
            self.idle.append(c)
        else:
            del self.last[c], self.turn[c]
            self._new_chat()
        return None if now >= self.duration_s else self._send(client, now)
