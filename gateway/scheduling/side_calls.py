"""Which worker a side call goes to (pure: no I/O, time passed in).

Side calls (llama-server ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props``) take no
slot, but they must go only where the dispatcher would send a request: workers that are ready
and not draining, retiring or crash-loop ``failed`` (``WorkerView.in_rotation``; a worker that a
restart or reload is stopping is draining first). Among those, :class:`SideCallRouter` orders the
candidates of one call:

1. workers this call has not tried yet before ones it tried (fewest tries first), so a retry
   after a transport error or timeout goes to another worker when there is one;
2. workers whose side call failed in the last ``suspect_s`` seconds after the others (a worker
   frozen by SIGSTOP accepts connections but never answers; until liveness takes it out of
   rotation, later calls should not each wait out a timeout on it);
3. the ``prefer``-red worker (the one that serves or served the request: its answer then comes
   from the same process as the generation) before the rest;
4. the rest in rotation (round robin over the fleet order), to spread the load.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from gateway.scheduling.worker_view import WorkerView


class SideCallRouter:
    """Orders fit workers for side calls and remembers recent failures.

    Args:
        suspect_s: seconds a worker whose side call failed (transport error or timeout) is tried
            after the others.
    """

    def __init__(self, suspect_s: float = 30.0):
        self.suspect_s = suspect_s
        self._turn = 0
        self._failed_at: dict[str, float] = {}

    def order(self, fit: Iterable[WorkerView], now: float, *, prefer: str | None = None,
              tried: Mapping[str, int] | None = None) -> list[WorkerView]:
        """``fit`` (workers in rotation for the model) in the order to try them (see module doc).
        ``now``: clock seconds; ``tried``: worker id -> attempts this call already made there.
        Each call advances the rotation by one."""
        ws = sorted(fit, key=lambda w: w.order)
        if not ws:
            return []
        turn = self._turn % len(ws)
        self._turn += 1
        rotated = ws[turn:] + ws[:turn]
        tried = tried or {}
        return sorted(rotated, key=lambda w: (tried.get(w.id, 0), self.suspect(w.id, now),
                                              w.id != prefer))

    def suspect(self, worker_id: str, now: float) -> bool:
        """Whether a side call to ``worker_id`` failed within the last ``suspect_s`` seconds."""
        at = self._failed_at.get(worker_id)
        return at is not None and now - at < self.suspect_s

    def failed(self, worker_id: str, now: float) -> None:
        """A side call to ``worker_id`` got a transport error or timed out at clock ``now``."""
        self._failed_at[worker_id] = now

    def answered(self, worker_id: str) -> None:
        """``worker_id`` answered a side call: it is no longer suspect."""
        self._failed_at.pop(worker_id, None)
