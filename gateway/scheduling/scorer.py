"""Worker choice for one ticket among the workers that can take it now.

Every scorer has ``pick(candidates, ticket, now, fleet) -> WorkerView``. ``candidates`` are the
workers of the ticket's model that have a free slot (and, for scorers with ``kv_aware = True``,
KV headroom for the ticket); ``fleet`` is every ready worker of that model (for fleet
averages). Scorers are pure: no I/O, no wall clock.

Policies (``scheduler.policy`` in the YAML):

- ``least_loaded`` (default, :class:`LeastLoaded`): lowest cost, where cost combines slot
  occupancy (own leases + phantom busy slots seen by polling + the worker's own deferred
  queue), KV fill, prefill backlog and relative speed; with prefix affinity under a load
  bound (below).
- ``least_connections``: fewest live requests, nothing else (a benchmark baseline).
- ``round_robin``, ``random``: baselines.
- ``pack``: lowest fleet order with a free slot, i.e. fill GPU 0 first (how Ollama fills one
  runner before the next; a benchmark baseline).

Prefix affinity with bounded load. A llama-server worker reuses a prompt's head when one of
its idle slots, or its host prompt cache (``--cache-ram``), still holds it; both evict least
recently used first (``gateway.prompt_cache``). The scorer keeps a ``PrefixIndex``: for every
worker, the prefix keys of the tickets it was sent (the head key over ``prefix_bytes`` and the
prefix chain, one key per chat message, ``gateway.sizing``), forgotten once more tokens than the
worker can cache (``cache_tokens``: its KV cells plus its host cache) were sent there after them.
A ticket goes to the candidate that holds the longest prefix of it, among those whose load
(occupancy / slots, before taking it) is at most ``affinity_bound`` × the fleet's average load
and whose occupancy exceeds the least occupied candidate's by at most one slot per
``TOKENS_PER_SLOT`` (512) tokens held, never more than ``(slots - 1) // 2``; ties go to the
lower cost. Without such a candidate the least-loaded cost decides, ties broken by the
rendezvous rank of the head key (highest random weight, stable across restarts).

Consequences:

- A conversation's next turn repeats its previous prompt, so the chain finds the worker that
  served the previous turn even when that was an overflow placement, or a different worker
  from the one its system prompt would suggest; a new conversation goes where its system prompt
  is held, or to the least loaded worker.
- The load allowance grows with what a hit saves: a 2,000-token conversation may wait behind
  3 more busy slots than the least busy worker has, a bare system-prompt match (head key only)
  merely breaks ties. With 2-slot workers affinity only breaks ties, so a worker never idles
  while another runs two requests of the same prefix (field case 9); a burst of identical
  prompts piles up on the worker that holds them only up to that allowance, then spreads.
- Prompts no worker holds (one-off requests) are placed by load alone: affinity costs them
  nothing.
- The index is approximate and lives in the gateway process: after a gateway restart it starts
  empty (the rendezvous tie-break keeps cold placements stable), and a worker that stops is
  forgotten (``forget``). Its size is bounded by what the workers can cache.

Delay scheduling for affinity (``affinity_wait_ms_per_1k_tokens``; Zaharia et al., "Delay
scheduling: a simple technique for achieving locality and fairness in cluster scheduling",
EuroSys 2010: a job whose preferred node has no free slot is skipped for a short bounded time
while others take the free slot). When the ready worker holding the longest prefix of a queued
ticket cannot take it now (no free slot, or outside the load bound above), and no candidate
holds as much, the ticket may wait for it: ``affinity_wait`` gives how long, the tokens a hit
there saves over the best candidate × the estimated prefill time per token, at most
``affinity_wait_max_s``, counted from when the ticket was admitted. The dispatcher lets other
tickets take the free slot meanwhile and hands the ticket to any worker once that time is over
(``gateway.scheduling.dispatcher``).

``TOKENS_PER_SLOT`` was chosen in the simulator (README, "Routing quality, simulated"): 256 and
512 gave the lowest TTFT p99 at the same cached tokens, 128 and ``(slots - 1) // 2`` alone (the
previous rule) cached as much but raised TTFT p99 by 10–15 % on the conversation trace, 1024
cached less.
"""

from __future__ import annotations

import random as _random
from typing import Protocol, Sequence

from gateway.scheduling.prefix_index import PrefixIndex
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.worker_view import WorkerView

POLICIES = ("least_loaded", "least_connections", "round_robin", "random", "pack")


class Scorer(Protocol):
    kv_aware: bool

    def pick(self, candidates: Sequence[WorkerView], ticket: Ticket, now: float,
             fleet: Sequence[WorkerView] = ()) -> WorkerView: ...


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _worker_hash(worker_id: str) -> int:
    h = 0xCBF29CE484222325  # FNV-1a 64, stable across processes (unlike hash(str))
    for b in worker_id.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def rendezvous_rank(key: int, workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers ordered by highest random weight for ``key`` (stable across restarts)."""
    return sorted(workers, key=lambda w: (-_mix64(key ^ _worker_hash(w.id)), w.order))


def occupancy(w: WorkerView) -> int:
    """Slots in use as far as scoring is concerned: leases + phantom + worker-side queue."""
    return w.busy + w.phantom + w.load.deferred


TOKENS_PER_SLOT = 512
"""Cached prompt tokens that justify one more busy slot on a worker than on the least busy one."""

DEFAULT_CACHE_TOKENS = 65536
"""Cache size assumed for a worker whose ``cache_tokens`` and ``kv_capacity`` are unknown."""


def cache_capacity(w: WorkerView) -> int:
    """Prompt tokens the worker can keep cached (slots + host cache), as well as known."""
    return w.cache_tokens or w.kv_capacity or DEFAULT_CACHE_TOKENS


def prefix_keys(ticket: Ticket) -> tuple[tuple[int, int], ...]:
    """The ticket's prefix keys with their tokens, shortest first: its head key (counted as one
    token: it only says the head matches) and its prefix chain."""
    head = ((ticket.prefix_key, 1),) if ticket.prefix_key is not None else ()
    return head + tuple(ticket.prefix_chain)


class LeastLoaded:
    """Default policy. Cost of placing the ticket on worker ``w`` (lower is better)::

        (occupancy(w) + ticket.slots) / (slots × speed)  +  kv_weight × kv_fill_after
            +  prefill_weight × prefill_backlog / (n_ctx × speed)

    - occupancy / slots: fraction of slots in use after placing the ticket (1-1-1-1 before
      2-2-2-2 on equal workers; a ticket of ``n`` choices takes ``n``);
      dividing by ``speed`` (measured relative decode speed, ``gateway.speed``) sends more to
      faster GPUs;
    - kv_fill_after: fraction of the worker's KV cache in use after adding the ticket's estimate;
    - prefill_backlog: estimated prompt tokens of the worker's requests that have not had their
      first token yet (``WorkerView.prefill_backlog``), in per-slot contexts (``n_ctx``; the
      term is left out while ``n_ctx`` is unknown). llama-server computes a new prompt in the
      same batches as the running requests' tokens, so a worker still computing long prompts
      gives a new request its first token later than one with equal occupancy whose requests
      are all decoding. Simulated (README, "Routing quality"), 0.5 took TTFT p99 on the
      Poisson trace at 4 GPUs from 1.006 s to 0.711 s (the oracle: 0.753 s) and on the
      shared-prompt trace from 0.703 to 0.595 s, with the same tokens/s;
    - ties: fewer busy slots, then the rendezvous rank of the ticket's prefix key, then fleet order.

    With ``affinity_bound`` (> 1) and a ticket that has prefix keys, prefix affinity with
    bounded load applies first (module docstring); ``affinity_bound`` None disables it.
    """

    kv_aware = True

    def __init__(self, affinity_bound: float | None = 2.0, kv_weight: float = 0.5,
                 prefill_weight: float = 0.5, wait_ms_per_1k_tokens: float = 0.0,
                 wait_max_s: float = 1.0):
        if affinity_bound is not None and affinity_bound < 1.0:
            raise ValueError("affinity_bound must be >= 1")
        if wait_ms_per_1k_tokens < 0 or wait_max_s < 0:
            raise ValueError("affinity wait settings must be >= 0")
        self.affinity_bound = affinity_bound
        self.wait_s_per_token = wait_ms_per_1k_tokens / 1e6
        self.wait_max_s = wait_max_s
        self.kv_weight = kv_weight
        self.prefill_weight = prefill_weight
        self.index = PrefixIndex() if affinity_bound is not None else None

    def cost(self, w: WorkerView, ticket: Ticket) -> float:
        speed = w.speed if w.speed > 0 else 1.0
        c = (occupancy(w) + ticket.slots) / (w.slots * speed)
        if w.kv_capacity:
            need = ticket.est_tokens * ticket.slots
            c += self.kv_weight * min(1.0, (w.kv_used + need) / w.kv_capacity)
        if w.n_ctx and self.prefill_weight:
            c += self.prefill_weight * w.prefill_backlog / (w.n_ctx * speed)
        return c

    def within_bound(self, w: WorkerView, avg: float, least: int, held: int) -> bool:
        """Whether affinity may send to ``w``, which holds ``held`` tokens of the ticket's prefix:
        its load is at most ``affinity_bound`` × the fleet average, and its occupancy exceeds the
        least busy candidate's by at most one slot per ``TOKENS_PER_SLOT`` tokens held, and never
        by more than ``(slots - 1) // 2``."""
        occ = occupancy(w)
        slack = min((w.slots - 1) // 2, held // TOKENS_PER_SLOT)
        return occ / w.slots <= self.affinity_bound * avg + 1e-9 and occ <= least + slack

    def affine(self, candidates: Sequence[WorkerView], ticket: Ticket,
               fleet: Sequence[WorkerView]) -> WorkerView | None:
        """The candidate within the load bound that holds the longest prefix of the ticket, or
        None (no prefix keys, affinity off, or no such candidate)."""
        keys = prefix_keys(ticket)
        if self.index is None or not keys:
            return None
        fleet = fleet or candidates
        avg = sum(occupancy(w) for w in fleet) / sum(w.slots for w in fleet)
        least = min(occupancy(w) for w in candidates)
        best, best_key = None, None
        for w in candidates:
            held = self.index.cached_tokens(w.id, keys, cache_capacity(w))
            if held > 0 and self.within_bound(w, avg, least, held):
                k = (-held, self.cost(w, ticket), w.busy)
                if best_key is None or k < best_key:
                    best, best_key = w, k
        return best

    def affinity_wait(self, candidates: Sequence[WorkerView], ticket: Ticket,
                      fleet: Sequence[WorkerView]) -> float:
        """Seconds after its admission that ``ticket`` may wait in the queue for the worker of
        ``fleet`` (the model's workers in rotation) that holds the longest prefix of it, when
        that worker is not what ``affine`` finds among ``candidates`` now (delay scheduling,
        module docstring): (tokens held there - tokens held by the affine candidate) × the
        estimated prefill seconds per token, at most ``wait_max_s``. 0 when affinity or the
        wait is off, the ticket has no prefix keys, or a candidate holds as much."""
        keys = prefix_keys(ticket)
        if self.index is None or not keys or not self.wait_s_per_token or not fleet:
            return 0.0
        held = max(self.index.cached_tokens(w.id, keys, cache_capacity(w)) for w in fleet)
        if held <= 1:  # nothing, or only the head key (a tie-breaker, not worth a wait)
            return 0.0
        near = self.affine(candidates, ticket, fleet) if candidates else None
        got = self.index.cached_tokens(near.id, keys, cache_capacity(near)) if near else 0
        if got >= held:
            return 0.0
        return min(self.wait_max_s, (held - got) * self.wait_s_per_token)

    def pick(self, candidates, ticket, now, fleet=()):
        if len(candidates) == 1:
            w = candidates[0]  # no choice to make: affinity and cost would only rank it first
        else:
            w = self.affine(candidates, ticket, fleet)
        if w is None:
            rank = {}
            if ticket.prefix_key is not None and self.index is not None:
                rank = {id(x): i for i, x in enumerate(rendezvous_rank(ticket.prefix_key, candidates))}
            w = min(candidates, key=lambda w: (self.cost(w, ticket), w.busy, rank.get(id(w), 0), w.order))
        keys = prefix_keys(ticket)
        if self.index is not None and keys:
            self.index.record(w.id, keys, ticket.est_tokens, cache_capacity(w))
        return w

    def forget(self, worker_id: str) -> None:
        """The worker's caches are gone (it stopped or restarted)."""
        if self.index is not None:
            self.index.forget(worker_id)


class LeastConnections:
    """Fewest busy slots (live requests; one of ``n`` choices counts ``n``), then fleet order.
    Ignores slot counts, KV and speed."""

    kv_aware = False

    def pick(self, candidates, ticket, now, fleet=()):
        return min(candidates, key=lambda w: (w.busy, w.order))


class RoundRobin:
    """Next worker in fleet order after the last one chosen (baseline)."""

    kv_aware = False

    def __init__(self):
        self._last = -1

    def pick(self, candidates, ticket, now, fleet=()):
        ordered = sorted(candidates, key=lambda w: w.order)
        for w in ordered:
            if w.order > self._last:
                self._last = w.order
                return w
        self._last = ordered[0].order
        return ordered[0]


class Random:
    """Uniformly random candidate (baseline); ``seed`` for reproducible simulations."""

    kv_aware = False

    def __init__(self, seed: int | None = None):
        self._rng = _random.Random(seed)

    def pick(self, candidates, ticket, now, fleet=()):
        return candidates[self._rng.randrange(len(candidates))]


class Pack:
    """Lowest fleet order first: fill worker 0's slots before worker 1 (Ollama-like baseline)."""

    kv_aware = False

    def pick(self, candidates, ticket, now, fleet=()):
        return min(candidates, key=lambda w: w.order)


def keep_prefix_index(old: Scorer | None, new: Scorer) -> Scorer:
    """``new`` with ``old``'s prefix index when both keep one (a reload builds a new scorer, but
    what each worker holds in its caches did not change); returns ``new``."""
    index = getattr(old, "index", None)
    if index is not None and getattr(new, "index", None) is not None:
        new.index = index
    return new


def make_scorer(policy: str, *, affinity: bool = True, affinity_bound: float = 2.0,
                kv_weight: float = 0.5, prefill_weight: float = 0.5,
                affinity_wait_ms_per_1k_tokens: float = 0.0, affinity_wait_max_s: float = 1.0,
                seed: int | None = None) -> Scorer:
    """A scorer for a policy name (one of ``POLICIES``). Raises ValueError for others."""
    if policy == "least_loaded":
        return LeastLoaded(affinity_bound if affinity else None, kv_weight, prefill_weight,
                           affinity_wait_ms_per_1k_tokens, affinity_wait_max_s)
    if policy == "least_connections":
        return LeastConnections()
    if policy == "round_robin":
        return RoundRobin()
    if policy == "random":
        return Random(seed)
    if policy == "pack":
        return Pack()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {', '.join(POLICIES)}")
