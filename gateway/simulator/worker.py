"""A modelled llama-server worker: slots, continuous batching, prefill, decode, prefix cache.

Per step (one ``llama_decode`` of the real server) every decoding slot emits one token and
prompts in prefill advance by up to ``n_batch`` tokens in total. Step time (seconds)::

    decode_s(b) + prefill_tokens / prefill_tps + kv_tokens * attn_s_per_token

with ``decode_s(b) = decode_s1 * (1 + batch_slope * (b - 1))``: a memory-bound decode step
costs nearly the same for 1 or a few sequences (weights are read once per step), which is
why a well-filled GPU does more tokens/s than the same requests spread thinly.

Prefix cache: like llama-server, a new task takes the idle slot whose cached prompt shares
the prefix (same ``prefix_key``), else the least recently used idle slot; the shared prefix's
tokens are then not recomputed (``cached`` tokens, as ``prompt_tokens_cached_total`` counts).

KV: with ``unified_kv`` the slots share ``slots × n_ctx`` cells; a task that does not fit the
free cells waits inside the worker (``deferred``, as ``requests_deferred``). A KV-aware
scheduler never sends such a task.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuProfile:
    """Performance figures of one worker. Times in seconds, rates in tokens/s.

    Attributes:
        name: label.
        prefill_tps: prompt tokens/s of one worker (llama-bench ``pp``).
        decode_s1: seconds per decode step with one sequence (1 / llama-bench ``tg``).
        batch_slope: extra step time per additional sequence, as a fraction of ``decode_s1``.
        attn_s_per_token: extra step time per KV token held by decoding slots.
        source: where the figures come from.
    """

    name: str
    prefill_tps: float
    decode_s1: float
    batch_slope: float = 0.08
    attn_s_per_token: float = 0.0
    source: str = ""

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "GpuProfile":
        """The profile in a calibration file written by ``llama-gateway calibrate`` (its
        ``profile`` object; a file holding only that object works too).

        Raises:
            ValueError: unreadable file, or a missing / non-positive figure (named)."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read a profile: {e}") from None
        p = doc.get("profile", doc) if isinstance(doc, dict) else None
        if not isinstance(p, dict):
            raise ValueError(f"{path}: expected a JSON object with a 'profile' object")
        figures = {}
        for key, low in (("prefill_tps", 0.0), ("decode_s1", 0.0), ("batch_slope", None),
                         ("attn_s_per_token", None)):
            v = p.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or (v <= low if low is not None else v < 0):
                raise ValueError(f"{path}: profile.{key}: expected a "
                                 f"{'positive' if low is not None else 'non-negative'} number, got {v!r}")
            figures[key] = float(v)
        return cls(str(p.get("name") or os.path.basename(path)), source=str(p.get("source") or path),
                   **figures)


PROFILES: dict[str, GpuProfile] = {
    # llama.cpp PR #19053 (github.com/ggml-org/llama.cpp/pull/19053, Feb 2026) perf table,
    # NVIDIA RTX 6000 Ada, llama 8B Q4_0: pp8096 8008 t/s, tg128 168.9 t/s. Batch slope and
    # attention cost are assumptions (memory-bound decode; llama-batched-bench shapes).
    "rtx6000ada-llama8b-q4": GpuProfile("RTX 6000 Ada, Llama 8B Q4_0", 8008.0, 1 / 168.9,
                                        batch_slope=0.08, attn_s_per_token=2e-8,
                                        source="llama.cpp PR #19053 perf table"),
    # Same table and GPU, llama 3B Q4_K_M: pp8096 16148.9 t/s, tg128 315.5 t/s.
    "rtx6000ada-llama3b-q4": GpuProfile("RTX 6000 Ada, Llama 3B Q4_K_M", 16148.9, 1 / 315.5,
                                        batch_slope=0.08, attn_s_per_token=1e-8,
                                        source="llama.cpp PR #19053 perf table"),
    # Measured: docs/calibration/cpu-demo.json, written by `llama-gateway calibrate` (the same
    # as tests/bench/calibrate.py): one llama-server, -t 1 -np 8, the demo model, on one core
    # of the 2-core development machine; llama-server's own timings of streamed /completion
    # requests, fitted by gateway/simulator/calibration.py (figures rounded to 3 digits).
    "cpu-demo": GpuProfile("CPU core (-t 1), demo model", 21100.0, 0.000254,
                           batch_slope=0.577, attn_s_per_token=1.00e-6,
                           source="docs/calibration/cpu-demo.json (llama-gateway calibrate)"),
}


def resolve_profile(name_or_path: str) -> GpuProfile:
    """A profile of ``PROFILES`` by name, else from a calibration JSON file at that path.

    Raises:
        ValueError: neither a known name nor a readable profile file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if not os.path.exists(name_or_path):
        raise ValueError(f"unknown profile {name_or_path!r}: not one of {', '.join(PROFILES)} "
                         "and no such file")
    return GpuProfile.from_json(name_or_path)


@dataclass
class Task:
    """One request on a worker. Token counts in tokens, times in seconds (virtual)."""

    req: object
    lease: object
    prompt_left: int
    out_left: int
    cached: int = 0
    slot: int = -1
    first_token_at: float | None = None
    kv: int = 0


@dataclass
class SimWorker:
    """See module docstring."""

    id: str
    profile: GpuProfile
    slots: int
    n_ctx: int
    unified_kv: bool = False
    n_batch: int = 2048
    running: list[Task] = field(default_factory=list)
    waiting: list[Task] = field(default_factory=list)
    slot_prefix: dict[int, tuple[int | None, int, float]] = field(default_factory=dict)
    busy_until: float | None = None
    tokens_out: int = 0
    cached_total: int = 0
    prompt_total: int = 0

    @property
    def kv_capacity(self) -> int:
        return self.slots * self.n_ctx

    def kv_used(self) -> int:
        return sum(t.kv for t in self.running)

    def admit(self, task: Task, now: float) -> None:
        """A task arrives at the worker: start it if a slot (and KV) is free, else defer."""
        self.waiting.append(task)
        self._start_waiting(now)

    def _start_waiting(self, now: float) -> None:
        while self.waiting and len(self.running) < self.slots:
            t = self.waiting[0]
            need = t.prompt_left + t.out_left
            if self.unified_kv and self.kv_used() + min(need, self.n_ctx) > self.kv_capacity \
                    and self.running:
                return
            self.waiting.pop(0)
            used = {x.slot for x in self.running}
            idle = [s for s in range(self.slots) if s not in used]
            key = getattr(t.req, "prefix_key", None)
            match = [s for s in idle if key is not None and self.slot_prefix.get(s, (None,))[0] == key]
            slot = match[0] if match else min(idle, key=lambda s: self.slot_prefix.get(s, (None, 0, -1.0))[2])
            t.slot = slot
            if match:
                t.cached = min(self.slot_prefix[slot][1], t.prompt_left - 1)
                t.prompt_left -= t.cached
            self.slot_prefix[slot] = (key, getattr(t.req, "prefix_tokens", 0), now)
            self.cached_total += t.cached
            self.prompt_total += t.prompt_left
            t.kv = t.cached
            self.running.append(t)

    def step(self) -> tuple[float, list[Task], list[Task], int]:
        """Run one step. Returns (seconds, tasks that emitted their first token, tasks done,
        tokens generated)."""
        budget = self.n_batch
        prefill = 0
        decoding = [t for t in self.running if t.prompt_left == 0]
        first, done = [], []
        for t in self.running:
            if t.prompt_left > 0 and budget > 0:
                n = min(t.prompt_left, budget)
                t.prompt_left -= n
                t.kv += n
                budget -= n
                prefill += n
                if t.prompt_left == 0:
                    first.append(t)  # the step that ends prefill samples the first token
        b = len(decoding) + len(first)
        p = self.profile
        kv = sum(t.kv for t in self.running)
        dt = (p.decode_s1 * (1 + p.batch_slope * max(0, b - 1)) if b else 0.0) \
            + prefill / p.prefill_tps + kv * p.attn_s_per_token
        for t in decoding + first:
            t.out_left -= 1
            t.kv += 1
            self.tokens_out += 1
            if t.out_left <= 0 or t.kv >= self.n_ctx:
                done.append(t)
        for t in done:
            self.running.remove(t)
        return max(dt, 1e-6), first, done, b
