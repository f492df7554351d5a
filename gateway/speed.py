"""Relative decode speed of each worker, measured from llama-server's own counters.

The least-loaded scorer divides a worker's occupancy and prefill backlog by ``WorkerView.speed``
(``gateway.scheduling.scorer.LeastLoaded``), so a faster GPU takes more of the load. This
module measures that speed. It is pure: no I/O and no clock (a measuring window is counted in
the generation seconds the worker reports, not in wall time).

What the counters count (llama.cpp ``0c1e570``, ``tools/server``, the pinned build):

- ``llamacpp:tokens_predicted_total``: the sum over finished sequences of ``n_gen``, the tokens
  each generated, its first token included (``server_metrics::predict.count``);
  ``llamacpp:tokens_predicted_seconds_total``: the sum of their ``t_gen_us()``, the time from a
  sequence's first token to its last (``server-common.h``, ``server_slot_stats``). Both are added
  by ``metrics_on_prediction``, which ``server_slot::release()`` calls through
  ``callback_on_reset`` when a request ends (finished, stopped or cancelled), never while it
  runs (``server-context.cpp``). Both start at 0 with the process.
- ``/metrics`` writes each value as a C++ ``double`` with ``operator<<`` on a stringstream
  (``server-task.cpp``, ``to_metrics``): 6 significant digits, so past 10^6 a counter moves in
  steps of 10 or more (a worker that has generated for 10^6 sequence-seconds shows its
  seconds to the nearest 10).

Per-sequence decode rate (tokens/s of one request while it generates, what its client sees):
Δtokens / Δseconds of the two counters between the start of a window and now, i.e. the rates
of the sequences that ended in the window, weighted by their generation time. A window closes
once it holds at least ``MIN_WINDOW_S`` seconds of generation and ``MIN_WINDOW_TOKENS`` tokens,
and both deltas span at least ``MIN_PRINT_STEPS`` of the last printed digit (so the 6-digit
rounding moves the rate by at most about 2 %); until then the deltas accumulate. The rate is an
EWMA over closed windows, ``ALPHA`` for the newest (the first window is taken as it is).

Known biases of the measurement:

- The per-sequence rate falls as the batch grows: every decode step computes all the sequences
  running on the worker, so a worker that runs more requests at once measures slower per
  sequence (much slower on a CPU, a little on a GPU at small batches, where decoding is bound by
  memory bandwidth). A busier worker therefore looks somewhat slower than it is and gets
  somewhat less work; the effect pushes the load back towards the other workers, never
  further onto the busy one.
- Each sequence's first token is counted without its time (it comes from the prompt batch):
  many very short outputs (``max_tokens`` 1) make a worker look faster.
- With speculative decoding the accepted draft tokens count: the worker measures faster, as it
  is for its clients.

Relative speed (:func:`relative_speeds`): a worker's rate ÷ the lower median of the rates of
its model's workers that have one (with two workers the slower one is the reference, 1.0);
within ±``DEAD_BAND`` of 1 it is exactly 1.0, so identical GPUs keep exactly equal costs and
the scorer's tie-breaks (the rendezvous rank of the prompt head for prefix affinity) still
decide between them; clamped to [``SPEED_MIN``, ``SPEED_MAX``]. A worker without a measurement
(none yet, no such counters in its ``/metrics``) has speed 1.0.

A measurement belongs to one worker process: counters that go down (a new process) start the
worker's measurement over, and the fleet forgets it when the worker goes down or becomes ready
again (:meth:`SpeedBoard.forget`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping

TOKENS = "tokens_predicted_total"
"""``/metrics`` key (``workers.telemetry.parse_metrics``, without ``llamacpp:``): tokens."""
SECONDS = "tokens_predicted_seconds_total"
"""``/metrics`` key: seconds of per-sequence generation time, summed."""

MIN_WINDOW_S = 1.0
"""Generation seconds (summed over sequences) a window needs before it counts."""
MIN_WINDOW_TOKENS = 64
"""Generated tokens a window needs before it counts."""
MIN_PRINT_STEPS = 100
"""A window's deltas must span this many units of the counters' last printed digit."""
ALPHA = 0.1
"""EWMA weight of the newest window."""
DEAD_BAND = 0.2
"""Relative speeds within ±20 % of 1 are exactly 1.0."""
SPEED_MIN, SPEED_MAX = 0.25, 4.0
"""Relative speeds are clamped to this range."""


def print_step(value: float) -> float:
    """The unit of the last digit llama-server prints for a counter ``value`` (6 significant
    digits: ``10 ** (floor(log10(value)) - 5)``); 0.0 for 0 or less."""
    if value <= 0:
        return 0.0
    return 10.0 ** (math.floor(math.log10(value)) - 5)


@dataclass
class DecodeMeter:
    """Per-sequence decode rate of one worker process (module docstring).

    Attributes:
        rate: tokens/s of one sequence while it generates (EWMA over closed windows); None
            until the first window closes.
    """

    min_seconds: float = MIN_WINDOW_S
    min_tokens: float = MIN_WINDOW_TOKENS
    alpha: float = ALPHA
    rate: float | None = None
    _start: tuple[float, float] | None = field(default=None, repr=False)  # (tokens, seconds)

    def update(self, metrics: Mapping[str, float]) -> bool:
        """Read one ``/metrics`` sample (``llamacpp:`` keys stripped, as ``parse_metrics`` gives
        them). A sample without both counters is ignored; counters lower than the window's start
        (a new process) start over with no rate. Returns True when ``rate`` changed."""
        tokens, seconds = metrics.get(TOKENS), metrics.get(SECONDS)
        if tokens is None or seconds is None:
            return False
        if self._start is None:
            self._start = (tokens, seconds)
            return False
        t0, s0 = self._start
        if tokens < t0 or seconds < s0:
            self._start = (tokens, seconds)
            had, self.rate = self.rate, None
            return had is not None
        d_tokens, d_seconds = tokens - t0, seconds - s0
        if (d_seconds < max(self.min_seconds, MIN_PRINT_STEPS * print_step(seconds))
                or d_tokens < max(self.min_tokens, MIN_PRINT_STEPS * print_step(tokens))):
            return False
        rate = d_tokens / d_seconds
        self.rate = rate if self.rate is None else self.alpha * rate + (1 - self.alpha) * self.rate
        self._start = (tokens, seconds)
        return True


def relative_speeds(rates: Mapping[str, float | None], *, dead_band: float = DEAD_BAND,
                    lo: float = SPEED_MIN, hi: float = SPEED_MAX) -> dict[str, float]:
    """Worker id → relative speed, from the per-sequence rates (tokens/s; None = unmeasured) of
    one model's workers: rate ÷ the lower median of the measured rates, exactly 1.0 within
    ±``dead_band`` of 1, clamped to [``lo``, ``hi``]; 1.0 for an unmeasured worker."""
    measured = [r for r in rates.values() if r]
    if not measured:
        return {w: 1.0 for w in rates}
    ref = statistics.median_low(measured)
    out = {}
    for w, r in rates.items():
        s = r / ref if r else 1.0
        out[w] = 1.0 if abs(s - 1.0) <= dead_band else min(hi, max(lo, s))
    return out


class SpeedBoard:
    """The measured speeds of a fleet: one :class:`DecodeMeter` per worker, normalised among
    the workers of the same model (:func:`relative_speeds`)."""

    def __init__(self):
        self._meters: dict[str, DecodeMeter] = {}
        self._model: dict[str, str] = {}

    def observe(self, worker_id: str, model: str, metrics: Mapping[str, float]) -> dict[str, float]:
        """Read a ``/metrics`` sample of ``worker_id`` (serving ``model``). Returns the relative
        speed of every worker of ``model`` when a measurement changed, else ``{}``."""
        self._model[worker_id] = model
        meter = self._meters.setdefault(worker_id, DecodeMeter())
        return self.speeds(model) if meter.update(metrics) else {}

    def forget(self, worker_id: str) -> dict[str, float]:
        """The worker's process stopped or is new: its measurement no longer counts. Returns the
        relative speed of every worker of its model (it at 1.0), ``{}`` for an unknown worker."""
        model = self._model.pop(worker_id, None)
        self._meters.pop(worker_id, None)
        if model is None:
            return {}
        return {**self.speeds(model), worker_id: 1.0}

    def rate(self, worker_id: str) -> float | None:
        """The worker's per-sequence decode rate (tokens/s), None while unmeasured."""
        meter = self._meters.get(worker_id)
        return meter.rate if meter is not None else None

    def all(self) -> dict[str, float]:
        """Relative speed of every worker seen so far, each among its own model's workers."""
        out: dict[str, float] = {}
        for model in set(self._model.values()):
            out.update(self.speeds(model))
        return out

    def speeds(self, model: str) -> dict[str, float]:
        """Relative speed of every worker of ``model`` seen so far."""
        return relative_speeds({w: self._meters[w].rate for w, m in self._model.items()
                                if m == model})
