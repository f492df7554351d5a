"""The scheduler's view of one worker: capacity, readiness, live leases and polled telemetry."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    """What the last poll of a worker said (``workers.telemetry`` parses it).

    Attributes:
        at: clock seconds of the poll.
        processing: slots with ``is_processing`` (or ``state != 0``) in ``/slots``.
        kv_tokens: sum over processing slots of prompt + decoded tokens (``n_prompt_tokens`` +
            ``next_token[0].n_decoded``), i.e. what they hold in KV now (tokens).
        deferred: ``llamacpp:requests_deferred`` from ``/metrics`` (requests waiting inside the
            worker; the gateway aims to keep it 0).
        decode_tps: recent measured generation throughput of the whole worker (tokens/s), from
            the ``tokens_predicted_total`` delta over the poll interval; 0 if unknown.
        n_ctx: per-slot context read from ``/slots`` (tokens), 0 if unknown.
    """

    at: float = 0.0
    processing: int = 0
    kv_tokens: int = 0
    deferred: int = 0
    decode_tps: float = 0.0
    n_ctx: int = 0


@dataclass(eq=False)
class WorkerView:
    """Scheduling state of one llama-server worker.

    ``busy`` counts the slots of the live leases (each holds ``lease.slots``: one, or ``n``
    for a ``/v1`` request with ``n`` choices). It is a counter kept by ``hold`` and ``drop``,
    the only places a lease joins or leaves ``leases`` (the scorer reads it many times per
    decision), so it always equals the sum over ``leases``: it is never negative, and dispatch
    never lets it exceed ``slots``. ``prefill_backlog`` and ``kv_reserved`` are counters of the
    same kind (``prefilled`` too keeps the first). Each lease calls ``hold`` once when it is
    taken, and ``drop`` and ``prefilled`` at most once, while it is held: ``SlotLease``
    guards that, so these methods do not check again.
    Polled telemetry (``load``) only *corrects scores*: ``phantom`` counts slots the worker
    reports busy that the gateway holds no lease for (e.g. a cancelled request still winding
    down); it never changes ``free``.

    Attributes:
        id: worker id, e.g. ``demo-gpu0``.
        model: full model name it serves.
        slots: llama-server ``-np`` (concurrent requests it may hold).
        ready: True once ``/health`` answered 200 and until it exits or stalls.
        draining: True while an operator or a reload drains it: no new leases.
        held: the draining is the operator's (admin drain), not a reload's or restart's.
        failed: the supervisor gave up restarting it (crash loop); never ready meanwhile.
        retry_at: clock seconds of the supervisor's next start of a failed worker (None: none).
        retiring: a reload is removing it (draining, then stopping): it no longer counts as a
            worker of its model, so a model left without others is refused at once.
        checking: its supervisor is checking it after stalls (``workers.stall_check``, up to
            ``liveness_timeout_s``): new work goes to its model's other workers while one of
            them is in rotation (``Dispatcher``), and to it only when it is the last.
        order: position in the fleet, for stable tie-breaking.
        n_ctx: per-slot context (tokens), 0 = unknown (no per-slot check).
        kv_capacity: KV cells of the whole worker (tokens, llama-server ``-c``); 0 = unknown.
        cache_tokens: prompt tokens the worker keeps cached, in its slots and its host prompt
            cache (``gateway.prompt_cache.worker_cache_tokens``); 0 = unknown.
        speed: relative decode speed (1.0 = the model's reference worker, or unmeasured);
            mixed GPU models differ. The gateway measures it (``gateway.speed``).
    """

    id: str
    model: str
    slots: int
    ready: bool = False
    draining: bool = False
    held: bool = False  # drained by the operator (admin drain), not by a reload or restart
    failed: bool = False  # crash-loop ``failed``: the supervisor gave up restarting it for now
    retry_at: float | None = None  # clock seconds of its next automatic start while failed
    retiring: bool = False  # a reload is removing it
    checking: bool = False  # a stall check runs: the model's last resort until it ends
    order: int = 0
    n_ctx: int = 0
    kv_capacity: int = 0
    cache_tokens: int = 0
    speed: float = 1.0
    leases: set = field(default_factory=set)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    releases: deque = field(default_factory=lambda: deque(maxlen=256))  # clock s of releases
    _busy: int = field(default=0, init=False, repr=False)  # sum of ``l.slots`` over ``leases``
    # sum of ``l.ticket.prefill_tokens`` over the ``leases`` still ``prefilling``
    _prefill: int = field(default=0, init=False, repr=False)
    # sum of ``_kv_of(l)`` over ``leases``, at the per-slot cap ``_kv_ctx`` (``n_ctx`` then)
    _kv: int = field(default=0, init=False, repr=False)
    _kv_ctx: int = field(default=0, init=False, repr=False)

    def hold(self, lease) -> None:
        """Add a live lease (``SlotLease`` calls it once, when it is taken); counts its slots,
        its prefill (it has had no first token yet) and its KV reservation."""
        self._sync_kv()
        self.leases.add(lease)
        self._busy += lease.slots
        if lease.prefilling:
            self._prefill += lease.ticket.prefill_tokens
        self._kv += self._kv_of(lease)

    def drop(self, lease) -> None:
        """Remove a held lease (``SlotLease`` calls it once, on its release); gives back what
        ``hold`` counted."""
        self._sync_kv()
        self.leases.remove(lease)
        self._busy -= lease.slots
        if lease.prefilling:
            self._prefill -= lease.ticket.prefill_tokens
        self._kv -= self._kv_of(lease)

    def prefilled(self, lease) -> None:
        """A held lease had its first token (``SlotLease.first_token`` calls it once, before it
        clears ``lease.prefilling``): its prompt leaves ``prefill_backlog``."""
        self._prefill -= lease.ticket.prefill_tokens

    def _kv_of(self, lease) -> int:
        """The tokens ``lease`` may occupy: its estimate capped at ``n_ctx`` in each slot."""
        est = lease.ticket.est_tokens
        return (min(est, self.n_ctx) if self.n_ctx else est) * lease.slots

    def _sync_kv(self) -> None:
        """Recount ``kv_reserved`` when ``n_ctx`` changed since it was counted (the cap of
        every lease's share changed; ``n_ctx`` is set when read back from the worker, rarely)."""
        if self._kv_ctx != self.n_ctx:
            self._kv_ctx = self.n_ctx
            self._kv = sum(self._kv_of(l) for l in self.leases)

    def note_release(self, at: float, slots: int = 1) -> None:
        """A lease of this worker holding ``slots`` slots ended at clock ``at`` (seconds)."""
        self.releases.extend([at] * slots)

    @property
    def busy(self) -> int:
        """Slots held by live leases (0..slots): the counter ``hold`` and ``drop`` keep."""
        return self._busy

    @property
    def in_rotation(self) -> bool:
        """Whether the worker may get new work now: ready and not draining (operator, reload or
        restart), crash-loop failed or retiring. Side calls go only to such workers too."""
        return self.ready and not (self.draining or self.failed or self.retiring)

    @property
    def free(self) -> int:
        """Slots free for a new lease now (0 when not ``in_rotation``)."""
        if not self.in_rotation:
            return 0
        return max(0, self.slots - self.busy)

    @property
    def phantom(self) -> int:
        """Slots the last poll saw busy beyond the gateway's leases (0..free).

        Leases released after that poll are not phantom: the poll is up to one interval old
        and still shows their slots busy. Counting them steered new requests away from the
        worker that had just freed a slot (in the simulator this raised TTFT p99 on the Poisson
        trace from 1.04× to 1.26× the oracle's)."""
        since, at = 0, self.load.at
        for t in reversed(self.releases):  # appended in clock order: count back to the poll
            if t < at:
                break
            since += 1
        busy = self.busy
        return max(0, min(self.slots - busy, self.load.processing - busy - since))

    @property
    def all_slots_taken(self) -> bool:
        """Whether no slot is free as far as the gateway knows: its live leases (``busy``)
        plus the slots the last poll saw busy beyond them (``phantom``) fill all ``slots``.
        Unlike ``free`` it ignores rotation (a worker being drained can be full too).

        The gateway asks it when a request on the worker stalls, while that request still
        holds its lease (``gateway.fleet.Fleet.note_stall``): True then means the stalled
        request held the worker's last free slot, so if the worker never frees that slot
        (field case 10, "accepted but never scheduled") it can take no more work."""
        return self.busy + self.phantom >= self.slots

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens the worker still has to compute before the first tokens of its live
        leases: the ``prefill_tokens`` estimates of leases that have not had a first token
        (a counter kept by ``hold``, ``drop`` and ``prefilled``)."""
        return self._prefill

    @property
    def kv_reserved(self) -> int:
        """Tokens the live leases may occupy (gateway estimate, each slot's capped at ``n_ctx``;
        a lease of ``n`` slots holds its estimate in each). A counter kept by ``hold`` and
        ``drop``, recounted once after ``n_ctx`` changes."""
        self._sync_kv()
        return self._kv

    @property
    def kv_used(self) -> int:
        """KV tokens considered in use: the larger of own reservations and the polled fill.

        The polled fill is left out while a lease was released after that poll: the poll is up
        to one interval old and still counts the released requests' tokens (as ``phantom``
        leaves out their slots). Counting them refused requests for want of KV headroom on a
        worker whose slots had all just freed (a fresh tester's burst of long requests got
        503 "maximum pending requests exceeded" with every slot free)."""
        polled = self.load.kv_tokens
        if polled and self.releases and self.releases[-1] >= self.load.at:
            polled = 0
        return max(self.kv_reserved, polled)

    @property
    def kv_free(self) -> int | None:
        """KV tokens still available (None when capacity is unknown)."""
        if not self.kv_capacity:
            return None
        return max(0, self.kv_capacity - self.kv_used)

    def fits(self, ticket) -> bool:
        """Whether the ticket's size estimate fits this worker's KV headroom now.

        Per slot: the prompt must fit ``n_ctx`` (generation past it stops with ``length``).
        Whole worker: ``min(est_tokens, n_ctx)`` times the ticket's ``slots``, but never more
        than the whole cache (an idle worker always takes it), must fit ``kv_free`` (matters
        with ``--kv-unified``, where slots share one cache; with split KV a free slot always has
        its own ``n_ctx``)."""
        if self.n_ctx and ticket.prompt_tokens >= self.n_ctx:
            return False
        kf = self.kv_free
        if kf is None:
            return True
        need = min(ticket.est_tokens, self.n_ctx) if self.n_ctx else ticket.est_tokens
        return min(need * ticket.slots, self.kv_capacity) <= kf

    def accepts(self, model: str, slots: int = 1) -> bool:
        """Whether a request for ``model`` that needs ``slots`` slots could be leased them here
        right now."""
        return self.model == model and self.free >= slots
