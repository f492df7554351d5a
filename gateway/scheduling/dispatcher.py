"""Dispatcher: admits tickets, hands out slot leases, keeps the bounded queue.

Pure: no I/O, time from the injected ``clock``. Every state change (submit, release,
a worker becoming ready) returns the dispatches it caused as ``(ticket, lease)`` pairs;
the caller (live gateway or simulator) delivers them.

Invariants (each has a test):
- a worker never holds more leased slots than it has (a ticket of ``slots`` > 1, a ``/v1``
  request with ``n`` choices, goes only to a worker with that many free slots and holds them
  all), and never gets a lease unless ready and not draining;
- the queue never holds more than ``max_pending`` requests (``AdmissionQueue.requests``: the
  inputs of an admitted embedding request after its first are not counted); overflow raises
  ``QueueFull`` at once;
- a ticket is dispatched at most once; cancel/expire remove it from the queue;
- a ticket whose model no worker can take without an operator or the supervisor's next try
  (``refusal``: every worker drained by the operator or crash-loop ``failed``, or the model
  removed) is refused at submit (``Unavailable``) and ``drop_refused`` takes such tickets out
  of the queue; while any worker of the model is ready, starting or restarting they wait;
- with a KV-aware scorer, a worker is only chosen when the ticket fits its KV headroom
  (``WorkerView.fits``); a ticket whose prompt fits no worker's slot is refused up front
  (``check_fits`` raises ``TooLarge``), and so is one that needs more slots than any worker of
  its model has (``TooManySlots``).

Queue order is by effective priority (priority + aging, ``AdmissionQueue``). A queued ticket
that is blocked only by KV headroom or by too few free slots on any one worker (a multi-slot
ticket) is passed by smaller ones until it has waited ``aging_s``; from then on nothing else of
its model is dispatched before it (no starvation of large requests).

Delay scheduling for affinity (Zaharia et al., EuroSys 2010; ``LeastLoaded.affinity_wait``):
a ticket whose prefix is held by a worker that cannot take it now may stay queued while a
candidate is free, until ``enqueued_at`` + its wait (``Ticket.held_until``; never more than the
scorer's ``wait_max_s``); other tickets take the free slot meanwhile, in queue order, and a new
ticket is granted at once when every queued ticket of its model is such a waiting one. The
caller must pump again at ``next_wakeup()``, the earliest end of such a wait, since no release
need come by then.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from gateway.scheduling.lease import SlotLease
from gateway.scheduling.queue import AdmissionQueue
from gateway.scheduling.refusals import (AllDrained, AllFailed, ModelRemoved, NoWorkers, NotStarted,
                                         Unavailable)
from gateway.scheduling.scorer import LeastLoaded, Scorer
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.worker_view import WorkerLoad, WorkerView
from gateway.texts import context_overflow, too_many_choices

Dispatch = tuple[Ticket, SlotLease]


class QueueFull(Exception):
    """Raised by ``submit`` when every slot is busy and ``max_pending`` tickets already wait.

    Ollama answers this case with 503 ``server busy, please try again.  maximum pending
    requests exceeded`` (server/sched.go ``ErrMaxQueue``).
    """


class TooLarge(Exception):
    """The ticket's prompt estimate exceeds the per-slot context of every worker of its model.

    Attributes: prompt_tokens (estimate), n_ctx (largest per-slot context, tokens).
    Answered 400 before anything is forwarded (field case 4).
    """

    def __init__(self, prompt_tokens: int, n_ctx: int):
        super().__init__(context_overflow(prompt_tokens, n_ctx, approx=True))
        self.prompt_tokens, self.n_ctx = prompt_tokens, n_ctx


class TooManySlots(Exception):
    """The ticket's choices (``Ticket.slots`` ÷ ``Ticket.prompts``: a ``/v1`` request's ``n``)
    are more than any worker of its model has slots. Attributes: slots (choices asked),
    max_slots (largest worker's ``slots``). Answered 400 before anything is forwarded, as
    llama-server refuses ``n`` above its ``-np`` (``n_cmpl`` hard limit 1..n_parallel,
    tools/server/server-schema.cpp)."""

    def __init__(self, slots: int, max_slots: int):
        super().__init__(too_many_choices(slots, max_slots))
        self.slots, self.max_slots = slots, max_slots


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
        self.removed: set[str] = set()  # models whose last worker was removed (reload)
        #: models whose only workers a reload added and removed again, as they did not start:
        #: why (``NotStarted``); set by the reloader, cleared when a worker of it is added
        self.not_started: dict[str, str] = {}
        self._order = 0

    # ---- fleet -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, model: str, slots: int, n_ctx: int = 0,
                   kv_capacity: int = 0, speed: float = 1.0, cache_tokens: int = 0) -> WorkerView:
        """Register a worker (not ready yet). ``n_ctx``: per-slot context (tokens, 0 unknown);
        ``kv_capacity``: the worker's whole KV cache (tokens, ``-c``; 0 unknown);
        ``cache_tokens``: prompt tokens it keeps cached (slots + host cache; 0 unknown); ``speed``:
        relative throughput. Raises ValueError if the id exists or slots < 1."""
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id!r} already registered")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        w = WorkerView(id=worker_id, model=model, slots=slots, order=self._order, n_ctx=n_ctx,
                       kv_capacity=kv_capacity, speed=speed, cache_tokens=cache_tokens)
        self._order += 1
        self.workers[worker_id] = w
        self.removed.discard(model)
        self.not_started.pop(model, None)
        return w

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker. Its live leases stay valid until released. When it was its
        model's last worker, the model counts as removed (``ModelRemoved``) until a worker of
        it is added again; a restart removes and adds without anything in between."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            w.ready = False
            self._forget_cache(worker_id)
            if not self.serves(w.model):
                self.removed.add(w.model)

    def retire(self, worker_id: str) -> None:
        """A reload is removing the worker: no new leases; its live leases stay valid until
        released. Once every worker of a model retires, the model is refused (``ModelRemoved``)
        at once, not only after its workers have drained and stopped."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.retiring = True

    def _forget_cache(self, worker_id: str) -> None:
        """A worker that stopped lost its prompt cache: tell a scorer that remembers prefixes."""
        forget = getattr(self.scorer, "forget", None)
        if forget is not None:
            forget(worker_id)

    def set_ready(self, worker_id: str, ready: bool) -> list[Dispatch]:
        w = self.workers[worker_id]
        if w.ready and not ready:
            self._forget_cache(worker_id)
        w.ready = ready
        return self.pump() if ready else []

    def set_draining(self, worker_id: str, draining: bool, held: bool = False) -> list[Dispatch]:
        """Take a worker out of rotation or back. ``held``: the operator's drain (admin API),
        which counts for ``refusal``; a reload or restart drains without it, and requests
        wait for the worker to come back."""
        w = self.workers[worker_id]
        w.draining = draining
        w.held = draining and held
        return [] if draining else self.pump()

    def set_failed(self, worker_id: str, failed: bool, retry_at: float | None = None
                   ) -> list[Dispatch]:
        """The supervisor gave up restarting a worker (crash-loop ``failed``) or tries again.
        ``retry_at``: clock seconds of its next automatic start (None: none scheduled). A failed
        worker is not ready. Unknown ids are ignored (a replaced worker's last report).
        Returns no dispatches (leaving ``failed`` means starting, not ready)."""
        w = self.workers.get(worker_id)
        if w is None:
            return []
        if failed and w.ready:
            self.set_ready(worker_id, False)
        w.failed = failed
        w.retry_at = retry_at if failed else None
        return []

    def set_checking(self, worker_id: str, checking: bool) -> list[Dispatch]:
        """A stall check of the worker started or ended (``WorkerView.checking``). While it
        runs the worker gets new work only when no other worker of its model is in rotation
        (``_candidates``): a silent worker is then not handed the requests that arrive during
        the check (each would wait ``first_byte_s`` for a first byte before its retry), and a
        model's only worker still takes them, so they fail fast when it is really silent
        instead of waiting out the check. Unknown ids are ignored."""
        w = self.workers.get(worker_id)
        if w is None or w.checking == checking:
            return []
        w.checking = checking
        return [] if checking else self.pump()

    def set_slots(self, worker_id: str, slots: int) -> list[Dispatch]:
        """Change a worker's slot count (e.g. read back from ``/slots``)."""
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.workers[worker_id].slots = slots
        return self.pump()

    def set_context(self, worker_id: str, n_ctx: int, kv_capacity: int | None = None
                    ) -> list[Dispatch]:
        """Per-slot context and whole-worker KV capacity (tokens) read back from the worker."""
        w = self.workers[worker_id]
        w.n_ctx = max(0, int(n_ctx))
        if kv_capacity is not None:
            w.kv_capacity = max(0, int(kv_capacity))
        return self.pump()

    def update_load(self, worker_id: str, load: WorkerLoad) -> list[Dispatch]:
        """Polled telemetry for a worker (corrects scores; never changes lease counts)."""
        w = self.workers.get(worker_id)
        if w is None:
            return []
        w.load = load
        if load.n_ctx and not w.n_ctx:
            w.n_ctx = load.n_ctx
        return self.pump()

    def set_speed(self, worker_id: str, speed: float) -> None:
        """Relative throughput of a worker (1.0 = reference); must be > 0."""
        if speed > 0:
            self.workers[worker_id].speed = speed

    def serves(self, model: str) -> bool:
        return any(w.model == model for w in self.workers.values())

    # ---- requests ----------------------------------------------------------------------
    def _candidates(self, ticket: Ticket) -> list[WorkerView]:
        kv = getattr(self.scorer, "kv_aware", False)
        cands = [w for w in self.workers.values()
                 if w.accepts(ticket.model, ticket.slots) and (not kv or w.fits(ticket))]
        if any(w.checking for w in cands) and any(
                w.in_rotation and not w.checking and w.model == ticket.model
                and w.slots >= ticket.slots for w in self.workers.values()):
            cands = [w for w in cands if not w.checking]  # wait for a worker not under check
        if ticket.avoid:  # a retry: another worker if one can take it now, else the same
            return [w for w in cands if w.id not in ticket.avoid] or cands
        return cands

    def _grant(self, ticket: Ticket, candidates: list[WorkerView], now: float) -> SlotLease:
        fleet = [w for w in self.workers.values()
                 if w.model == ticket.model and w.ready and not w.draining]
        ticket.held_until = None
        ticket.waited_s += max(0.0, now - ticket.enqueued_at)
        ticket.granted = ticket.admitted = True
        worker = self.scorer.pick(candidates, ticket, now, fleet)
        assert worker.free >= ticket.slots, "scorer picked a worker without enough free slots"
        return SlotLease(worker, ticket, now, self._on_release)

    def _most_slots(self, model: str) -> int:
        """The largest ``slots`` of a worker of ``model`` (0 when it has none)."""
        return max((w.slots for w in self.workers.values() if w.model == model), default=0)

    def _holds(self, ticket: Ticket, candidates: list[WorkerView], now: float) -> bool:
        """Whether ``ticket``, which ``candidates`` could take now, waits for the worker that
        holds its prefix (delay scheduling, module docstring); sets ``ticket.held_until``. The
        wait is at most half the ticket's queue timeout, so a wait longer than that in the config
        cannot turn into a queue-timeout 503 while another worker has a free slot."""
        wait = getattr(self.scorer, "affinity_wait", None)
        # off (the default): no fleet list on every submit and pump for a wait of 0
        if wait is not None and getattr(self.scorer, "wait_s_per_token", 0):
            fleet = [w for w in self.workers.values() if w.model == ticket.model
                     and w.in_rotation and w.slots >= ticket.slots and w.id not in ticket.avoid]
            waited = wait(candidates, ticket, fleet)
            if ticket.queue_timeout_s is not None:  # end well before the queue timeout (503)
                waited = min(waited, ticket.queue_timeout_s / 2)
            until = ticket.enqueued_at + waited
            if now < until:
                ticket.held_until = until
                return True
        ticket.held_until = None
        return False

    @staticmethod
    def _waiting(ticket: Ticket, now: float) -> bool:
        """Whether a queued ticket is in its affinity wait (it does not keep others out)."""
        return ticket.held_until is not None and now < ticket.held_until

    def _queued_ahead(self, model: str) -> bool:
        """Whether a queued ticket of ``model`` that is not in its affinity wait would go before
        a new one."""
        now = self.clock()
        return any(t.model == model and not self._waiting(t, now) for t in self.queue)

    def next_wakeup(self) -> float | None:
        """Clock seconds of the earliest end of a queued ticket's affinity wait still to come,
        or None: the caller calls ``pump`` then (no release need come by then)."""
        now = self.clock()
        ends = [t.held_until for t in self.queue if t.held_until is not None and t.held_until > now]
        return min(ends, default=None)

    def cut_slots(self, ticket: Ticket) -> None:
        """Cut a ticket of several prompts (``Ticket.prompts``) that needs more slots than the
        largest worker of its model has down to that worker's size: it waits for a whole
        worker and holds all of it, and llama-server runs the tasks beyond its slots as those
        of the same request finish (it accepts any number of prompts,
        ``tokenize_input_prompts``; OpenAI too). Its worker gets nothing else meanwhile, so
        only the request's own tasks wait inside the worker.

        Called where the ticket is made (``gateway.api.common.make_ticket``) and again by
        ``submit``, as the fleet may have changed in between (a reload). Leaves every other
        ticket alone, including one whose choices (``n``) alone are more than any worker's
        slots (``check_fits`` refuses it)."""
        if ticket.slots <= 1 or ticket.prompts <= 1:
            return
        most = self._most_slots(ticket.model)
        if most and ticket.slots > most and ticket.slots // ticket.prompts <= most:
            ticket.slots = most

    def check_fits(self, ticket: Ticket) -> None:
        """Raise ``TooManySlots`` when the ticket's choices (``n``: ``slots`` ÷ ``prompts``)
        are more than any worker of its model has slots, and ``TooLarge`` when its prompt
        estimate cannot fit the per-slot context of any worker of its model (workers with
        unknown context never refuse). Only checks: changes nothing (``cut_slots`` sizes a
        ticket of several prompts to the fleet)."""
        if ticket.slots > 1:
            most = self._most_slots(ticket.model)
            if most and ticket.slots > most and ticket.slots // ticket.prompts > most:
                raise TooManySlots(ticket.slots // ticket.prompts, most)
        if ticket.prompt_tokens <= 0:
            return
        ctxs = [w.n_ctx for w in self.workers.values() if w.model == ticket.model]
        if not ctxs or any(c <= 0 for c in ctxs):
            return
        if ticket.prompt_tokens >= max(ctxs):
            raise TooLarge(ticket.prompt_tokens, max(ctxs))

    def submit(self, ticket: Ticket) -> SlotLease | None:
        """Admit ``ticket``: a lease at once if a slot is free and nobody for that model waits
        ahead of it, else queue it (returns None). Raises ``QueueFull`` when the queue is at
        ``max_pending`` (not for a ``follow_on`` ticket or one admitted before, a retry) and
        ``refusal``'s ``Unavailable``;
        ``check_fits``'s ``TooManySlots`` and ``TooLarge``, after ``cut_slots``.
        """
        self.cut_slots(ticket)
        self.check_fits(ticket)
        now = self.clock()
        ticket.enqueued_at, ticket.granted = now, False
        if not self._queued_ahead(ticket.model):
            cands = self._candidates(ticket)
            # A ticket that would wait for its prefix's worker but cannot queue is granted now.
            if cands and (not self._holds(ticket, cands, now)
                          or self._queue_refusal(ticket.model, ticket.request_id) is not None):
                return self._grant(ticket, cands, now)
        refused = (self.refusal(ticket.model) if ticket.follow_on or ticket.admitted
                   else self._queue_refusal(ticket.model, ticket.request_id))
        if refused is not None:
            raise refused
        self.queue.push(ticket)
        return None

    def _queue_refusal(self, model: str, request_id: str) -> Exception | None:
        """Why a ticket of ``model`` that must wait cannot join the queue: ``refusal``'s
        ``Unavailable``, else ``QueueFull`` at ``max_pending``; None when it can."""
        refused = self.refusal(model)
        if refused is not None:
            return refused
        if self.queue.requests() >= self.max_pending:
            return QueueFull(request_id)
        return None

    def refusal(self, model: str) -> Unavailable | None:
        """Why no request for ``model`` can be served without an operator, a config change or the
        supervisor's next scheduled try, or None while waiting can help (some worker of it is
        ready, starting, restarting or drained by a reload or restart).

        ``ModelRemoved`` when a reload removed (or is removing: ``retire``) its last worker;
        ``NoWorkers`` when no worker of it was ever registered (its config plans none here;
        workers are registered before the gateway serves); ``NotStarted`` when a reload added
        its workers and removed them again; ``AllDrained`` when the operator
        drained every worker; ``AllFailed`` when every worker is crash-loop ``failed`` or
        operator-drained with at least one failed (its Retry-After: the earliest next try).
        """
        of_model = [w for w in self.workers.values() if w.model == model]
        ws = [w for w in of_model if not w.retiring]
        if not ws:
            if model in self.not_started:
                return NotStarted(model, self.not_started[model])
            return ModelRemoved(model) if model in self.removed or of_model else NoWorkers(model)
        if not all(w.failed or (w.draining and w.held) for w in ws):
            return None
        failed = [w for w in ws if w.failed]
        if not failed:
            return AllDrained(model)
        retry = [w.retry_at for w in failed if w.retry_at is not None]
        retry_in = max(1, math.ceil(min(retry) - self.clock())) if retry else None
        return AllFailed(model, retry_in, drained=len(ws) - len(failed))

    def in_rotation(self, model: str) -> list[WorkerView]:
        """The workers of ``model`` that may get new work now (``WorkerView.in_rotation``):
        where side calls for it may go."""
        return [w for w in self.workers.values() if w.model == model and w.in_rotation]

    def would_refuse(self, model: str) -> Exception | None:
        """What ``submit`` would raise now for a new ticket of ``model`` that no KV check blocks
        (``refusal``'s ``Unavailable``, else ``QueueFull``), or None. Changes nothing: a request
        that must do work before it reaches admission (``/api/generate`` renders its prompt
        through side calls) asks this first, so an overflow gets its 503 as fast as one that goes
        straight to admission. Never refuses what ``submit`` would take; ``submit`` still
        decides."""
        if not self._queued_ahead(model) and any(w.accepts(model)
                                                   for w in self.workers.values()):
            return None
        return self._queue_refusal(model, "")

    def drop_refused(self) -> list[tuple[Ticket, Exception]]:
        """Remove and return the queued tickets that ``refusal`` now refuses, or that
        ``check_fits`` now rejects (a reload gave the model fewer slots or a shorter context
        than a waiting ticket needs: waiting could only end in the queue timeout), each with
        why (``Unavailable``, ``TooManySlots``, ``TooLarge``)."""
        gone: list[tuple[Ticket, Exception]] = []
        for t in list(self.queue):
            why: Exception | None = self.refusal(t.model)
            if why is None:
                try:
                    self.check_fits(t)
                except (TooManySlots, TooLarge) as e:
                    why = e
            if why is not None:
                self.queue.remove(t)
                gone.append((t, why))
        return gone

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
        lease.worker.note_release(self.clock(), lease.slots)
        return self.pump()

    def pump(self) -> list[Dispatch]:
        """Dispatch queued tickets while some worker can take one. Best ticket first."""
        out: list[Dispatch] = []
        if not len(self.queue):
            return out
        now = self.clock()
        blocked: set[str] = set()
        free_models = {w.model for w in self.workers.values() if w.free > 0}
        for t in self.queue.ordered(now):
            if not free_models:
                break
            if t.model not in free_models:
                continue
            cands = self._candidates(t)
            if not cands:  # free slots, but not enough on one worker or no KV headroom for this one
                if now - t.enqueued_at >= self.queue.aging_s:
                    blocked.add(t.model)  # waited long enough: nothing passes it
                    free_models.discard(t.model)
                continue
            if self._holds(t, cands, now):
                continue  # waits for the worker holding its prefix; others may pass
            self.queue.remove(t)
            out.append((t, self._grant(t, cands, now)))
            free_models = {w.model for w in self.workers.values() if w.free > 0} - blocked
        return out

    # ---- views -------------------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(w.busy for w in self.workers.values())

    def workers_for(self, model: str) -> Iterable[WorkerView]:
        return (w for w in self.workers.values() if w.model == model)
