"""A modelled llama-server worker: slots, continuous batching, prefill, decode, prompt cache.

Per step (one ``llama_decode`` of the real server) every decoding slot emits one token and
prompts in prefill advance by up to ``n_batch`` tokens in total. Step time (seconds)::

    decode_s(b) + prefill_tokens / prefill_tps + kv_tokens * attn_s_per_token + copy stalls

with ``decode_s(b) = decode_s1 * (1 + batch_slope * (b - 1))``: a memory-bound decode step
costs nearly the same for 1 or a few sequences (weights are read once per step), which is
why a well-filled GPU does more tokens/s than the same requests spread thinly.

Prompt cache, as the pinned build does it (tools/server/server-context.cpp
``get_available_slot``): a new task takes the idle slot whose cached sequence shares the largest
fraction of its prompt, if above ``slot_prompt_similarity`` (0.10), else the least recently used
idle slot. When it took the LRU slot, or a similar slot of which it keeps less than half, the
slot's sequence is saved to the host cache and the best host entry is restored into the slot
(``gateway.simulator.host_cache``). With ``cache_idle_slots`` (default on) every idle slot's
sequence is also saved after each new task starts, and cleared from the slot with unified KV.
Tokens shared with the slot's sequence (restored or not) are not recomputed: they are the task's
``cached`` tokens, which llama-server counts in ``prompt_tokens_cached_total`` (``n_past`` after
the restore, server-context.cpp ``metrics.add_prompt_cached``); the rest of the prompt is
computed and counted in ``prompt_tokens_total`` ("excluding cached tokens"). When a task ends
its slot holds its prompt and its answer (segment ``req.out_id``).

Saving and restoring copy KV state between GPU and host memory inside the server loop, so they
stall every slot: ``tokens × kv_bytes_per_token / host_copy_bytes_per_s`` seconds, added to the
next step.

KV: with ``unified_kv`` the slots share ``slots × n_ctx`` cells; a task that does not fit the
free cells waits inside the worker (``deferred``, as ``requests_deferred``). A KV-aware
scheduler never sends such a task.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from gateway.prompt_cache import DEFAULT_CACHE_RAM_MIB, kv_bytes_per_token
from gateway.simulator.host_cache import HostPromptCache, Seq, common_prefix, seq_len

LLAMA3_8B_KV = kv_bytes_per_token(32, 8, 128)
"""131,072 bytes/token: Llama 3 8B (Meta-Llama-3-8B config.json: 32 layers, 8 KV heads,
4096 / 32 = 128 dims per head), K and V in f16 (llama-server's default cache type)."""
LLAMA32_3B_KV = kv_bytes_per_token(28, 8, 128)
"""114,688 bytes/token: Llama 3.2 3B (config.json: 28 layers, 8 KV heads, 3072 / 24 = 128 dims)."""
DEMO_KV = kv_bytes_per_token(2, 4, 16)
"""512 bytes/token: the demo GGUF's metadata (2 layers, 4 KV heads, 64 / 4 = 16 dims), f16 KV."""

HOST_COPY_BYTES_PER_S = 2e9
"""Assumed rate of llama-server's KV-state copies between GPU and host (bytes/s). PCIe 4.0 x16
moves about 25 GB/s between pinned buffers, but the server serialises each sequence into a
freshly allocated, pageable ``std::vector`` (server-task.cpp ``alloc``); logs in public issues
show about 1 to 1.4 GB/s for the whole save + restore ("prompt cache update took 50.04 ms" for a
67 MiB state, ggml-org/llama.cpp#23269; 1973 ms around a 478 MiB save and a restore,
mostlygeek/llama-swap#560). 2 GB/s is an assumption between the two: a restore of an 8B model's
KV then costs about half of prefilling the same tokens on the RTX 6000 Ada profile."""


@dataclass(frozen=True)
class GpuProfile:
    """Performance figures of one worker. Times in seconds, rates in tokens/s.

    Attributes:
        name: label.
        prefill_tps: prompt tokens/s of one worker (llama-bench ``pp``).
        decode_s1: seconds per decode step with one sequence (1 / llama-bench ``tg``).
        batch_slope: extra step time per additional sequence, as a fraction of ``decode_s1``.
        attn_s_per_token: extra step time per KV token held by decoding slots.
        kv_bytes_per_token: KV-cache bytes of one token (sizes the host prompt cache in tokens
            and its copies); 0 = unknown (no host cache).
        host_copy_bytes_per_s: GPU <-> host copy rate of saved prompt states (bytes/s).
        source: where the figures come from.
    """

    name: str
    prefill_tps: float
    decode_s1: float
    batch_slope: float = 0.08
    attn_s_per_token: float = 0.0
    kv_bytes_per_token: int = 0
    host_copy_bytes_per_s: float = HOST_COPY_BYTES_PER_S
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
        # (figure, whether 0 is allowed, the largest sane value): NaN, infinities and absurd
        # sizes ran the simulation forever (a fresh tester's find)
        for key, zero_ok, high in (("prefill_tps", False, 1e9), ("decode_s1", False, 60.0),
                                   ("batch_slope", True, 1e3), ("attn_s_per_token", True, 1.0)):
            v = p.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (0 <= v <= high) or (v == 0 and not zero_ok):
                raise ValueError(f"{path}: profile.{key}: expected a "
                                 f"{'non-negative' if zero_ok else 'positive'} number up to "
                                 f"{high:g}, got {v!r}")
            figures[key] = float(v)
        return cls(str(p.get("name") or os.path.basename(path)), source=str(p.get("source") or path),
                   **figures)


PROFILES: dict[str, GpuProfile] = {
    # llama.cpp PR #19053 (github.com/ggml-org/llama.cpp/pull/19053, Feb 2026) perf table,
    # NVIDIA RTX 6000 Ada, llama 8B Q4_0: pp8096 8008 t/s, tg128 168.9 t/s. Batch slope and
    # attention cost are assumptions (memory-bound decode; llama-batched-bench shapes).
    "rtx6000ada-llama8b-q4": GpuProfile("RTX 6000 Ada, Llama 8B Q4_0", 8008.0, 1 / 168.9,
                                        batch_slope=0.08, attn_s_per_token=2e-8,
                                        kv_bytes_per_token=LLAMA3_8B_KV,
                                        source="llama.cpp PR #19053 perf table"),
    # Same table and GPU, llama 3B Q4_K_M: pp8096 16148.9 t/s, tg128 315.5 t/s.
    "rtx6000ada-llama3b-q4": GpuProfile("RTX 6000 Ada, Llama 3B Q4_K_M", 16148.9, 1 / 315.5,
                                        batch_slope=0.08, attn_s_per_token=1e-8,
                                        kv_bytes_per_token=LLAMA32_3B_KV,
                                        source="llama.cpp PR #19053 perf table"),
    # Measured: docs/calibration/h200-llama8b-q4.json (2026-11-30), written by `llama-gateway
    # calibrate --gpu 0 --slots 8 --repeats 3` (tests/bench/gpu_run.sh) on this project's lent
    # machine: one NVIDIA H200, a CUDA build of the pinned llama-server for sm_90 without its
    # flash-attention kernels, a random-weight model with Llama-3.1-8B's layer sizes in Q4_0 and
    # the demo's 559-token vocabulary (no 128k-token output layer); llama-server's own timings,
    # fitted by gateway/simulator/calibration.py (rounded to 3 digits). Its main loop held one
    # CPU core in every round (a virtual Xeon): the batch slope is that CPU's as much as the
    # GPU's. KV bytes are the real model's f16 cache; the host copy rate is the assumption.
    "h200-llama8b-q4-measured": GpuProfile("H200 (measured), random Llama 8B shape Q4_0", 9590.0,
                                           0.00306, batch_slope=0.716, attn_s_per_token=8.70e-7,
                                           kv_bytes_per_token=LLAMA3_8B_KV,
                                           source="docs/calibration/h200-llama8b-q4.json "
                                                  "(llama-gateway calibrate --gpu 0)"),
    # Measured: docs/calibration/cpu-demo.json (2026-11-30 06:51 UTC, commit 0e6c8aa), written
    # by `llama-gateway calibrate --repeats 15` (the same as tests/bench/calibrate.py): one
    # llama-server, -t 1 -np 8, the demo model, with LLAMA_ARG_FLASH_ATTN=off as the gateway
    # starts CPU workers, on one core of the 2-core development machine; llama-server's own
    # timings of streamed /completion requests, fitted by gateway/simulator/calibration.py
    # (figures rounded to 3 digits). Its host copies are memcpy in RAM (no PCIe); 5 GB/s is
    # an assumption.
    "cpu-demo": GpuProfile("CPU core (-t 1, --flash-attn off), demo model", 16600.0, 0.000305,
                           batch_slope=0.610, attn_s_per_token=2.54e-7,
                           kv_bytes_per_token=DEMO_KV, host_copy_bytes_per_s=5e9,
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
    """One request on a worker. Token counts in tokens, times in seconds (virtual).

    ``cached``: prompt tokens taken from the slot's KV (after any host-cache restore);
    ``restored``: how many of them came from the host cache."""

    req: object
    lease: object
    prompt_left: int
    out_left: int
    cached: int = 0
    restored: int = 0
    slot: int = -1
    first_token_at: float | None = None
    kv: int = 0


@dataclass
class SimWorker:
    """See module docstring. ``cache_ram_mib``: ``--cache-ram`` (0 disables the host cache)."""

    id: str
    profile: GpuProfile
    slots: int
    n_ctx: int
    unified_kv: bool = False
    n_batch: int = 2048
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB
    cache_idle_slots: bool = True
    slot_prompt_similarity: float = 0.10
    running: list[Task] = field(default_factory=list)
    waiting: list[Task] = field(default_factory=list)
    slot_seq: dict[int, Seq] = field(default_factory=dict)      # what each slot's KV holds
    slot_used: dict[int, int] = field(default_factory=dict)     # release order, for LRU
    busy_until: float | None = None
    tokens_out: int = 0
    stall_s: float = 0.0       # host-copy time not yet charged to a step
    copy_s_total: float = 0.0
    host: HostPromptCache = field(init=False)
    _releases: int = 0

    def __post_init__(self):
        self.host = HostPromptCache(self.cache_ram_mib * 2**20, self.profile.kv_bytes_per_token)

    @property
    def kv_capacity(self) -> int:
        return self.slots * self.n_ctx

    def kv_used(self) -> int:
        return sum(t.kv for t in self.running)

    def admit(self, task: Task, now: float) -> None:
        """A task arrives at the worker: start it if a slot (and KV) is free, else defer."""
        self.waiting.append(task)
        self._start_waiting(now)

    def _copy(self, tokens: int) -> None:
        """Charge a GPU <-> host copy of ``tokens`` tokens' KV state to the next step."""
        if tokens:
            s = tokens * self.profile.kv_bytes_per_token / self.profile.host_copy_bytes_per_s
            self.stall_s += s
            self.copy_s_total += s

    def _pick_slot(self, new: Seq) -> tuple[int, bool]:
        """llama-server's ``get_available_slot`` for a prompt ``new``, with its host-cache
        update. Returns (slot, whether its sequence was restored from the host cache); the
        slot's sequence is left in ``slot_seq``."""
        used = {x.slot for x in self.running}
        idle = [s for s in range(self.slots) if s not in used]
        n_new = seq_len(new)
        slot, update = None, False
        if self.slot_prompt_similarity > 0:
            best = 0.0
            for s in idle:
                cur = self.slot_seq.get(s, ())
                sim = common_prefix(cur, new) / n_new if cur else 0.0
                if sim > best and sim > self.slot_prompt_similarity:
                    best, slot = sim, s
            if slot is not None:
                update = best * n_new / seq_len(self.slot_seq[slot]) < 0.5  # f_keep
        if slot is None:
            slot = min(idle, key=lambda s: (self.slot_used.get(s, -1), -s))
            update = True
        got = None
        if update and self.host.enabled:
            cur = self.slot_seq.get(slot, ())
            self._copy(self.host.save(cur))
            got = self.host.load(cur, new)
            if got is not None:
                self._copy(seq_len(got))
                self.slot_seq[slot] = got
            self.host.update()
        return slot, got is not None

    def _start_waiting(self, now: float) -> None:
        while self.waiting and len(self.running) < self.slots:
            t = self.waiting[0]
            need = t.prompt_left + t.out_left
            if self.unified_kv and self.kv_used() + min(need, self.n_ctx) > self.kv_capacity \
                    and self.running:
                return
            self.waiting.pop(0)
            new = t.req.segments
            t.slot, restored = self._pick_slot(new)
            held = self.slot_seq.get(t.slot, ())
            t.cached = min(common_prefix(held, new), t.prompt_left - 1)  # >= 1 token computed
            t.restored = t.cached if restored else 0
            t.prompt_left -= t.cached
            t.kv = t.cached
            self.slot_seq[t.slot] = new
            self.running.append(t)
            if self.cache_idle_slots and self.host.enabled:
                busy = {x.slot for x in self.running}
                for s in range(self.slots):
                    if s not in busy and self.slot_seq.get(s):
                        self._copy(self.host.save(self.slot_seq[s]))
                        self.host.update()
                        if self.unified_kv:
                            self.slot_seq[s] = ()

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
            + prefill / p.prefill_tps + kv * p.attn_s_per_token + self.stall_s
        self.stall_s = 0.0
        for t in decoding + first:
            t.out_left -= 1
            t.kv += 1
            self.tokens_out += 1
            if t.out_left <= 0 or t.kv >= self.n_ctx:
                done.append(t)
        for t in done:
            self.running.remove(t)
            out = t.req.output_tokens - max(0, t.out_left)
            self.slot_seq[t.slot] = t.req.segments + ((t.req.out_id, out),)
            self._releases += 1
            self.slot_used[t.slot] = self._releases
        return max(dt, 1e-6), first, done, b
