"""The live wrapper around the pure dispatcher: asyncio futures for queued requests.

``Admission.slot(ticket)`` is the only way a request gets a worker::

    async with admission.slot(ticket) as lease:
        ...  # talk to lease.worker

The lease is released in ``finally`` whatever happens (success, error, client disconnect,
cancellation), and each release hands freed slots to waiting requests at once.

Requests that no worker can take without an operator or the supervisor's next try are not left
to wait ``queue.timeout_s``: ``acquire`` raises an ``Unavailable`` (gateway.scheduling.refusals)
at once, and queued ones get it as soon as the fleet event that caused it arrives (operator
drain, crash-loop ``failed``, reload removal, shutdown).

A queued request in its affinity wait (delay scheduling, ``gateway.scheduling.dispatcher``)
is handed a worker when that wait ends even if no slot is released then: a timer pumps the
dispatcher at ``Dispatcher.next_wakeup()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from gateway.logs import get_logger
from gateway.scheduling import Dispatcher, QueueFull, ShuttingDown, SlotLease, Ticket, Unavailable

log = get_logger("gateway.admission")


class QueueTimeout(Exception):
    """A queued request waited longer than its queue timeout (answered 503)."""


class Admission:
    """Owns the dispatcher inside the event loop.

    Args:
        dispatcher: the pure scheduler (its clock should be ``time.monotonic``).
        expire_interval_s: how often queued tickets are checked against their timeout.
    """

    def __init__(self, dispatcher: Dispatcher, expire_interval_s: float = 0.25):
        self.dispatcher = dispatcher
        self.expire_interval_s = expire_interval_s
        self._waiters: dict[Ticket, asyncio.Future] = {}
        self._expiry_task: asyncio.Task | None = None
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None  # dispatcher clock seconds the timer fires at
        self.shutting_down = False  # set by ``shut_down``: every request is refused

    # ---- fleet events ----------------------------------------------------------------------
    def worker_ready(self, worker_id: str, ready: bool) -> None:
        self._deliver(self.dispatcher.set_ready(worker_id, ready))

    def worker_draining(self, worker_id: str, draining: bool, held: bool = False) -> None:
        self._deliver(self.dispatcher.set_draining(worker_id, draining, held))
        self.refuse_queued()

    def worker_checking(self, worker_id: str, checking: bool) -> None:
        """A stall check of the worker started or ended (``Dispatcher.set_checking``)."""
        self._deliver(self.dispatcher.set_checking(worker_id, checking))

    def worker_failed(self, worker_id: str, failed: bool, retry_at: float | None = None) -> None:
        """The supervisor entered (or left) crash-loop ``failed``; ``retry_at``: ``time.monotonic``
        seconds of its next start. When no worker of the model is left, its queued requests get
        ``AllFailed`` now."""
        self._deliver(self.dispatcher.set_failed(worker_id, failed, retry_at))
        self.refuse_queued()

    def refuse_queued(self) -> None:
        """Answer the queued requests that the dispatcher now refuses (``Dispatcher.refusal``)
        or that no longer fit its workers (``Dispatcher.drop_refused``) with why; called after
        every fleet change that can cause one (and after a reload)."""
        for t, why in self.dispatcher.drop_refused():
            self._fail(t, why)

    def refusal(self, model: str) -> Unavailable | None:
        """Why a request for ``model`` would be refused now (shutdown first), or None."""
        return ShuttingDown(model) if self.shutting_down else self.dispatcher.refusal(model)

    def would_refuse(self, model: str) -> Exception | None:
        """What ``acquire`` would raise at once for a new request of ``model`` (``ShuttingDown``,
        another ``Unavailable`` or ``QueueFull``), or None; changes nothing
        (``Dispatcher.would_refuse``)."""
        return ShuttingDown(model) if self.shutting_down else self.dispatcher.would_refuse(model)

    def shut_down(self) -> int:
        """The gateway stops: every queued request gets ``ShuttingDown`` now, and so does every
        later ``acquire``. Returns how many queued requests were answered."""
        self.shutting_down = True
        queued = list(self.dispatcher.queue)
        for t in queued:
            self.dispatcher.cancel(t)
            self._fail(t, ShuttingDown(t.model))
        return len(queued)

    def _fail(self, ticket: Ticket, error: Exception) -> None:
        fut = self._waiters.get(ticket)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def worker_slots(self, worker_id: str, slots: int) -> None:
        """Slots read back from the worker; a queued request that now asks for more slots
        than any worker has gets ``TooManySlots``."""
        self._deliver(self.dispatcher.set_slots(worker_id, slots))
        self.refuse_queued()

    def worker_context(self, worker_id: str, n_ctx: int, kv_capacity: int | None = None) -> None:
        """Per-slot context and whole KV capacity (tokens) read back from the worker; a queued
        request whose prompt now fits no worker gets ``TooLarge``."""
        self._deliver(self.dispatcher.set_context(worker_id, n_ctx, kv_capacity))
        self.refuse_queued()

    def worker_load(self, worker_id: str, load) -> None:
        """A polled ``WorkerLoad`` (telemetry); may free queued requests (KV headroom)."""
        self._deliver(self.dispatcher.update_load(worker_id, load))

    # ---- requests ----------------------------------------------------------------------------
    async def acquire(self, ticket: Ticket) -> SlotLease:
        """Wait for a slot. Raises ``QueueFull`` or an ``Unavailable`` at once (also later,
        while queued, when the fleet changes), ``QueueTimeout`` after the ticket's queue
        timeout; on cancellation the ticket leaves the queue immediately."""
        lease = self.submit(ticket)
        if lease is not None:
            return lease
        return await self.wait(ticket)

    def submit(self, ticket: Ticket) -> SlotLease | None:
        """A slot now, or None with the ticket queued: the caller must then ``await
        wait(ticket)`` at once. Raises as :meth:`acquire` does at once."""
        if self.shutting_down:
            raise ShuttingDown(ticket.model)
        return self.dispatcher.submit(ticket)

    async def wait(self, ticket: Ticket) -> SlotLease:
        """The slot of a ticket :meth:`submit` queued. Raises as :meth:`acquire` does while
        queued; on cancellation the ticket leaves the queue immediately."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        self._ensure_expiry()
        self._arm_wake()
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.dispatcher.cancel(ticket) and fut.done() and not fut.cancelled() \
                    and fut.exception() is None:
                # Dispatched in the same tick the client left: give the slot back.
                self.release(fut.result())
            raise
        finally:
            self._waiters.pop(ticket, None)

    def release(self, lease: SlotLease) -> None:
        self._deliver(lease.release())

    @contextlib.asynccontextmanager
    async def slot(self, ticket: Ticket) -> AsyncIterator[SlotLease]:
        lease = await self.acquire(ticket)
        try:
            yield lease
        finally:
            self.release(lease)

    def _deliver(self, dispatches) -> None:
        for ticket, lease in dispatches:
            fut = self._waiters.get(ticket)
            if fut is not None and not fut.done():
                fut.set_result(lease)
            else:  # its waiter is gone: free the slot again (may dispatch others)
                self._deliver(lease.release())
        self._arm_wake()

    def _arm_wake(self) -> None:
        """Pump the dispatcher when the earliest affinity wait ends (``next_wakeup``)."""
        at = self.dispatcher.next_wakeup()
        if at is None or (self._wake_at is not None and self._wake_at <= at):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fleet events outside the loop (tests): the next event pumps
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = at
        self._wake = loop.call_later(max(0.0, at - self.dispatcher.clock()), self._on_wake)

    def _on_wake(self) -> None:
        self._wake = self._wake_at = None
        self._deliver(self.dispatcher.pump())

    def _ensure_expiry(self) -> None:
        if self._expiry_task is None or self._expiry_task.done():
            self._expiry_task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.expire_interval_s)
            for t in self.dispatcher.expire():
                self._fail(t, QueueTimeout(t.request_id))

    def close(self) -> None:
        if self._expiry_task:
            self._expiry_task.cancel()
        if self._wake is not None:
            self._wake.cancel()


__all__ = ["Admission", "QueueFull", "QueueTimeout", "Unavailable"]
