"""Per-worker live numbers polled from each ready llama-server on a timer (never per request).

Every ``interval_s`` (2 s) for each ready worker:

* ``GET /slots`` (llama-server tools/server server-context.cpp ``server_slot::to_json``):
  KV fill = Σ over processing slots of (``n_prompt_tokens`` + ``next_token[0].n_decoded``)
  ÷ (``n_ctx`` × slots), a 0..1 ratio;
* ``GET /metrics`` (server-task.cpp ``to_metrics``, needs ``--metrics``, which the gateway
  passes): ``llamacpp:requests_deferred`` (gauge) and ``llamacpp:tokens_predicted_total``
  (counter), whose increase between two polls ÷ seconds gives tokens/s.

A failed poll leaves the worker's numbers as ``None`` ("unknown"), never raises.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.logs import get_logger

log = get_logger("gateway.worker_stats")


@dataclass
class WorkerStats:
    """Last sample of one worker. ``None`` = unknown. Units: ratio 0..1, requests, tokens/s."""

    kv_fill: float | None = None
    deferred: int | None = None
    tokens_per_s: float | None = None
    tokens_predicted_total: float | None = None
    sampled_at: float | None = None  # time.monotonic() seconds


def kv_fill_from_slots(slots: list[dict]) -> float | None:
    """KV fill ratio (0..1) from a ``/slots`` answer; None if it has no ``n_ctx``."""
    total = sum(int(s.get("n_ctx") or 0) for s in slots)
    if not total:
        return None
    used = 0
    for s in slots:
        if s.get("is_processing"):
            nt = (s.get("next_token") or [{}])[0]
            used += int(s.get("n_prompt_tokens") or 0) + int(nt.get("n_decoded") or 0)
    return min(1.0, used / total)


def parse_worker_metrics(text: str) -> dict[str, float]:
    """llama-server's Prometheus text → {sample name: value} (``llamacpp:`` prefix kept)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


class WorkerStatsPoller:
    """Polls ready workers. ``endpoints()`` returns {worker_id: Endpoint} of ready workers."""

    def __init__(self, endpoints: Callable[[], dict], interval_s: float = 2.0):
        self.endpoints = endpoints
        self.interval_s = interval_s
        self.stats: dict[str, WorkerStats] = {}
        self._task: asyncio.Task | None = None

    def get(self, worker_id: str) -> WorkerStats:
        return self.stats.get(worker_id) or WorkerStats()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="worker-stats")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=min(2.0, self.interval_s))
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(force_close=True)) as http:
            while True:
                eps = self.endpoints()
                for gone in set(self.stats) - set(eps):
                    self.stats.pop(gone, None)
                await asyncio.gather(*(self._poll(http, wid, ep) for wid, ep in eps.items()))
                await asyncio.sleep(self.interval_s)

    async def _poll(self, http: aiohttp.ClientSession, wid: str, ep) -> None:
        headers = {"Authorization": f"Bearer {ep.api_key}"}
        prev = self.stats.get(wid) or WorkerStats()
        cur = WorkerStats(sampled_at=time.monotonic())
        try:
            async with http.get(ep.url + "/slots", headers=headers) as r:
                if r.status == 200:
                    cur.kv_fill = kv_fill_from_slots(await r.json(content_type=None))
            async with http.get(ep.url + "/metrics", headers=headers) as r:
                if r.status == 200:
                    m = parse_worker_metrics(await r.text())
                    if "llamacpp:requests_deferred" in m:
                        cur.deferred = int(m["llamacpp:requests_deferred"])
                    cur.tokens_predicted_total = m.get("llamacpp:tokens_predicted_total")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            log.debug("worker_stats.poll_failed", worker=wid, error=str(e))
        if (cur.tokens_predicted_total is not None and prev.tokens_predicted_total is not None
                and prev.sampled_at and cur.tokens_predicted_total >= prev.tokens_predicted_total):
            dt = cur.sampled_at - prev.sampled_at
            if dt > 0:
                cur.tokens_per_s = (cur.tokens_predicted_total - prev.tokens_predicted_total) / dt
        self.stats[wid] = cur
