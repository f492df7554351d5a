"""Supervision of one worker: start, wait for readiness, watch, restart with backoff, stop.

State machine (``WorkerSupervisor.state``)::

    starting ──/health 200──> ready ──exit/crash──> backoff ──delay──> starting
        │                       │ └──liveness lost──> wedged ──SIGTERM, grace, SIGKILL──> backoff
        └─startup timeout──> backoff          draining (set by the gateway: no new requests)
    backoff ──N crashes within a window──> failed ──failed_retry_s──> starting
    any ──stop()──> stopped

Liveness beyond ``/health`` (field case 11: ``/health`` ok, ``/slots`` hangs, SIGTERM
ignored): a ready worker's ``/slots`` is probed every ``liveness_interval_s`` with a
``liveness_timeout_s`` timeout, 2 failures in a row mark it wedged; the gateway's watchdog
reports stalled requests (``note_stall``), and ``wedge_after_stalls`` of them in a row with no
token in between (``note_progress``), or a single one that held the worker's last free slot
(the gateway decides that: ``gateway.fleet.Fleet.note_stall``), make the supervisor check the
worker itself (``workers.stall_check.check_worker``: its main loop answers and its slots are
free or moving, within ``liveness_timeout_s``): a worker that fails is wedged; one that passes
is kept, the stalls are taken as the requests' own (``worker.stall_not_wedged``) and the streak
starts again from 0. The check also sends a one-token completion when a slot is idle, which a
worker that accepts requests and never schedules them does not answer (field case 10). A
request the worker sent nothing within ``first_byte_s`` that another worker then answered
(``note_silent``: evidence against the worker, not the request) makes it suspect: it is
checked at once. Crash loop: ``crash_loop_restarts``
crashes (runs that ended, ``crashes``) within ``crash_loop_window_s``, or as many starts in a row that ended without the
worker getting ready (a worker that hangs while it loads takes ``startup_timeout_s``, 180 s,
per try: no two of its restarts fell within the 120 s window, so it never counted as failing
and its model's requests each waited ``queue.timeout_s``; a fresh tester's find; a spawn that
fails, as of a binary removed meanwhile, is such a start) → ``failed``
for ``failed_retry_s``, then retried (``retry_at`` says when, in ``time.monotonic`` seconds).
``restarts`` counts the processes started after the first: the crash that makes the worker
``failed`` starts none, the try after ``failed_retry_s`` is one. When that try ends (crashes,
wedges or does not get ready) before it has run ``STABLE_AFTER_S``, the worker is ``failed``
again at once, for another ``failed_retry_s``.

The supervisor never routes requests. It reports readiness through two callbacks, and the
gateway's dispatcher only leases slots of ready workers; an optional third one hears every state
change (the gateway refuses requests at once while every worker of a model is ``failed``).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Awaitable, Callable

import aiohttp

from gateway.logs import get_logger
from gateway.worker_http import out_of_descriptors
from workers.process import LaunchSpec, WorkerProcess
from workers.stall_check import check_worker

ReadyCallback = Callable[["WorkerSupervisor"], None]
DownCallback = Callable[["WorkerSupervisor", str], None]
StateCallback = Callable[["WorkerSupervisor"], None]
CheckCallback = Callable[["WorkerSupervisor", bool], None]


#: Seconds a liveness probe may go unanswered before the worker's new work goes to the
#: model's other workers (half of ``liveness_timeout_s`` if that is shorter); ``/slots``
#: answers in milliseconds, or after the batch a busy worker is computing.
LATE_PROBE_S = 1.0


class WorkerSupervisor:
    """Keeps one llama-server worker running.

    Args:
        spec: how to launch it.
        on_ready: called when ``/health`` answers 200 and ``/slots`` was read back.
        on_down: called with a reason when a ready worker stops being usable.
        on_state: called after every change of ``state`` (optional).
        on_check: called with True when a stall check is asked for (``note_stall``) and with
            False when it passed (optional). A failed check ends in ``on_down`` instead, so
            the worker never looks usable in between.
        startup_timeout_s: longest wait for ``/health`` 200 after spawn.
        backoff_initial_s / backoff_max_s: restart delay, doubled after each failed run,
            reset after a run that stayed ready for 60 s.
        stop_grace_s: SIGTERM → SIGKILL delay when stopping.
    """

    STABLE_AFTER_S = 60.0

    def __init__(self, spec: LaunchSpec, *, on_ready: ReadyCallback, on_down: DownCallback,
                 startup_timeout_s: float = 180.0, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, stop_grace_s: float = 10.0,
                 health_interval_s: float = 0.25, state_dir=None,
                 liveness_interval_s: float = 2.0, liveness_timeout_s: float = 5.0,
                 wedge_after_stalls: int = 2, crash_loop_restarts: int = 5,
                 crash_loop_window_s: float = 120.0, failed_retry_s: float = 300.0,
                 on_state: StateCallback | None = None,
                 on_check: CheckCallback | None = None):
        self.spec = spec
        self.on_ready = on_ready
        self.on_down = on_down
        self.on_state = on_state
        self.on_check = on_check
        self.startup_timeout_s = startup_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stop_grace_s = stop_grace_s
        self.health_interval_s = health_interval_s
        self.state_dir = state_dir
        self.liveness_interval_s = liveness_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.wedge_after_stalls = wedge_after_stalls
        self.crash_loop_restarts = crash_loop_restarts
        self.crash_loop_window_s = crash_loop_window_s
        self.failed_retry_s = failed_retry_s
        self._steered = False  # new work steered away while a liveness probe is late
        self.crashes = 0  # runs that ended without stop(): exits, wedges, startup failures
        #: runs of this supervisor that ended without stop() (``crashes`` and ``restarts``
        #: go on across restarts by the fleet, which copies them into the new supervisor)
        self.runs_ended = 0
        self.wedges = 0
        self.crash_loops = 0
        self.slot_leaks = 0  # restarts for a leaked slot (the gateway's: gateway.fleet)
        self.stalls = 0  # stalled requests in a row (watchdog)
        self._silent = False  # a request it never answered was answered elsewhere (note_silent)
        self._restart_times: collections.deque[float] = collections.deque()
        self._failed_starts = 0  # starts in a row that ended without getting ready
        # the try after a crash loop's ``failed_retry_s``: until it has run STABLE_AFTER_S,
        # one more end makes the worker ``failed`` again at once
        self._after_failed = False
        self._stall_check: asyncio.Event = asyncio.Event()  # a stall streak wants a check
        self.state = "stopped"
        self.detail = ""
        self.retry_at: float | None = None  # time.monotonic() of the next start while failed
        self.restarts = 0
        self.process: WorkerProcess | None = None
        self.slots_n_ctx: int | None = None  # per-slot context read back from /slots
        self.ready_since: float | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._ready_evt = asyncio.Event()
        self._stopped_evt = asyncio.Event()
        self._failed_evt = asyncio.Event()  # set while in the crash-loop ``failed`` state
        self.log = get_logger("workers.supervisor", worker=spec.worker_id, gpu=spec.gpu_label)

    @property
    def id(self) -> str:
        return self.spec.worker_id

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        self._stopping = False
        self._stopped_evt.clear()
        self._task = asyncio.create_task(self._run(), name=f"supervise-{self.id}")

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no bound) for ``ready``; True once ready.
        False at the timeout, and at once when the supervisor is (or gets) stopped: a worker
        restarted or removed meanwhile never becomes ready, and its waiter must not hang.
        False at once too when the worker is (or gets) ``failed`` (a crash loop): it is not
        started again for ``failed_retry_s``, so an admin restart or a reload answers then
        rather than at the timeout (a fresh tester's admin restart waited 180 s)."""
        if self._ready_evt.is_set():
            return True
        if self._stopped_evt.is_set() or self._failed_evt.is_set():
            return False
        waits = [asyncio.ensure_future(self._ready_evt.wait()),
                 asyncio.ensure_future(self._stopped_evt.wait()),
                 asyncio.ensure_future(self._failed_evt.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._ready_evt.is_set()

    @property
    def detail_now(self) -> str:
        """``detail`` as of now: a ``failed`` worker's "next try in N s" counts down to its
        ``retry_at`` (it stayed at ``failed_retry_s`` while the 503s counted down; an operator
        tester's find)."""
        if self.state == "failed" and self.retry_at is not None and "; next try in" in self.detail:
            head = self.detail.partition("; next try in")[0]
            return f"{head}; next try in {max(0, math.ceil(self.retry_at - time.monotonic()))} s"
        return self.detail

    def _set_state(self, state: str, detail: str = "", retry_at: float | None = None) -> None:
        """The one writer of ``state``, ``detail`` and ``retry_at`` (``time.monotonic`` seconds
        of the next start; given only with ``failed``, None in every other state); calls
        ``on_state`` when ``state`` changed."""
        changed = state != self.state
        if changed or detail != self.detail:
            self.log.info("worker.state", state=state, detail=detail or None,
                          pid=self.process.pid if self.process else None)
        self.state, self.detail, self.retry_at = state, detail, retry_at
        if changed and self.on_state is not None:
            self.on_state(self)

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        # A fresh connection per probe: this llama-server build drops reused keep-alive
        # connections (field case 27), which must not read as a failed liveness probe.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                         connector=aiohttp.TCPConnector(force_close=True)) as http:
            while not self._stopping:
                proc = WorkerProcess(self.spec, self.state_dir)
                self.process = proc
                self._set_state("starting")
                try:
                    await proc.start()
                except OSError as e:
                    # a start that did not get ready, as one that exits at once: it counts
                    # toward the crash loop (a missing binary kept the worker in backoff
                    # forever, and its requests waited for queue.timeout_s; a fresh tester's find)
                    binary = str(self.spec.binary)
                    reason = f"spawn failed: {binary}: {e.strerror or e}"
                    stable, ran = False, False
                    self._failed_starts += 1
                    self.crashes += 1  # a failed start, as one that exits at once
                    self.log.error("worker.spawn_failed", error=str(e), binary=binary)
                else:
                    ran = True
                    ended = await self._run_process(proc, http)
                    if ended is None:
                        break
                    reason, stable = ended
                    if stable:
                        backoff = self.backoff_initial_s
                if self._stopping:  # stopped meanwhile (an admin restart): no restart follows
                    break
                in_window = self._crash_loop() if ran else False  # a failed spawn is no crash
                # the try after a crash loop failed too: failed again at once, not after a
                # whole new loop of backoffs at their maximum (a fresh tester waited 65 s for
                # a 503 with 3 starts of 3 s; the defaults give 5 × 180 s)
                again, self._after_failed = self._after_failed and not stable, False
                if again or in_window or self._failed_starts >= self.crash_loop_restarts:
                    # no restart now: ``restarts`` counts processes started after the first,
                    # so the try after ``failed_retry_s`` is the next one it counts
                    self.crash_loops += 1
                    n = len(self._restart_times) if in_window else self._failed_starts
                    what = ("the try after the last crash loop ended too" if again else
                            f"{n} crashes within {self.crash_loop_window_s:g} s" if in_window
                            else f"{n} starts in a row did not get ready")
                    self._restart_times.clear()
                    self._failed_starts = 0
                    self._set_state("failed", f"crash loop: {what} (last: {reason}); "
                                              f"next try in {self.failed_retry_s:g} s",
                                    retry_at=time.monotonic() + self.failed_retry_s)
                    self.log.error("worker.crash_loop", crashes=n, last_reason=reason,
                                   retry_in_s=self.failed_retry_s)
                    self._failed_evt.set()
                    await self._sleep(self.failed_retry_s)
                    self._failed_evt.clear()
                    backoff = self.backoff_max_s
                    if not self._stopping:
                        self.restarts += 1
                        self._after_failed = True
                    continue
                self.restarts += 1
                self._set_state("backoff", reason)
                self.log.warning("worker.restart_scheduled", reason=reason, delay_s=backoff,
                                 restarts=self.restarts)
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
        self._set_state("stopped")

    async def _run_process(self, proc: WorkerProcess, http) -> tuple[str, bool] | None:
        """Run the started ``proc`` until it ends: ready, watched, then crashed or wedged; or
        never ready. Returns (why it ended, whether it stayed ready ``STABLE_AFTER_S``), or
        None when the supervisor was stopped meanwhile (no restart follows)."""
        exit_task = asyncio.create_task(proc.wait())
        reason = await self._await_ready(proc, http, exit_task)
        stable = False  # this run stayed ready for STABLE_AFTER_S
        if reason is None:
            self._failed_starts = 0
            self.ready_since = time.monotonic()
            self._set_state("ready")
            self._ready_evt.set()
            self.on_ready(self)
            wedged = await self._watch_ready(proc, http, exit_task)
            self._ready_evt.clear()
            up_s = time.monotonic() - self.ready_since
            self.ready_since = None
            if self._stopping:
                if not exit_task.done():
                    await exit_task
                return None
            if wedged:
                reason = f"wedged: {wedged}"
                self.wedges += 1
                self._set_state("wedged", reason)
                self.log.error("worker.wedged", reason=wedged, pid=proc.pid)
                self.on_down(self, reason)
                await proc.stop(self.stop_grace_s)
                await exit_task
            else:
                reason = f"exited with status {exit_task.result()}"
                self.log.error("worker.crashed", reason=reason, pid=proc.pid, up_s=round(up_s, 3))
                self.on_down(self, reason)
            stable = up_s >= self.STABLE_AFTER_S
        else:
            if not exit_task.done():
                await proc.stop(self.stop_grace_s)
            await exit_task
            if self._stopping:
                return None
            self._failed_starts += 1
        self.crashes += 1
        self.runs_ended += 1
        return reason, stable

    def _crash_loop(self) -> bool:
        """Record a restart now; True when the last ``crash_loop_restarts`` fell in the window."""
        now = time.monotonic()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.crash_loop_window_s:
            self._restart_times.popleft()
        return len(self._restart_times) >= self.crash_loop_restarts

    def note_stall(self, no_free_slot: bool = False) -> None:
        """A request on this worker stalled (watchdog). ``wedge_after_stalls`` in a row, or
        one that held the worker's last free slot (``no_free_slot``, decided by the gateway:
        ``gateway.fleet.Fleet.note_stall``) → the worker is checked (module doc) and
        restarted only if the check fails."""
        self.stalls += 1
        if self.ready and (no_free_slot or self.stalls >= self.wedge_after_stalls):
            self._stall_check.set()
            if self.on_check is not None:
                self.on_check(self, True)

    def note_silent(self) -> None:
        """A request this worker sent nothing within ``first_byte_s`` got its first byte from
        another worker on its retry (``gateway.fleet.Fleet.note_answered_elsewhere``): the
        worker is suspect and is checked at once (with the one-token completion of
        ``workers.stall_check``); new work goes elsewhere meanwhile (``on_check``)."""
        if not self.ready:
            return
        self._silent = True
        self.log.warning("worker.suspect", reason="a request it sent nothing was answered by "
                                                  "another worker")
        self._stall_check.set()
        if self.on_check is not None:
            self.on_check(self, True)

    def note_progress(self) -> None:
        """A request on this worker received data: it is alive."""
        self.stalls = 0

    async def _watch_ready(self, proc: WorkerProcess, http: aiohttp.ClientSession,
                           exit_task: asyncio.Task) -> str | None:
        """Wait while the worker is ready. Returns None when it exited (or stop() was called),
        or why it is considered wedged (liveness probes failed, requests stalled and the
        worker failed its check)."""
        self._stall_check.clear()
        self.stalls = 0
        self._silent = False
        failures = 0
        headers = {"Authorization": f"Bearer {proc.api_key}"}
        check_wait = asyncio.create_task(self._stall_check.wait())
        probe_task: asyncio.Future | None = None
        try:
            while True:
                done, _ = await asyncio.wait({exit_task, check_wait},
                                             timeout=self.liveness_interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if exit_task in done or self._stopping:
                    return None
                if check_wait in done:
                    wedged = await self._check_after_stalls(proc, http, headers, exit_task)
                    if wedged is not None or exit_task.done() or self._stopping:
                        return wedged
                    check_wait = asyncio.create_task(self._stall_check.wait())
                    continue
                # A stall check asked for while a probe waits on a frozen worker starts at once:
                # it waited for the probe's timeout, so the wedge was found up to 2 ×
                # liveness_timeout_s after the stall (9 s in a tester's run, not 5)
                probe_task = asyncio.ensure_future(self._probe_slots(proc, http, headers))
                waiting = {probe_task, check_wait, exit_task}
                done, _ = await asyncio.wait(waiting, timeout=self._late_probe_s(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:  # late: new work goes to the model's other workers meanwhile
                    self._steer_away(True, "liveness probe late")
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if probe_task not in done:
                    probe_task.cancel()
                    await asyncio.gather(probe_task, return_exceptions=True)
                    continue  # the loop's wait returns at once: exit, stop or the check
                probe = probe_task.result()
                if probe is None:
                    failures = 0
                    self._steer_away(False)
                    continue
                if exit_task.done():
                    return None
                failures += 1
                self.log.warning("worker.liveness_failed", error=probe, failures=failures)
                if failures >= 2:
                    return f"/slots {probe} ({failures} times in a row)"
        finally:
            check_wait.cancel()
            if probe_task is not None:
                probe_task.cancel()
            self._steer_away(False)

    def _late_probe_s(self) -> float:
        """Seconds after which an unanswered liveness probe steers new work away (s)."""
        return min(LATE_PROBE_S, self.liveness_timeout_s / 2)

    def _steer_away(self, on: bool, why: str = "") -> None:
        """While a liveness probe is late or has failed, the worker gets new work only when no
        other worker of its model can take it (``on_check``, as during a stall check): a frozen
        worker kept getting requests and side calls until the second failed probe declared it
        wedged, 12 s and more with the default probes (a fresh tester's find). A stall check
        asked for meanwhile keeps the steering until it ends."""
        if on == self._steered or (not on and self._stall_check.is_set()):
            return
        self._steered = on
        if on:
            self.log.warning("worker.liveness_slow", reason=why)
        if self.on_check is not None:
            self.on_check(self, on)

    async def _check_after_stalls(self, proc: WorkerProcess, http: aiohttp.ClientSession,
                                  headers: dict, exit_task: asyncio.Task) -> str | None:
        """A stall streak reached ``wedge_after_stalls``, or a stall left no free slot: check
        the worker (module doc). Returns the wedge reason when it failed; when it passed, logs
        ``worker.stall_not_wedged`` and starts the streak again (stalls noted during the check
        are covered by it)."""
        streak, silent = self.stalls, self._silent
        self._silent = False
        t0 = time.monotonic()
        # the one-token completion on every check with an idle slot, not only for a suspect:
        # when every worker of a model accepted requests and never answered them, none was
        # suspect (no other answered), and none was ever restarted (a fresh tester's find)
        failed = await check_worker(http, proc.url, headers, self.liveness_timeout_s,
                                    completion=True)
        took_ms = round((time.monotonic() - t0) * 1000, 1)
        if exit_task.done() or self._stopping:
            return None
        if failed is not None:
            if silent:
                return (f"a request it sent nothing within the first-byte timeout was answered "
                        f"by another worker, and {failed}")
            if streak < self.wedge_after_stalls:
                return f"a stalled request held its last free slot and {failed}"
            return f"{streak} requests in a row stalled and {failed}"
        self.log.warning("worker.stall_not_wedged", stalls=streak, check_ms=took_ms,
                         suspect=silent,
                         pid=proc.pid)
        self.stalls = 0
        if self._silent:  # note_silent came during this check: check again, with the probe
            return None
        self._stall_check.clear()
        if self.on_check is not None:
            self.on_check(self, False)
        return None

    async def _probe_slots(self, proc: WorkerProcess, http: aiohttp.ClientSession,
                           headers: dict) -> str | None:
        """None when ``/slots`` answered 200 within ``liveness_timeout_s``, else what failed."""
        try:
            async with asyncio.timeout(self.liveness_timeout_s):
                async with http.get(proc.url + "/slots", headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=None)) as r:
                    await r.read()
                    if r.status != 200:
                        return f"answered HTTP {r.status}"
        except TimeoutError:
            return f"did not answer within {self.liveness_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            if out_of_descriptors(e):  # the gateway's own: says nothing about the worker
                self.log.warning("gateway.out_of_descriptors", during="liveness probe",
                                 error=str(e))
                return None
            return f"unreachable: {e}"
        return None

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
                said = proc.first_error or proc.last_plain  # a wrapper's own message, at least
                why = f": {said}" if said else ""
                return f"exited during startup with status {exit_task.result()}{why}"
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
        self._ready_evt.clear()
        self._set_state("stopped")
        self._stopped_evt.set()

    def kill(self) -> None:
        """SIGKILL the current process now (tests, admin restart). Supervision restarts it."""
        if self.process:
            self.process.kill()
