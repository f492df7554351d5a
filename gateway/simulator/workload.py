"""Workloads for the simulator: request lists (open loop) and closed-loop client generators.

Sources:
- ``azure_trace``: the Azure LLM inference traces 2023 (conv / code; arrival times, prompt and
  output token counts), copied into ``gateway/simulator/data/`` with their README
  (Microsoft Azure Public Dataset, CC BY 4.0).
- ``poisson``: Poisson arrivals with prompt/output lengths sampled from a trace or uniform.
- ``shared_prefix``: Poisson arrivals where each request starts with one of a few long system
  prompts (Zipf popularity) followed by a short user part.
- ``closed_loop``: N clients, each sends its next request when the previous one ends (the
  "seed scenario": 100 concurrent requests, outputs uniform 10..1000 tokens).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

DATA = Path(__file__).with_name("data")


@dataclass
class Request:
    """One simulated request. Times in seconds (virtual), sizes in tokens.

    ``prefix_key``/``prefix_tokens``: the shared head of the prompt (system prompt) and its
    length; ``priority``: class for the gateway queue."""

    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    prefix_key: int | None = None
    prefix_tokens: int = 0
    priority: int = 0
    client: int = -1


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
                  out_len: tuple[int, int] = (50, 300), seed: int = 2) -> list[Request]:
    """Poisson arrivals; each prompt = one of ``n_prefixes`` system prompts (Zipf s=1
    popularity) + a user part; outputs uniform in ``out_len``."""
    rng = random.Random(seed)
    plens = [rng.randint(*prefix_len) for _ in range(n_prefixes)]
    weights = [1 / (k + 1) for k in range(n_prefixes)]
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return out
        k = rng.choices(range(n_prefixes), weights)[0]
        u = rng.randint(*user_len)
        out.append(Request(i, t, plens[k] + u, rng.randint(*out_len), prefix_key=1000 + k,
                           prefix_tokens=plens[k]))
        i += 1


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
