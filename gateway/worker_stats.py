"""Per-worker live numbers for ``status``, ``/metrics`` and the status page.

They are read from the scheduler's telemetry (``workers/telemetry.py`` ``WorkerPoller.last``),
so each worker is polled once, by one poller, never per request:

* KV fill (0..1) = Σ KV tokens of the busy slots ÷ Σ ``n_ctx`` of all slots (``/slots``);
* deferred requests = ``llamacpp:requests_deferred`` (``/metrics``);
* tokens/s = the poller's recent decode throughput (``tokens_predicted_total`` plus the
  ``n_decoded`` of running slots, over time).

``None`` means unknown (no sample yet, or the worker is not ready).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from workers.telemetry import Sample


@dataclass
class WorkerStats:
    """Last sample of one worker. ``None`` = unknown. Units: ratio 0..1, requests, tokens/s."""

    kv_fill: float | None = None
    deferred: int | None = None
    tokens_per_s: float | None = None
    sampled_at: float | None = None  # time.monotonic() seconds


def stats_from_sample(sample: Sample | None) -> WorkerStats:
    if sample is None:
        return WorkerStats()
    n_ctx = sum(s.n_ctx for s in sample.slots)
    return WorkerStats(
        kv_fill=min(1.0, sample.load.kv_tokens / n_ctx) if n_ctx else None,
        deferred=sample.load.deferred if "requests_deferred" in sample.metrics else None,
        tokens_per_s=sample.load.decode_tps, sampled_at=sample.at)


class WorkerStatsView:
    """``get(worker_id)`` → WorkerStats from that worker's telemetry poller.

    Args:
        last_sample: worker id → its poller's last Sample, or None.
    """

    def __init__(self, last_sample: Callable[[str], Sample | None]):
        self.last_sample = last_sample

    def get(self, worker_id: str) -> WorkerStats:
        return stats_from_sample(self.last_sample(worker_id))
