"""Worker choice for one ticket among the workers that can take it now."""

from __future__ import annotations

from typing import Protocol, Sequence

from gateway.scheduling.ticket import Ticket
from gateway.scheduling.worker_view import WorkerView


class Scorer(Protocol):
    def pick(self, candidates: Sequence[WorkerView], ticket: Ticket, now: float) -> WorkerView: ...


class LeastLoaded:
    """Lowest occupancy (busy / slots) first; ties go to the worker with fewer busy slots,
    then to fleet order. With equal workers this spreads requests 1-1-1-1 before 2-2-2-2.
    """

    def pick(self, candidates: Sequence[WorkerView], ticket: Ticket, now: float) -> WorkerView:
        return min(candidates, key=lambda w: (w.busy / w.slots, w.busy, w.order))


class RoundRobin:
    """Next worker in fleet order after the last one chosen (baseline)."""

    def __init__(self):
        self._last = -1

    def pick(self, candidates: Sequence[WorkerView], ticket: Ticket, now: float) -> WorkerView:
        ordered = sorted(candidates, key=lambda w: w.order)
        for w in ordered:
            if w.order > self._last:
                self._last = w.order
                return w
        self._last = ordered[0].order
        return ordered[0]
