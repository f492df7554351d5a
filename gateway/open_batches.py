"""Embedding batches that are running, per model, so a reload can let them finish.

An ``/api/embed`` request of many inputs is admitted once, and its later inputs become
follow-on tickets as earlier ones end (``gateway.api.embeddings.embed_many``). A reload that
removes the model retires its workers, after which no ticket of the model is admitted: the
batch was answered 404 ``removed`` halfway, its first inputs computed for nothing (a tester's
find). The reload now waits, up to ``shutdown.drain_s``, for the batches of the models it
removes that were running when it began (``Reloader``), as a drain waits for running requests;
new requests of the model are no longer routed to it meanwhile (the model left the config).
No I/O here: plain events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator


class OpenBatches:
    """The running batches: model full name ("demo:latest") -> one event per batch, set when
    it ends (answered, failed or cancelled)."""

    def __init__(self) -> None:
        self._open: dict[str, set[asyncio.Event]] = {}

    @contextlib.contextmanager
    def running(self, model: str) -> Iterator[None]:
        """Count one batch of ``model`` as running for the ``with`` block."""
        done = asyncio.Event()
        self._open.setdefault(model, set()).add(done)
        try:
            yield
        finally:
            done.set()
            batches = self._open.get(model)
            if batches is not None:
                batches.discard(done)
                if not batches:
                    del self._open[model]

    def count(self, models: Iterable[str]) -> int:
        """Batches of ``models`` running now."""
        return sum(len(self._open.get(m, ())) for m in models)

    async def wait(self, models: Iterable[str], timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for the batches of ``models`` running now to end
        (batches begun later are not waited for). Returns how many were still running at the
        timeout (0: all ended)."""
        ends = [e for m in models for e in self._open.get(m, ())]
        if not ends:
            return 0
        waits = [asyncio.ensure_future(e.wait()) for e in ends]
        try:
            await asyncio.wait(waits, timeout=timeout_s)
        finally:
            for w in waits:
                w.cancel()
        return sum(not e.is_set() for e in ends)
