"""The scheduler's view of one worker: capacity, readiness and its live leases."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class WorkerView:
    """Scheduling state of one llama-server worker.

    ``busy`` is derived from the set of live leases, so it can never drift from what was
    actually handed out: it is never negative, and dispatch never lets it exceed ``slots``.

    Attributes:
        id: worker id, e.g. ``demo-gpu0``.
        model: full model name it serves.
        slots: llama-server ``-np`` (concurrent requests it may hold).
        ready: True once ``/health`` answered 200 and until it exits or stalls.
        draining: True while an operator or a reload drains it: no new leases.
        order: position in the fleet, for stable tie-breaking.
    """

    id: str
    model: str
    slots: int
    ready: bool = False
    draining: bool = False
    order: int = 0
    leases: set = field(default_factory=set)

    @property
    def busy(self) -> int:
        """Slots held by live leases (0..slots)."""
        return len(self.leases)

    @property
    def free(self) -> int:
        """Slots free for a new lease now (0 when not ready or draining)."""
        if not self.ready or self.draining:
            return 0
        return max(0, self.slots - len(self.leases))

    def accepts(self, model: str) -> bool:
        """Whether a request for ``model`` could be leased a slot here right now."""
        return self.model == model and self.free > 0
