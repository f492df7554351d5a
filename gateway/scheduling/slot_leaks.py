"""Leaked slots: a worker slot busy with one task that no request of the gateway can be.

The gateway is each worker's only client (a per-start API key), and every request it sends
to a worker holds a lease there (``SlotLease``) from before it is sent until it ended or was
cancelled. llama-server frees the slot of a cancelled request soon after the gateway closed
the connection (the pinned build: about 0.5 s streamed, 2 s not; ``workers/stall_check.py``),
and its ``/slots`` names the task a slot runs (``id_task``, a number new for every task of a
process: ``server-context.cpp`` ``to_json``). So a slot seen busy with the same task for a long
time while no live lease of that worker was granted before the slot was first seen with it
runs a task no client waits for: a slot that was never freed (field case 10, "accepted but
never scheduled", on one slot of several). Its worker keeps working on its other slots, so
neither liveness nor the stall check (``workers.stall_check``: some work moves) restarts it,
and it would run one slot short until an admin restart.

:class:`SlotLeakWatch` tracks one worker's polled slots (pure: no I/O; time from the injected
``clock``, the dispatcher's, which also stamps ``SlotLease.granted_at``). Evidence of a leak:

* the slot was busy with the same ``id_task`` in every poll since it was first seen with it
  (idle, another task or a missing slot starts over; a slot without ``id_task``, from an
  older build, is never judged);
* for longer than ``bound_s`` seconds no live lease of the worker was older than that first
  sighting. A lease granted before it could be the request running the task (a legitimate
  request of any length, a long prefill); one granted after it cannot. The first sighting is
  stamped when its poll was handled, after the ``/slots`` answer arrived, so the lease of the
  request that started the task is always older, even when the poll was sent before it was
  granted. The time counts from the last poll at which such a lease still lived, so a slot
  that llama-server frees a little late after its request ended (the lag above; a cancelled
  long prefill on a slow CPU can take the length of one batch) has ``bound_s`` to do it.

A leak is reported once (a restart of the worker resets the watch: :meth:`reset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol


class PolledSlot(Protocol):
    """What the watch reads of one ``/slots`` entry (``workers.telemetry.SlotState``)."""

    id: int
    busy: bool
    id_task: int | None


@dataclass(frozen=True)
class SlotLeak:
    """One leaked slot. ``busy_s``: seconds since it was first seen busy with ``id_task``;
    ``unclaimed_s``: seconds since a live lease last could have been that task."""

    slot: int
    id_task: int
    busy_s: float
    unclaimed_s: float


@dataclass
class _Busy:
    id_task: int
    since: float  # clock of the first sighting with this task
    claimed_at: float  # clock of the last poll at which a lease older than ``since`` lived
    reported: bool = False


class SlotLeakWatch:
    """Leaked-slot evidence for one worker (module doc).

    Args:
        clock: returns seconds (monotonic), the clock of ``SlotLease.granted_at``.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._busy: dict[int, _Busy] = {}

    def observe(self, slots: Iterable[PolledSlot], oldest_lease_at: float | None,
                bound_s: float) -> list[SlotLeak]:
        """Take one poll of the worker's slots; returns the slots found leaked by it.

        ``oldest_lease_at``: ``granted_at`` (clock seconds) of the oldest live lease on the
        worker now, None when it has none. ``bound_s``: seconds a busy slot may go unclaimed
        (``llama_server.leaked_slot_s``); 0 or less reports nothing but keeps tracking, so a
        caller that must not act now (the worker is draining) can pass 0 and hear of the leak
        later. Each leak is reported once."""
        now = self.clock()
        seen: dict[int, _Busy] = {}
        for s in slots:
            if not s.busy or s.id_task is None:
                continue
            b = self._busy.get(s.id)
            if b is None or b.id_task != s.id_task:
                b = _Busy(s.id_task, now, now)
            seen[s.id] = b
        self._busy = seen
        leaks = []
        for slot, b in seen.items():
            if oldest_lease_at is not None and oldest_lease_at <= b.since:
                b.claimed_at = now
            elif bound_s > 0 and not b.reported and now - b.claimed_at > bound_s:
                b.reported = True
                leaks.append(SlotLeak(slot, b.id_task, now - b.since, now - b.claimed_at))
        return leaks

    def reset(self) -> None:
        """Forget every slot (a new worker process: its task ids start again)."""
        self._busy.clear()
