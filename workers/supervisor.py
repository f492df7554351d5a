"""Supervision of one worker: start, wait for readiness, watch, restart with backoff, stop.

State machine (``WorkerSupervisor.state``)::

    starting ──/health 200──> ready ──exit/crash──> backoff ──delay──> starting
        │                       │
        └─startup timeout──> backoff          draining (set by the gateway: no new requests)
    any ──stop()──> stopped

The supervisor never routes requests. It reports readiness through two callbacks, and the
gateway's dispatcher only leases slots of ready workers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import aiohttp

from gateway.logs import get_logger
from workers.process import LaunchSpec, WorkerProcess

ReadyCallback = Callable[["WorkerSupervisor"], None]
DownCallback = Callable[["WorkerSupervisor", str], None]


class WorkerSupervisor:
    """Keeps one llama-server worker running.

    Args:
        spec: how to launch it.
        on_ready: called when ``/health`` answers 200 and ``/slots`` was read back.
        on_down: called with a reason when a ready worker stops being usable.
        startup_timeout_s: longest wait for ``/health`` 200 after spawn.
        backoff_initial_s / backoff_max_s: restart delay, doubled after each failed run,
            reset after a run that stayed ready for 60 s.
        stop_grace_s: SIGTERM → SIGKILL delay when stopping.
    """

    STABLE_AFTER_S = 60.0

    def __init__(self, spec: LaunchSpec, *, on_ready: ReadyCallback, on_down: DownCallback,
                 startup_timeout_s: float = 180.0, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, stop_grace_s: float = 10.0,
                 health_interval_s: float = 0.25, state_dir=None):
        self.spec = spec
        self.on_ready = on_ready
        self.on_down = on_down
        self.startup_timeout_s = startup_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stop_grace_s = stop_grace_s
        self.health_interval_s = health_interval_s
        self.state_dir = state_dir
        self.state = "stopped"
        self.detail = ""
        self.restarts = 0
        self.process: WorkerProcess | None = None
        self.slots_n_ctx: int | None = None  # per-slot context read back from /slots
        self.ready_since: float | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._ready_evt = asyncio.Event()
        gpu = ",".join(map(str, spec.gpus)) or "cpu"
        self.log = get_logger("workers.supervisor", worker=spec.worker_id, gpu=gpu)

    @property
    def id(self) -> str:
        return self.spec.worker_id

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"supervise-{self.id}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready_evt.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _set_state(self, state: str, detail: str = "") -> None:
        if state != self.state or detail != self.detail:
            self.log.info("worker.state", state=state, detail=detail or None,
                          pid=self.process.pid if self.process else None)
        self.state, self.detail = state, detail

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while not self._stopping:
                proc = WorkerProcess(self.spec, self.state_dir)
                self.process = proc
                self._set_state("starting")
                try:
                    await proc.start()
                except OSError as e:
                    self._set_state("backoff", f"spawn failed: {e}")
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, self.backoff_max_s)
                    continue
                exit_task = asyncio.create_task(proc.wait())
                reason = await self._await_ready(proc, http, exit_task)
                if reason is None:
                    self.ready_since = time.monotonic()
                    self._set_state("ready")
                    self._ready_evt.set()
                    self.on_ready(self)
                    rc = await exit_task
                    self._ready_evt.clear()
                    up_s = time.monotonic() - self.ready_since
                    self.ready_since = None
                    if self._stopping:
                        break
                    reason = f"exited with status {rc}"
                    self.on_down(self, reason)
                    if up_s >= self.STABLE_AFTER_S:
                        backoff = self.backoff_initial_s
                else:
                    if not exit_task.done():
                        await proc.stop(self.stop_grace_s)
                    await exit_task
                    if self._stopping:
                        break
                self.restarts += 1
                self._set_state("backoff", reason)
                self.log.warning("worker.restart_scheduled", reason=reason, delay_s=backoff,
                                 restarts=self.restarts)
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
        self._set_state("stopped")

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < end:
            await asyncio.sleep(min(0.1, end - time.monotonic()))

    async def _await_ready(self, proc: WorkerProcess, http: aiohttp.ClientSession,
                           exit_task: asyncio.Task) -> str | None:
        """None when ready; otherwise why not (exit, startup timeout, bad /slots)."""
        deadline = time.monotonic() + self.startup_timeout_s
        headers = {"Authorization": f"Bearer {proc.api_key}"}
        while True:
            if self._stopping:
                return "stopping"
            if exit_task.done():
                return f"exited during startup with status {exit_task.result()}"
            if time.monotonic() > deadline:
                return f"startup timeout after {self.startup_timeout_s:g} s"
            try:
                async with http.get(proc.url + "/health") as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(self.health_interval_s)
        try:
            async with http.get(proc.url + "/slots", headers=headers) as r:
                slots = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return f"/slots unreadable: {e}"
        if not isinstance(slots, list) or not slots:
            return f"/slots unexpected: {str(slots)[:200]}"
        n_ctx = slots[0].get("n_ctx")
        self.slots_n_ctx = n_ctx
        if len(slots) != self.spec.slots:
            self.log.warning("worker.slots_mismatch", configured=self.spec.slots, actual=len(slots))
        if n_ctx is not None and n_ctx != self.spec.context_per_slot:
            self.log.warning("worker.context_mismatch", configured=self.spec.context_per_slot,
                             actual=n_ctx)
        self.actual_slots = len(slots)
        return None

    async def stop(self) -> None:
        """Stop supervising and stop the process (SIGTERM, grace, SIGKILL); wait until reaped."""
        self._stopping = True
        if self.process is not None and self.process.returncode is None:
            await self.process.stop(self.stop_grace_s)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, self.stop_grace_s + 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        self._set_state("stopped")

    def kill(self) -> None:
        """SIGKILL the current process now (tests, admin restart). Supervision restarts it."""
        if self.process:
            self.process.kill()
