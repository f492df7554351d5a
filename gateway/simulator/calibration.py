"""Fit a simulator worker profile (``GpuProfile``) to measurements of a real llama-server.

The model being fitted is the one in ``gateway/simulator/worker.py``; the step time
(seconds) of one ``llama_decode`` with ``b`` decoding sequences that hold ``kv`` KV tokens in
total is::

    decode_s1 * (1 + batch_slope * (b - 1)) + kv * attn_s_per_token

Inputs come from llama-server's own ``timings`` object (see
``shared/reference/llama-server.md``): ``predicted_per_token_ms`` is the decode step time
seen by one stream, ``prompt_n`` / ``prompt_ms`` the prefill rate. ``gateway.simulator.measure``
takes them; this module only does the arithmetic, so it is tested without a server.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from gateway.simulator.worker import GpuProfile


@dataclass(frozen=True)
class DecodePoint:
    """One decode measurement: ``streams`` concurrent requests, each with a prompt of
    ``prompt_tokens`` and ``predicted`` generated tokens; ``step_s`` seconds per step."""

    streams: int
    prompt_tokens: int
    predicted: int
    step_s: float

    @property
    def kv_tokens(self) -> float:
        """Mean KV tokens held by all streams over the decode window (each stream goes from
        ``prompt_tokens`` to ``prompt_tokens + predicted``)."""
        return self.streams * (self.prompt_tokens + self.predicted / 2)


@dataclass(frozen=True)
class PrefillPoint:
    """One prefill measurement: ``prompt_tokens`` processed in ``seconds``."""

    prompt_tokens: int
    seconds: float


def fit_prefill(points: list[PrefillPoint]) -> float:
    """Prefill tokens/s over the measured prompt lengths: all tokens / all seconds (the
    simulator charges ``prefill_tokens / prefill_tps`` per step, whatever the length)."""
    if not points:
        raise ValueError("no prefill measurement")
    secs = sum(p.seconds for p in points)
    if secs <= 0:
        raise ValueError("prefill measurements add up to no time")
    return sum(p.prompt_tokens for p in points) / secs


def fit_decode(points: list[DecodePoint]) -> tuple[float, float, float]:
    """Least-squares fit of ``step_s = a + c*(b-1) + k*kv`` to the points.

    Returns ``(decode_s1, batch_slope, attn_s_per_token)`` = ``(a, c/a, k)``. A negative
    ``c`` or ``k`` (noise when the true cost is about zero) is set to 0 and the rest refitted.

    Raises:
        ValueError: fewer than 3 points, or points that do not vary both the batch size and
            the KV held (the three terms could not be told apart).
    """
    if len(points) < 3:
        raise ValueError(f"need at least 3 decode points, got {len(points)}")
    y = np.array([p.step_s for p in points], dtype=float)
    cols = {"batch": np.array([p.streams - 1 for p in points], dtype=float),
            "kv": np.array([p.kv_tokens for p in points], dtype=float)}
    if len(set(cols["batch"])) < 2:
        raise ValueError("decode points must include at least two batch sizes")
    if len(set(cols["kv"] / np.maximum(1.0, cols["batch"] + 1))) < 2:
        raise ValueError("decode points must include at least two contexts per stream")
    used = ["batch", "kv"]
    while True:
        x = np.column_stack([np.ones(len(points))] + [cols[c] for c in used])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        fitted = dict(zip(used, coef[1:]))
        neg = [c for c in used if fitted[c] < 0]
        if not neg:
            break
        used.remove(min(neg, key=lambda c: fitted[c]))
    a = float(coef[0])
    if a <= 0:
        raise ValueError(f"fitted single-sequence step time is not positive ({a:.3g} s)")
    return a, float(fitted.get("batch", 0.0)) / a, float(fitted.get("kv", 0.0))


def step_s(profile: GpuProfile, streams: int, kv_tokens: float) -> float:
    """The model's decode step time (s) for ``streams`` sequences holding ``kv_tokens``."""
    return profile.decode_s1 * (1 + profile.batch_slope * max(0, streams - 1)) \
        + kv_tokens * profile.attn_s_per_token


def fit_profile(name: str, prefill: list[PrefillPoint], decode: list[DecodePoint],
                source: str) -> GpuProfile:
    """A ``GpuProfile`` from the fits above."""
    s1, slope, attn = fit_decode(decode)
    return GpuProfile(name, fit_prefill(prefill), s1, batch_slope=slope,
                      attn_s_per_token=attn, source=source)


def profile_dict(profile: GpuProfile) -> dict:
    """The ``profile`` object of a calibration JSON file (read back by
    ``GpuProfile.from_json``)."""
    return dataclasses.asdict(profile)
