"""The gateway's bounded admission queue: priority classes with aging, FIFO within a class."""

from __future__ import annotations

from typing import Callable, Iterator

from gateway.scheduling.ticket import Ticket


class AdmissionQueue:
    """Tickets waiting for a slot.

    Order: highest *effective* priority first, where effective priority is
    ``priority + waited_seconds / aging_s`` (so a ticket that waited ``aging_s`` seconds
    ranks with the class above it and nothing starves), then admission order.

    The bound is enforced by the dispatcher (``Dispatcher.submit``) on :meth:`requests`; this
    class only orders and counts. Sizes here are small (``queue.max_pending``, 512 by default,
    plus the waiting inputs of admitted embedding requests), so selection is a scan.
    """

    def __init__(self, aging_s: float = 10.0):
        self.aging_s = aging_s
        self._items: dict[int, Ticket] = {}
        self._requests = 0  # queued tickets that are not follow_on

    def __len__(self) -> int:
        """Tickets waiting, the inputs of an embedding request each counted."""
        return len(self._items)

    def requests(self) -> int:
        """Requests waiting, as ``queue.max_pending`` counts them (Ollama's
        ``OLLAMA_MAX_QUEUE`` counts requests): the tickets that are not ``follow_on``. The
        further inputs of an embedding request, admitted once with its first input, are not
        counted (field case 2: 300 embedding requests of 2 inputs while workers load must not
        fill a queue of 512)."""
        return self._requests

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._items.values()))

    def __contains__(self, ticket: Ticket) -> bool:
        return self._items.get(ticket.seq) is ticket

    def push(self, ticket: Ticket) -> None:
        if self._items.get(ticket.seq) is not ticket:
            self._requests += not ticket.follow_on
        self._items[ticket.seq] = ticket

    def remove(self, ticket: Ticket) -> bool:
        """Remove ``ticket``; True if it was queued."""
        if self._items.get(ticket.seq) is ticket:
            del self._items[ticket.seq]
            self._requests -= not ticket.follow_on
            return True
        return False

    def effective_priority(self, ticket: Ticket, now: float) -> float:
        return ticket.priority + max(0.0, now - ticket.enqueued_at) / self.aging_s

    def ordered(self, now: float) -> list[Ticket]:
        """Tickets best first."""
        return sorted(self._items.values(),
                      key=lambda t: (-self.effective_priority(t, now), t.seq))

    def best(self, now: float, eligible: Callable[[Ticket], bool]) -> Ticket | None:
        """The best ticket for which ``eligible(ticket)`` holds, or None."""
        best_t, best_key = None, None
        for t in self._items.values():
            if not eligible(t):
                continue
            key = (-self.effective_priority(t, now), t.seq)
            if best_key is None or key < best_key:
                best_t, best_key = t, key
        return best_t

    def depth_by_priority(self) -> dict[int, int]:
        """Requests waiting (as :meth:`requests` counts them) per priority class."""
        out: dict[int, int] = {}
        for t in self._items.values():
            if not t.follow_on:
                out[t.priority] = out.get(t.priority, 0) + 1
        return out
