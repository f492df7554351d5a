"""SlotLease: the slots of one worker held by one request (``ticket.slots``, usually one),
released exactly once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from gateway.scheduling.ticket import Ticket
    from gateway.scheduling.worker_view import WorkerView


class SlotLease:
    """Slots taken at dispatch (``slots``: the ticket's count), given back together on
    ``release()`` or on leaving a ``with`` block.

    Release is idempotent: the second call does nothing, so a ``finally`` and an explicit
    release can both run. The ``on_release`` callback (the dispatcher's) runs once. This is the
    only guard: the worker's ``hold`` / ``drop`` / ``prefilled`` count every call, so the
    lease calls each at most once (``hold`` on creation, ``drop`` on the first release,
    ``prefilled`` on the first ``first_token`` before release).
    """

    __slots__ = ("worker", "ticket", "granted_at", "slots", "_on_release", "_released",
                 "prefilling")

    def __init__(self, worker: "WorkerView", ticket: "Ticket", granted_at: float,
                 on_release: Callable[["SlotLease"], object]):
        self.worker = worker
        self.ticket = ticket
        self.granted_at = granted_at
        self.slots = max(1, ticket.slots)
        self._on_release = on_release
        self._released = False
        self.prefilling = True  # until the worker's first token (``first_token``)
        worker.hold(self)

    @property
    def released(self) -> bool:
        return self._released

    def first_token(self) -> None:
        """The worker sent the request's first token (or first answer byte): its prompt is
        computed, so it leaves the worker's prefill backlog (``WorkerView.prefill_backlog``).
        Only the first call counts, and none after ``release`` (which took it out already)."""
        if not self.prefilling:
            return
        if not self._released:
            self.worker.prefilled(self)
        self.prefilling = False

    def release(self):
        """Give the slots back. Returns what the dispatcher's callback returns (new dispatches)."""
        if self._released:
            return []
        self._released = True
        self.worker.drop(self)
        return self._on_release(self)

    def __enter__(self) -> "SlotLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SlotLease({self.ticket.request_id}@{self.worker.id}{' released' if self._released else ''})"
