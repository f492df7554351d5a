"""The discrete-event loop: the real Dispatcher on a virtual clock, modelled workers.

Events (time-ordered heap): request arrivals, worker step ends, telemetry polls (every
``poll_interval_s``, feeding ``Dispatcher.update_load`` like the live poller), queue-timeout
checks, and the ends of affinity waits (``Dispatcher.next_wakeup``, pumped like the live
gateway's timer). A dispatch (``submit`` returning a lease, or the dispatches a release returns) hands
the request to its worker at once; the gateway's own overhead is not modelled.

Tickets carry what the live gateway computes from a request body (``gateway.sizing``): a head
key over the prompt's first ``HEAD_TOKENS`` tokens (``scheduler.prefix_bytes`` = 512 bytes at
4 bytes per token) and the prefix chain over its segments (one per chat message). Workers are
registered with the cache size the live fleet derives (``gateway.prompt_cache``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from dataclasses import dataclass, field

from gateway.prompt_cache import DEFAULT_CACHE_RAM_MIB, worker_cache_tokens
from gateway.scheduling import Dispatcher, QueueFull, Ticket, WorkerLoad, make_scorer
from gateway.simulator.host_cache import Seq
from gateway.simulator.worker import GpuProfile, SimWorker, Task
from gateway.simulator.workload import (ChatClients, ClosedLoop, Conversations, Request,
                                         distinct_prefix_tokens)
from gateway.sizing import Chain, prefix_chain

HEAD_TOKENS = 128


def ticket_keys(segments: Seq) -> tuple[int, Chain]:
    """(head key, prefix chain) of a prompt, as ``gateway.sizing.estimate`` computes them from
    a chat body: the head key hashes the content of the first ``HEAD_TOKENS`` tokens, the chain
    one boundary per segment."""
    head, n = [], 0
    for sid, k in segments:
        head.append(sid if n + k <= HEAD_TOKENS else (sid, HEAD_TOKENS - n))
        n += k
        if n >= HEAD_TOKENS:
            break
    key = int.from_bytes(hashlib.blake2b(repr(head).encode(), digest_size=8).digest(), "big")
    return key, prefix_chain((repr(sid).encode(), k) for sid, k in segments)


@dataclass
class Result:
    """Outcome of one run. Times in seconds, throughput in generated tokens/s.

    ``window``: (start, end) of the measured interval; throughput counts tokens generated
    inside it. ``cached_tokens`` / ``prompt_tokens``: prompt tokens taken from a cache / computed
    (the workers' ``prompt_tokens_cached_total`` / ``prompt_tokens_total``), over the completed
    requests that arrived after the warm-up, like the latencies; ``restored_tokens``: the
    cached tokens restored from a host prompt cache. ``cached_ratio``: cached / all prompt
    tokens. ``copy_s``: seconds the workers spent copying prompt states to and from the host.
    ``working_set``: tokens the workload needs cached (``Conversations.working_set_tokens``,
    or the distinct system prompts' tokens), when known."""

    policy: str
    tokens: int = 0
    window: tuple[float, float] = (0.0, 0.0)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    rejected: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    restored_tokens: int = 0
    copy_s: float = 0.0
    completed: int = 0
    working_set: float = 0.0

    @property
    def throughput(self) -> float:
        span = self.window[1] - self.window[0]
        return self.tokens / span if span > 0 else 0.0

    @property
    def cached_ratio(self) -> float:
        total = self.cached_tokens + self.prompt_tokens
        return self.cached_tokens / total if total else 0.0

    @staticmethod
    def pct(xs: list[float], q: float) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(q / 100 * len(s)))]


class OracleScorer:
    """Ideal global-queue oracle: knows each worker's true state and sends the request where
    its first token comes soonest (least prefill backlog, then smallest batch per speed)."""

    kv_aware = True

    def __init__(self, sims: dict[str, SimWorker]):
        self.sims = sims

    def pick(self, candidates, ticket, now, fleet=()):
        def key(w):
            s = self.sims[w.id]
            backlog = sum(t.prompt_left for t in s.running) / s.profile.prefill_tps
            return (backlog + s.profile.decode_s1 * (1 + s.profile.batch_slope * len(s.running)),
                    w.order)
        return min(candidates, key=key)


def simulate(requests: list[Request] | ClosedLoop | Conversations | ChatClients, *, n_workers: int,
             profile: GpuProfile, slots: int = 8, n_ctx: int = 4096, policy: str = "least_loaded",
             affinity: bool = True, affinity_bound: float = 2.0,
             affinity_wait_ms_per_1k_tokens: float = 0.0, affinity_wait_max_s: float = 1.0,
             unified_kv: bool = False,
             single_runner: bool = False, cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB,
             cache_idle_slots: bool = False,
             poll_interval_s: float = 0.25, max_pending: int = 100_000,
             queue_timeout_s: float | None = None, warmup_s: float = 0.0,
             seed: int = 0) -> Result:
    """Run one simulation. ``policy``: a scheduler policy name, or "oracle" (see
    OracleScorer). ``single_runner``: the Ollama-like baseline, one runner on worker 0 only.
    ``cache_ram_mib``: the workers' ``--cache-ram``; ``cache_idle_slots``: their
    ``--cache-idle-slots`` (default False = ``--no-cache-idle-slots``, as the gateway starts its
    workers: workers/process.py). Returns a Result; throughput is measured
    from ``warmup_s`` to the last completion (open loop) or to the closed loop's end."""
    sims = {f"gpu{i}": SimWorker(f"gpu{i}", profile, slots, n_ctx, unified_kv,
                                 cache_ram_mib=cache_ram_mib, cache_idle_slots=cache_idle_slots)
            for i in range(1 if single_runner else n_workers)}
    args = ["--cache-ram", str(cache_ram_mib)]
    now = [0.0]
    scorer = OracleScorer(sims) if policy == "oracle" else make_scorer(
        policy, affinity=affinity, affinity_bound=affinity_bound, seed=seed,
        affinity_wait_ms_per_1k_tokens=affinity_wait_ms_per_1k_tokens,
        affinity_wait_max_s=affinity_wait_max_s)
    d = Dispatcher(lambda: now[0], max_pending=max_pending, scorer=scorer)
    for wid, s in sims.items():
        d.add_worker(wid, "m", slots, n_ctx=n_ctx, kv_capacity=s.kv_capacity,
                     cache_tokens=worker_cache_tokens(s.kv_capacity, args,
                                                      profile.kv_bytes_per_token))
        d.set_ready(wid, True)
    res = Result(policy)
    seq = itertools.count()
    heap: list = []
    push = lambda t, kind, obj: heapq.heappush(heap, (t, next(seq), kind, obj))  # noqa: E731
    closed = requests if isinstance(requests, (ClosedLoop, Conversations, ChatClients)) else None
    for r in (closed.initial() if closed else requests):
        push(r.arrival, "arrive", r)
    push(poll_interval_s, "poll", None)
    tickets: dict[int, Request] = {}
    end_of_work = closed.duration_s if closed else None

    def start(ticket: Ticket, lease) -> None:
        r = tickets[ticket.seq]
        s = sims[lease.worker.id]
        s.admit(Task(r, lease, r.prompt_tokens, r.output_tokens), now[0])
        if s.busy_until is None:
            schedule(s)

    def schedule(s: SimWorker) -> None:
        if not s.running and s.waiting:
            s._start_waiting(now[0])
        if s.running:
            dt, first, done, emitted = s.step()
            s.busy_until = now[0] + dt
            push(s.busy_until, "step", (s, first, done, emitted))
        else:
            s.busy_until = None

    def arrive(r: Request) -> None:
        key, chain = ticket_keys(r.segments)
        t = Ticket(request_id=str(r.id), model="m", priority=r.priority,
                   est_tokens=min(n_ctx, r.prompt_tokens + r.output_tokens),
                   prompt_tokens=0, prefill_tokens=r.prompt_tokens, prefix_key=key,
                   prefix_chain=chain,
                   queue_timeout_s=queue_timeout_s)
        tickets[t.seq] = r
        try:
            lease = d.submit(t)
        except QueueFull:
            res.rejected += 1
            return
        if lease is not None:
            start(t, lease)

    wakes: set[float] = set()

    def arm_wake() -> None:
        at = d.next_wakeup()
        if at is not None and at not in wakes:
            wakes.add(at)
            push(at, "wake", None)

    while heap:
        t, _, kind, obj = heapq.heappop(heap)
        now[0] = t
        if kind == "arrive":
            arrive(obj)
        elif kind == "wake":
            wakes.discard(t)
            for tk, lease in d.pump():
                start(tk, lease)
        elif kind == "step":
            s, first, done, emitted = obj
            for task in first:
                task.first_token_at = t
                task.lease.first_token()
                if task.req.arrival >= warmup_s:
                    res.ttft.append(t - task.req.arrival)
            if t >= warmup_s and (end_of_work is None or t <= end_of_work):
                res.tokens += emitted
            for task in done:
                r = task.req
                res.completed += 1
                if r.arrival >= warmup_s:
                    res.e2e.append(t - r.arrival)
                    res.cached_tokens += task.cached
                    res.restored_tokens += task.restored
                    res.prompt_tokens += r.prompt_tokens - task.cached
                for tk, lease in task.lease.release():
                    start(tk, lease)
                if closed is not None:
                    nxt = closed.next(r.client, t)
                    if nxt is not None:
                        push(nxt.arrival, "arrive", nxt)
            schedule(s)
        elif kind == "poll":
            for wid, s in sims.items():
                load = WorkerLoad(at=t, processing=len(s.running), kv_tokens=s.kv_used(),
                                  deferred=len(s.waiting), n_ctx=n_ctx)
                for tk, lease in d.update_load(wid, load):
                    start(tk, lease)
            for tk in d.expire():
                res.rejected += 1
            if any(s.running or s.waiting for s in sims.values()) or len(d.queue) or \
                    any(k == "arrive" for _, _, k, _ in heap):
                push(t + poll_interval_s, "poll", None)
        arm_wake()
    last = max((s.busy_until or 0.0) for s in sims.values())
    res.window = (warmup_s, end_of_work if end_of_work is not None else max(last, now[0]))
    res.copy_s = sum(s.copy_s_total for s in sims.values())
    if isinstance(requests, Conversations):
        res.working_set = requests.working_set_tokens()
    elif not closed:
        res.working_set = distinct_prefix_tokens(requests)
    return res
