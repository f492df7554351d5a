"""Dispatcher: admits tickets, hands out slot leases, keeps the bounded queue.

Pure: no I/O, time from the injected ``clock``. Every state change (submit, release,
a worker becoming ready) returns the dispatches it caused as ``(ticket, lease)`` pairs;
the caller (live gateway or simulator) delivers them.

Invariants (each has a test):
- a worker never holds more leases than it has slots, and never gets one unless ready
  and not draining;
- the queue never holds more than ``max_pending`` tickets; overflow raises ``QueueFull`` at once;
- a ticket is dispatched at most once; cancel/expire remove it from the queue.
"""

from __future__ import annotations

from typing import Callable, Iterable

from gateway.scheduling.lease import SlotLease
from gateway.scheduling.queue import AdmissionQueue
from gateway.scheduling.scorer import LeastLoaded, Scorer
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.worker_view import WorkerView

Dispatch = tuple[Ticket, SlotLease]


class QueueFull(Exception):
    """Raised by ``submit`` when every slot is busy and ``max_pending`` tickets already wait.

    Ollama answers this case with 503 ``server busy, please try again.  maximum pending
    requests exceeded`` (server/sched.go ``ErrMaxQueue``).
    """


class Dispatcher:
    """See module docstring.

    Args:
        clock: returns seconds (monotonic) as float.
        max_pending: queue bound (tickets); 0 means no queueing.
        scorer: picks a worker among candidates (default least-loaded).
        aging_s: seconds of waiting worth one priority class.
    """

    def __init__(self, clock: Callable[[], float], max_pending: int = 512,
                 scorer: Scorer | None = None, aging_s: float = 10.0):
        self.clock = clock
        self.max_pending = max_pending
        self.scorer: Scorer = scorer or LeastLoaded()
        self.queue = AdmissionQueue(aging_s=aging_s)
        self.workers: dict[str, WorkerView] = {}
        self._order = 0

    # ---- fleet -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, model: str, slots: int) -> WorkerView:
        """Register a worker (not ready yet). Raises ValueError if the id exists or slots < 1."""
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id!r} already registered")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        w = WorkerView(id=worker_id, model=model, slots=slots, order=self._order)
        self._order += 1
        self.workers[worker_id] = w
        return w

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker. Its live leases stay valid until released."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            w.ready = False

    def set_ready(self, worker_id: str, ready: bool) -> list[Dispatch]:
        w = self.workers[worker_id]
        w.ready = ready
        return self.pump() if ready else []

    def set_draining(self, worker_id: str, draining: bool) -> list[Dispatch]:
        w = self.workers[worker_id]
        w.draining = draining
        return [] if draining else self.pump()

    def set_slots(self, worker_id: str, slots: int) -> list[Dispatch]:
        """Change a worker's slot count (e.g. read back from ``/slots``)."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.workers[worker_id].slots = slots
        return self.pump()

    def serves(self, model: str) -> bool:
        return any(w.model == model for w in self.workers.values())

    # ---- requests ----------------------------------------------------------------------
    def _candidates(self, model: str) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.accepts(model)]

    def _grant(self, ticket: Ticket, candidates: list[WorkerView], now: float) -> SlotLease:
        worker = self.scorer.pick(candidates, ticket, now)
        assert worker.free > 0, "scorer picked a worker without a free slot"
        return SlotLease(worker, ticket, now, self._on_release)

    def submit(self, ticket: Ticket) -> SlotLease | None:
        """Admit ``ticket``: a lease at once if a slot is free and nobody for that model waits
        ahead of it, else queue it (returns None). Raises ``QueueFull`` when the queue is at
        ``max_pending``.
        """
        now = self.clock()
        ticket.enqueued_at = now
        if not self.queue.has_model(ticket.model):
            cands = self._candidates(ticket.model)
            if cands:
                return self._grant(ticket, cands, now)
        if len(self.queue) >= self.max_pending:
            raise QueueFull(ticket.request_id)
        self.queue.push(ticket)
        return None

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a queued ticket (client gone). True if it was still queued."""
        return self.queue.remove(ticket)

    def expire(self) -> list[Ticket]:
        """Remove and return queued tickets whose queue timeout has passed."""
        now = self.clock()
        gone = [t for t in self.queue if (d := t.deadline()) is not None and now >= d]
        for t in gone:
            self.queue.remove(t)
        return gone

    def _on_release(self, lease: SlotLease) -> list[Dispatch]:
        return self.pump()

    def pump(self) -> list[Dispatch]:
        """Dispatch queued tickets while some worker can take one. Best ticket first."""
        out: list[Dispatch] = []
        if not len(self.queue):
            return out
        now = self.clock()
        while True:
            free_models = {w.model for w in self.workers.values() if w.free > 0}
            if not free_models:
                return out
            t = self.queue.best(now, lambda t: t.model in free_models)
            if t is None:
                return out
            self.queue.remove(t)
            out.append((t, self._grant(t, self._candidates(t.model), now)))

    # ---- views -------------------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(w.busy for w in self.workers.values())

    def workers_for(self, model: str) -> Iterable[WorkerView]:
        return (w for w in self.workers.values() if w.model == model)
