"""Per-worker telemetry: poll llama-server ``/slots`` and ``/metrics`` on a timer, read NVML.

Parsing is pure (``parse_slots``, ``parse_metrics``, ``Progress``) and accepts the shapes of
several llama-server versions:

- ``/slots``: a list of slot objects. Busy is ``is_processing`` (current builds) or an integer
  ``state`` != 0 (older builds: 0 idle, 1 processing); a slot with neither counts idle.
  Per-slot context is ``n_ctx``. KV tokens held by a busy slot are
  ``max(n_prompt_tokens, n_prompt_tokens_processed + n_prompt_tokens_cache + n_decoded)``:
  this build (0c1e570) counts generated tokens into ``n_prompt_tokens`` while a slot runs
  (checked: prompt 5 tokens, 766 decoded → ``n_prompt_tokens`` 771), older builds did not.
  ``n_decoded`` is ``next_token[0].n_decoded`` (list, current) or ``next_token.n_decoded``
  (object, older). Missing fields count 0. ``id_task`` is the id of the slot's current task,
  or of its previous one while it is idle (``server-context.cpp`` ``to_json``: ``task`` else
  ``task_prev``); absent before a slot's first task and in builds without it (then None).
- ``/metrics`` (Prometheus text, needs ``--metrics``): ``llamacpp:*`` samples; the ones used
  are ``requests_deferred``, ``requests_processing``, ``tokens_predicted_total``,
  ``prompt_tokens_total`` and ``prompt_tokens_cached_total``. Missing ones are absent.

The poller never raises: a failed or slow poll (timeout) is logged once per failure streak and
the last good sample stays in place. It never calls the scheduler directly; the fleet passes
the sample on (``on_sample``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.logs import get_logger
from gateway.scheduling.worker_view import WorkerLoad

log = get_logger("workers.telemetry")


@dataclass(frozen=True)
class SlotState:
    """One slot as read from ``/slots``. Units: tokens; ``id_task``: llama-server's task id
    (None when the body has no integer ``id_task``)."""

    id: int
    n_ctx: int
    busy: bool
    kv_tokens: int
    n_decoded: int
    n_cached: int
    id_task: int | None = None


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def parse_slot(obj: dict) -> SlotState:
    """One ``/slots`` entry → SlotState (both ``is_processing`` and ``state`` shapes)."""
    if "is_processing" in obj:
        busy = bool(obj.get("is_processing"))
    else:
        busy = _int(obj.get("state")) != 0
    nt = obj.get("next_token")
    if isinstance(nt, list):
        nt = nt[0] if nt and isinstance(nt[0], dict) else {}
    n_decoded = _int(nt.get("n_decoded")) if isinstance(nt, dict) else 0
    cached = _int(obj.get("n_prompt_tokens_cache"))
    kv = 0
    if busy:
        kv = max(_int(obj.get("n_prompt_tokens")),
                 _int(obj.get("n_prompt_tokens_processed")) + cached + n_decoded)
    task = obj.get("id_task")
    return SlotState(id=_int(obj.get("id")), n_ctx=_int(obj.get("n_ctx")), busy=busy,
                     kv_tokens=kv, n_decoded=n_decoded if busy else 0, n_cached=cached,
                     id_task=task if isinstance(task, int) and not isinstance(task, bool)
                     else None)


def parse_slots(data: Any) -> list[SlotState]:
    """The ``/slots`` body (parsed JSON) → slots; anything that is not a list gives ``[]``."""
    if not isinstance(data, list):
        return []
    return [parse_slot(o) for o in data if isinstance(o, dict)]


def parse_metrics(text: str) -> dict[str, float]:
    """``llamacpp:*`` samples of a ``/metrics`` body, keyed without the prefix
    (``requests_deferred`` → 0.0). Unparseable text gives ``{}``."""
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("llamacpp:"):
                    out[s.name[len("llamacpp:"):]] = float(s.value)
    except Exception:
        return out
    return out


@dataclass
class Progress:
    """Generation progress between polls → recent throughput (tokens/s).

    Progress = ``tokens_predicted_total`` (updated by llama-server when a request ends) + the
    ``n_decoded`` of the slots still running, so a long request counts while it runs.
    """

    last_tokens: float | None = None
    last_at: float = 0.0
    tps: float = 0.0
    alpha: float = 0.5  # EWMA weight of the newest interval

    def update(self, at: float, tokens: float) -> float:
        if self.last_tokens is not None and at > self.last_at:
            rate = max(0.0, tokens - self.last_tokens) / (at - self.last_at)
            self.tps = rate if self.tps == 0 else self.alpha * rate + (1 - self.alpha) * self.tps
        self.last_tokens, self.last_at = tokens, at
        return self.tps


@dataclass
class Sample:
    """One poll of one worker: parsed slots, metrics, and the derived WorkerLoad."""

    at: float
    slots: list[SlotState]
    metrics: dict[str, float]
    load: WorkerLoad
    gpus: dict[int, Any] = field(default_factory=dict)


def build_load(at: float, slots: list[SlotState], metrics: dict[str, float],
               progress: Progress, fresh_metrics: bool = True) -> WorkerLoad:
    """Derive the scheduler's WorkerLoad from one poll (pure).

    ``fresh_metrics``: whether ``metrics`` were read in this poll. Throughput (``decode_tps``)
    moves only on polls that read them: on the others ``metrics`` are the last poll's, and a
    request that ended since then has left the slots' ``n_decoded`` without being in the old
    ``tokens_predicted_total`` yet, so progress would fall and then jump (a fresh tester saw
    readings 1.9× the worker's possible rate, in a 4-poll cycle)."""
    decoded_now = sum(s.n_decoded for s in slots)
    tps = (progress.update(at, metrics.get("tokens_predicted_total", 0.0) + decoded_now)
           if fresh_metrics else progress.tps)
    return WorkerLoad(at=at, processing=sum(1 for s in slots if s.busy),
                      kv_tokens=sum(s.kv_tokens for s in slots),
                      deferred=int(metrics.get("requests_deferred", 0)), decode_tps=tps,
                      n_ctx=max((s.n_ctx for s in slots), default=0))


class WorkerPoller:
    """Polls one worker every ``interval_s`` until stopped.

    Args:
        worker_id: for logs.
        endpoint: callable returning the worker's ``Endpoint`` (url, api_key) or None when it
            is not ready (then the poll is skipped).
        on_sample: called with each Sample (in the event loop).
        interval_s: seconds between polls (default 0.25).
        timeout_s: per-request timeout (seconds) for ``/slots`` and ``/metrics``.
        gpus: GPU indices of this worker (NVML stats attached when available).
        read_gpus: callable returning ``{index: GpuStats}`` (``workers.gpu.read_gpu_stats``).
        metrics_every: ``/metrics`` is read on every n-th poll only (its counters move slowly
            and parsing the Prometheus text is the poll's main CPU cost); ``/slots`` every poll.
    """

    def __init__(self, worker_id: str, endpoint: Callable[[], Any],
                 on_sample: Callable[[Sample], None], *, interval_s: float = 0.25,
                 timeout_s: float = 1.0, gpus: tuple[int, ...] = (),
                 read_gpus: Callable[[], dict] | None = None, metrics_every: int = 4):
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.on_sample = on_sample
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.gpus = gpus
        self.read_gpus = read_gpus
        self.progress = Progress()
        self.last: Sample | None = None
        self.failures = 0
        self.metrics_every = max(1, metrics_every)
        self._polls = 0
        self._task: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._loop(session), name=f"poll-{self.worker_id}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def poll_once(self, session: aiohttp.ClientSession) -> Sample | None:
        """One poll; None when the worker is not ready or the poll failed. A worker that is
        not ready has no last sample either: a failed (crash-looping) worker kept showing its
        last tokens/s and KV fill in ``status``, the admin API and ``/metrics`` (a fresh
        tester's find: 2,298 tokens/s for a worker with no process)."""
        ep = self.endpoint()
        if ep is None:
            self.progress = Progress()
            self.last = None
            return None
        headers = {"Authorization": f"Bearer {ep.api_key}"}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        # The sample is stamped when the poll is sent, not when its answer arrives: the worker
        # may have read its slots at any moment in between, so a lease released after the send
        # may still show busy in it, and the scheduler leaves out such a poll's busy slots and
        # KV fill for leases released after ``at`` (``WorkerView.phantom`` / ``kv_used``). A
        # fresh tester got 503s with a slot free when the stamp came after the answer.
        at = time.monotonic()
        try:
            async with session.get(ep.url + "/slots", headers=headers, timeout=timeout) as r:
                slots = parse_slots(await r.json(content_type=None)) if r.status == 200 else []
            fresh = self.last is None or self._polls % self.metrics_every == 0
            if fresh:
                async with session.get(ep.url + "/metrics", headers=headers, timeout=timeout) as r:
                    metrics = parse_metrics(await r.text()) if r.status == 200 else {}
            else:
                metrics = self.last.metrics
            self._polls += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            self.failures += 1
            if self.failures == 1:
                log.warning("telemetry.poll_failed", worker=self.worker_id,
                            error=str(e) or type(e).__name__)
            return None
        if self.failures:
            log.info("telemetry.poll_recovered", worker=self.worker_id, failures=self.failures)
            self.failures = 0
        gpus = {}
        if self.gpus and self.read_gpus is not None:
            stats = await asyncio.to_thread(self.read_gpus)
            gpus = {i: stats[i] for i in self.gpus if i in stats}
        sample = Sample(at, slots, metrics,
                        build_load(at, slots, metrics, self.progress, fresh), gpus)
        self.last = sample
        return sample

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            sample = await self.poll_once(session)
            if sample is not None:
                try:
                    self.on_sample(sample)
                except Exception:
                    log.exception("telemetry.sample_handler_failed", worker=self.worker_id)
            await asyncio.sleep(self.interval_s)
