"""The fleet: one WorkerSupervisor per WorkerPlan, wired into admission, plus telemetry.

Readiness flows one way: supervisor → ``Admission.worker_ready`` → dispatcher. The scheduler
never calls a worker; the upstream client asks ``endpoint_of`` for a ready worker's address.
Telemetry flows the same way: one ``WorkerPoller`` per worker (``/slots``, ``/metrics``, NVML
every ``scheduler.poll_interval_s``) → ``Admission.worker_load`` → dispatcher scores; the
``/metrics`` generation counters → ``SpeedBoard`` (``gateway.speed``) → ``Dispatcher.set_speed``;
the polled slots → ``SlotLeakWatch`` (``gateway.scheduling.slot_leaks``) → a worker with a
leaked slot is restarted (:meth:`Fleet.restart_worker`).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from gateway.admission import Admission
from gateway.config import GatewayConfig, WorkerPlan, fingerprint
from gateway.logs import get_logger
from gateway.prompt_cache import kv_bytes_from_gguf, worker_cache_tokens
from gateway.scheduling import make_scorer
from gateway.scheduling.scorer import keep_prefix_index
from gateway.scheduling.slot_leaks import SlotLeak, SlotLeakWatch
from gateway.slot_plan import launch_slots
from gateway.sizing import Ratios, SizeEstimate, dense_bytes, estimate_with, wide_bytes
from gateway.speed import SpeedBoard
from gateway.upstream import Endpoint
from workers.gpu import read_gpu_stats
from workers.process import QUIET_LOG_VERBOSITY, LaunchSpec, remove_state_dir
from workers.supervisor import WorkerSupervisor
from workers.telemetry import Sample, WorkerPoller

if TYPE_CHECKING:
    from gateway.inventory import GGUFFacts, ModelEntry

log = get_logger("gateway.fleet")

# Sample text for measuring a tokenizer's bytes per token (/tokenize on a ready worker):
# ordinary English prose, the common case for chat prompts.
_TOKENIZE_SAMPLE = ("You are a helpful assistant. Answer the user's questions clearly and "
                    "concisely, and explain your reasoning step by step when it helps. ") * 4
# Samples of non-ASCII text (the same request in Chinese, Japanese, Korean and Russian); the
# fewest bytes per token among them is the model's ratio for non-ASCII bytes (gateway.sizing).
_WIDE_SAMPLES = (
    "你是一个乐于助人的助手。请清楚而简洁地回答用户的问题，并在有帮助时逐步解释你的推理。",
    "あなたは親切なアシスタントです。ユーザーの質問に明確かつ簡潔に答え、役立つときは推論を"
    "順を追って説明してください。",
    "당신은 도움이 되는 조수입니다. 사용자의 질문에 명확하고 간결하게 답하고, 도움이 될 때는 "
    "추론을 단계별로 설명하십시오.",
    "Вы полезный помощник. Отвечайте на вопросы пользователя ясно и кратко и объясняйте ход "
    "рассуждений шаг за шагом, когда это помогает.",
)
# Sample of ASCII digits and punctuation (numbers, a date, an address, code symbols): text
# of them tokenizes at about a byte a token, half the prose ratio or less (gateway.sizing).
_DENSE_SAMPLE = ('3.14159265358979 2.718281828 1,048,576 -42 +7.5e-3 0x7fff 192.168.0.1 '
                 '2026-12-01T11:28:39Z {"a": [1, 2, 3], "b": {}}; (x[0] + y[1]) * 2 >= 0 && '
                 'i++ != j-- || !k; #!/@$%^&~`|\\<>?:=_') * 2


def _model_args(mcfg) -> list[str]:
    """A model's extra llama-server args. The built-in demo GGUF declares no pooling type, and
    llama-server refuses OpenAI-style embeddings with pooling "none", so an embedding demo model
    gets ``--pooling mean`` unless the config names a pooling itself."""
    args = list(mcfg.args)
    if mcfg.is_builtin and mcfg.embeddings and "--pooling" not in args:
        args += ["--pooling", "mean"]
    return args


def supervision(ls) -> dict:
    """The ``llama_server`` settings (an LlamaServerConfig) a WorkerSupervisor takes, as its
    keyword arguments (seconds, counts). The supervisor reads each one when it next needs it."""
    return dict(startup_timeout_s=ls.startup_timeout_s,
                backoff_initial_s=ls.restart_backoff_initial_s,
                backoff_max_s=ls.restart_backoff_max_s,
                stop_grace_s=ls.stop_grace_s,
                health_interval_s=ls.health_interval_s,
                liveness_interval_s=ls.liveness_interval_s,
                liveness_timeout_s=ls.liveness_timeout_s,
                wedge_after_stalls=ls.wedge_after_stalls,
                crash_loop_restarts=ls.crash_loop_restarts,
                crash_loop_window_s=ls.crash_loop_window_s,
                failed_retry_s=ls.failed_retry_s)


class Fleet:
    """Builds, starts and stops the workers of a config; polls their load.

    Args:
        models: (full model name -> GGUF path, inventory entries), as
            ``Gateway.load_models`` returns them (:meth:`add_models`).
    """

    def __init__(self, config: GatewayConfig, binary: Path,
                 models: tuple[dict[str, Path], list["ModelEntry"]], admission: Admission,
                 state_dir: Path):
        self.config = config
        self.binary = binary
        self.model_paths: dict[str, Path] = {}  # full model name -> GGUF file
        self.model_facts: dict[str, "GGUFFacts"] = {}  # full model name -> its GGUF header
        self.add_models(models)
        self.admission = admission
        self.state_dir = state_dir
        self.supervisors: dict[str, WorkerSupervisor] = {}
        self.plans: dict[str, WorkerPlan] = {}
        #: worker id -> config.fingerprint of what its process was started with (reload's diff)
        self.launched: dict[str, tuple] = {}
        #: workers a reload is removing: no restart may start a process for them (``retire``)
        self.retired: set[str] = set()
        #: workers a reload restarts with new settings, on trial: their crash-loop ``failed``
        #: is not the model's (the reload puts them back on their previous settings at once)
        self.trials: set[str] = set()
        self.upstream = None  # set by the gateway: streams of a worker that goes down are ended
        #: set by the gateway: called with a model's full name when a new process of it is
        #: ready (its chat template or projector may have changed: a reload or restart)
        self.on_new_process = None
        self.pollers: dict[str, WorkerPoller] = {}
        self.ratios: dict[str, Ratios] = {}  # model -> its tokenizer's (gateway.sizing)
        self.speeds = SpeedBoard()  # measured decode speed per worker process
        self.measured_speed = True  # scheduler.measured_speed (set by apply_scheduler)
        self.slot_watches: dict[str, SlotLeakWatch] = {}  # worker id -> its leaked-slot watch
        self.leaked_slot_s = config.llama_server.leaked_slot_s  # set by apply_supervision too
        self._leak_restarts: set[str] = set()  # workers a leaked slot is restarting now
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._restarting: dict[str, asyncio.Task] = {}  # worker id → its restart in progress
        self.held: set[str] = set()  # workers the operator drained (admin drain), restarts too
        self.apply_scheduler(config.scheduler)

    def add_models(self, models: tuple[dict[str, Path], list["ModelEntry"]]) -> None:
        """Files and GGUF facts of the models workers may be started for (at start and on
        reload; a model's entry replaces the one of the same name)."""
        paths, entries = models
        self.model_paths.update(paths)
        self.model_facts.update({e.name: e.facts for e in entries})

    def apply_scheduler(self, sc) -> None:
        """The ``scheduler`` section (a SchedulerConfig) for the next scheduling decision and
        the next poll of every worker (at start and on reload)."""
        d = self.admission.dispatcher
        # A reload keeps what the prefix index learnt (the workers' caches did not change).
        d.scorer = keep_prefix_index(d.scorer, make_scorer(
            sc.policy, affinity=sc.prefix_affinity, affinity_bound=sc.affinity_bound,
            kv_weight=sc.kv_weight, prefill_weight=sc.prefill_weight,
            affinity_wait_ms_per_1k_tokens=sc.affinity_wait_ms_per_1k_tokens,
            affinity_wait_max_s=sc.affinity_wait_max_s))
        d.queue.aging_s = sc.aging_s
        self.measured_speed = sc.measured_speed
        self._apply_speeds(self.speeds.all())  # switched on or off by a reload: at once
        for p in self.pollers.values():
            p.interval_s, p.timeout_s = sc.poll_interval_s, sc.poll_timeout_s

    def apply_supervision(self, ls) -> None:
        """The ``llama_server`` supervision settings (:func:`supervision`) for every existing
        worker (on reload): its next start, probe, stop or crash-loop check uses them. A wait
        already running keeps its length (a startup deadline, a backoff or ``failed_retry_s``
        sleep), and a worker in backoff continues its doubling from the delay it reached."""
        settings = supervision(ls)
        for sup in self.supervisors.values():
            for key, value in settings.items():
                setattr(sup, key, value)
        self.leaked_slot_s = ls.leaked_slot_s  # from the next poll on (the fleet watches slots)

    def _threads(self, plans: list[WorkerPlan]) -> int | None:
        ls = self.config.llama_server
        if ls.threads:
            return ls.threads
        n_cpu = sum(1 for p in plans if p.is_cpu)
        return max(1, (os.cpu_count() or 1) // max(1, n_cpu))

    def build(self, plans: list[WorkerPlan]) -> None:
        threads = self._threads(plans)
        for plan in plans:
            self._add(plan, threads)

    def _add(self, plan: WorkerPlan, threads: int | None,
             launch: tuple[LaunchSpec, tuple] | None = None) -> WorkerSupervisor:
        """Register a worker of ``plan`` under the current config, or, with ``launch``, with
        that (spec, fingerprint) of an earlier process (a reload's rollback)."""
        ls = self.config.llama_server
        facts = self.model_facts.get(plan.model)
        if launch is None:
            mcfg = next(m for m in self.config.models if m.full_name == plan.model)
            args = list(ls.extra_args) + _model_args(mcfg)
            slots, ctx, configured = launch_slots(args, plan.slots, plan.context,
                                                  facts.context_length if facts else 0)
            if ctx < configured:
                log.warning("worker.context_capped", worker=plan.id, configured=configured,
                            trained=ctx)
            spec = LaunchSpec(worker_id=plan.id, binary=self.binary,
                              model_path=self.model_paths[plan.model], alias=plan.model,
                              gpus=plan.gpus, slots=slots, context_per_slot=ctx,
                              threads=threads if plan.is_cpu else None,
                              embeddings=mcfg.embeddings, extra_args=args,
                              log_verbosity=None if self.config.log.level == "debug"
                              else QUIET_LOG_VERBOSITY)
            self.launched[plan.id] = fingerprint(plan, self.config,
                                                 facts.context_length if facts else 0)
        else:
            spec, self.launched[plan.id] = launch
            args = list(spec.extra_args)
        sup = WorkerSupervisor(spec, on_ready=self._on_ready, on_down=self._on_down,
                               on_state=self._on_state, on_check=self._on_check,
                               state_dir=self.state_dir,
                               **supervision(ls))
        self.supervisors[plan.id] = sup
        self.plans[plan.id] = plan
        self.slot_watches[plan.id] = SlotLeakWatch(self.admission.dispatcher.clock)
        kv_bytes = kv_bytes_from_gguf(facts.kv, facts.architecture, args) if facts else 0
        self.admission.dispatcher.add_worker(  # -c as started (the trained context's cap)
            plan.id, plan.model, spec.slots, n_ctx=spec.context_per_slot,
            kv_capacity=spec.total_context,
            cache_tokens=worker_cache_tokens(spec.total_context, args, kv_bytes))
        sc = self.config.scheduler
        self.pollers[plan.id] = WorkerPoller(
            plan.id, lambda wid=plan.id: self.endpoint_of(wid),
            lambda s, wid=plan.id: self._on_sample(wid, s),
            interval_s=sc.poll_interval_s, timeout_s=sc.poll_timeout_s,
            gpus=tuple(plan.gpus), read_gpus=read_gpu_stats)
        return sup

    # ---- live changes (reload, admin) -------------------------------------------------------
    def draining(self, worker_id: str) -> bool:
        view = self.admission.dispatcher.workers.get(worker_id)
        return bool(view and view.draining)

    def set_draining(self, worker_id: str, draining: bool, held: bool = False) -> None:
        """Take a worker out of (or back into) rotation; its running requests continue.
        ``held``: the operator's drain (when every worker of a model is held, its requests get
        503 at once instead of waiting). Raises KeyError for an unknown worker."""
        if worker_id not in self.supervisors:
            raise KeyError(worker_id)
        self.admission.worker_draining(worker_id, draining, held)
        log.info("worker.draining" if draining else "worker.undrained", worker=worker_id)

    def operator_drain(self, worker_id: str) -> None:
        """The operator's drain (admin API): out of rotation until ``operator_undrain``, also
        across restarts of the worker (an admin restart, a reload's, a leaked slot's): a
        restart brings it back drained. Raises KeyError for an unknown worker."""
        self.set_draining(worker_id, True, held=True)
        self.held.add(worker_id)

    def operator_undrain(self, worker_id: str) -> bool:
        """End the operator's drain. Back into rotation now, unless a restart of the worker
        is running: its drain (or its new process, still loading) is left alone and the
        worker returns to rotation once that restart has it ready. Returns whether it went
        back now. Raises KeyError for an unknown worker."""
        if worker_id not in self.supervisors:
            raise KeyError(worker_id)
        self.held.discard(worker_id)
        if worker_id in self._restarting:
            log.info("worker.undrain_after_restart", worker=worker_id)
            if self.draining(worker_id):  # now the restart's own drain: requests wait for it
                self.set_draining(worker_id, True)
            return False
        self.set_draining(worker_id, False)
        return True

    async def drain(self, worker_id: str, timeout_s: float) -> int:
        """Stop new leases to ``worker_id`` and wait up to ``timeout_s`` seconds until its
        running requests finished. Returns how many were still running at the deadline. An
        operator's drain (``held``) stays one, so its model's requests are still refused."""
        self.set_draining(worker_id, True, held=worker_id in self.held)
        view = self.admission.dispatcher.workers[worker_id]
        end = time.monotonic() + timeout_s
        while view.busy and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if view.busy:
            log.warning("worker.drain_timeout", worker=worker_id, still_running=view.busy,
                        drain_s=timeout_s)
        return view.busy

    async def remove_worker(self, worker_id: str, drain_s: float,
                            event: str = "worker.removed") -> None:
        """Drain, stop (SIGTERM, grace, SIGKILL; reaped) and forget a worker; logs ``event``
        (a restart's stop logs ``worker.restart_stopped``, not a removal)."""
        if await self.drain(worker_id, drain_s) and self.upstream is not None:
            # what outlived the drain ends now, closing its connections: llama-server does not
            # exit on SIGTERM while a request of it is open, so the stop waited stop_grace_s
            # and SIGKILLed it, the streams silent meanwhile (an operator tester's find)
            self.upstream.abort_worker(worker_id, "was stopped (a restart, reload or removal) "
                                                  "before this answer was complete; please retry")
        sup = self.supervisors[worker_id]
        poller = self.pollers.pop(worker_id, None)
        if poller is not None:
            await poller.stop()
        await sup.stop()
        # Forgotten only once stopped, so listings never lose a worker that is restarting.
        self.supervisors.pop(worker_id, None)
        self.plans.pop(worker_id, None)
        self.launched.pop(worker_id, None)
        self.slot_watches.pop(worker_id, None)
        self.admission.dispatcher.remove_worker(worker_id)
        self._apply_speeds(self.speeds.forget(worker_id))
        log.info(event, worker=worker_id)

    def retire(self, worker_id: str) -> None:
        """A reload removes ``worker_id``: no new leases (``Dispatcher.retire``), and no restart
        (an admin's, running or asked for later) starts a process for it; see
        :meth:`remove_retired`."""
        self.retired.add(worker_id)
        self.admission.dispatcher.retire(worker_id)

    async def remove_retired(self, worker_id: str, drain_s: float) -> None:
        """Drain and stop a worker :meth:`retire` took out, once a restart of it that was
        already running has ended (that restart then starts no process and its caller gets
        KeyError: an admin restart raced with the reload left a process the fleet no longer
        knew, or a worker no reload could remove; a fresh tester's find). The operator's drain
        ends with the worker."""
        running = self._restarting.get(worker_id)
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)
        if worker_id in self.supervisors:
            await self.remove_worker(worker_id, drain_s)
        self.held.discard(worker_id)

    def add_worker(self, plan: WorkerPlan, event: str = "worker.added",
                   launch: tuple[LaunchSpec, tuple] | None = None) -> WorkerSupervisor:
        """Register and start a worker for ``plan`` (not in rotation until ready); logs
        ``event`` (a restart's start logs ``worker.restart_started``). ``launch``: see
        ``_add``."""
        self.retired.discard(plan.id)  # a reload that removed it may add it back later
        sup = self._add(plan, self._threads(list(self.plans.values()) + [plan]), launch)
        sup.start()
        if self._session is not None:
            self.pollers[plan.id].start(self._session)
        log.info(event, worker=plan.id, slots=plan.slots, gpus=list(plan.gpus))
        return sup

    async def restart_worker(self, worker_id: str, drain_s: float,
                             plan: WorkerPlan | None = None,
                             ready_timeout_s: float | None = None,
                             launch: tuple[LaunchSpec, tuple] | None = None) -> WorkerSupervisor:
        """Drain ``worker_id`` (new requests go to other workers or wait in the queue), stop
        it, and start it again with ``plan`` (default: the same plan; ``launch``: the launch
        spec and fingerprint of an earlier process instead of the current config's); returns
        the new supervisor.

        The restart runs as a task of its own: a caller that is cancelled (an admin client
        that left while the worker drained; aiohttp cancels its handler) does not stop it
        halfway, which left the worker drained for good, or removed. A call for a worker whose
        restart is still running waits for that restart; without a ``plan`` (the same restart
        asked again: an admin's second click, a leak seen during an admin restart) it returns
        its result, with one (a reload's new plan) it restarts the worker again after it.

        A restart lasts until the new process is ready (or ``failed``, or past
        ``ready_timeout_s`` seconds, default ``llama_server.startup_timeout_s``): a second
        click while the new process still loads joins this restart instead of stopping that
        process and leaving the first caller waiting for a worker that never comes up."""
        if worker_id in self.retired:
            raise KeyError(worker_id)  # a reload is removing it
        running = self._restarting.get(worker_id)
        if running is not None:
            try:
                result = await asyncio.shield(running)
            except Exception:  # noqa: BLE001 — that restart's own caller sees its error
                result = None
            if plan is None and result is not None:
                return result
        if ready_timeout_s is None:
            ready_timeout_s = self.config.llama_server.startup_timeout_s
        task = asyncio.get_running_loop().create_task(
            self._restart(worker_id, drain_s, plan, ready_timeout_s, launch))
        self._restarting[worker_id] = task

        def done(t: asyncio.Task) -> None:
            if self._restarting.get(worker_id) is t:
                del self._restarting[worker_id]
        task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _restart(self, worker_id: str, drain_s: float, plan: WorkerPlan | None,
                       ready_timeout_s: float,
                       launch: tuple[LaunchSpec, tuple] | None = None) -> WorkerSupervisor:
        plan = plan or self.plans[worker_id]
        if launch is None and plan is self.plans.get(worker_id):  # the same restart again:
            launch = self.supervisors[worker_id].spec, self.launched[worker_id]  # same command
        order = list(self.supervisors)
        old = self.supervisors[worker_id]
        await self.remove_worker(worker_id, drain_s, "worker.restart_stopped")
        if worker_id in self.retired:  # a reload removed it meanwhile: no new process
            log.info("worker.removed", worker=worker_id, during="restart")
            raise KeyError(worker_id)
        sup = self.add_worker(plan, "worker.restart_started", launch)
        if worker_id in self.held:  # the operator's drain outlives the restart: not in
            self.set_draining(worker_id, True, held=True)  # rotation while it loads or once ready
        sup.restarts = old.restarts + 1
        # the worker's record goes on: why it failed stays visible after an operator acts on it
        for count in ("slot_leaks", "crashes", "wedges", "crash_loops"):
            setattr(sup, count, getattr(old, count))
        self.supervisors = {k: self.supervisors[k] for k in order if k in self.supervisors} | \
            self.supervisors  # keep the fleet's order for listings
        await sup.wait_ready(ready_timeout_s)
        # An operator's drain, set above or during the load, stays; one that an undrain ended
        # during the load (it left the drain to this restart) ends now.
        if (self.supervisors.get(worker_id) is sup and worker_id not in self.held
                and self.draining(worker_id)):
            self.set_draining(worker_id, False)
        return sup

    def _on_ready(self, sup: WorkerSupervisor) -> None:
        self._apply_speeds(self.speeds.forget(sup.id))  # a new process: measured afresh
        self._forget_slots(sup.id)  # a new process: its task ids start again
        actual = getattr(sup, "actual_slots", sup.spec.slots)
        self.admission.worker_checking(sup.id, False)  # a new process: no check of it runs
        self.admission.worker_slots(sup.id, actual)
        if sup.slots_n_ctx:
            self.admission.worker_context(sup.id, int(sup.slots_n_ctx), sup.spec.total_context)
        self.admission.worker_ready(sup.id, True)
        if self.on_new_process is not None:
            self.on_new_process(sup.spec.alias)
        if sup.spec.alias not in self.ratios and self._session is not None:
            t = asyncio.get_running_loop().create_task(self._measure_tokenizer(sup))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _on_down(self, sup: WorkerSupervisor, reason: str) -> None:
        log.warning("worker.down", worker=sup.id, gpu=sup.spec.gpu_label, reason=reason)
        self.admission.worker_ready(sup.id, False)
        self.admission.worker_checking(sup.id, False)
        self._forget_slots(sup.id)
        self._apply_speeds(self.speeds.forget(sup.id))
        if self.upstream is not None:
            self.upstream.abort_worker(sup.id, reason)

    def _on_state(self, sup: WorkerSupervisor) -> None:
        """Tell admission when the worker enters or leaves crash-loop ``failed`` (when every
        worker of a model is failed, its requests are refused at once instead of waiting);
        its other state changes reach admission through ``on_ready`` / ``on_down``. A
        supervisor that was already replaced (restart) is ignored."""
        if self.supervisors.get(sup.id) is not sup:
            return
        failed = sup.state == "failed" and sup.id not in self.trials
        view = self.admission.dispatcher.workers.get(sup.id)
        if view is not None and view.failed != failed:  # what admission knows changes
            self.admission.worker_failed(sup.id, failed, sup.retry_at)

    def note_stall(self, worker_id: str) -> None:
        """Watchdog: a request on this worker stalled (liveness evidence). Called while the
        stalled request still holds its lease, before it is cancelled.

        When that request held the worker's last free slot (``WorkerView.all_slots_taken``:
        a single-slot worker always, a multi-slot one whose other slots are busy), the
        supervisor checks the worker at once instead of after ``wedge_after_stalls`` stalls in
        a row. The gateway is the worker's only client, so once the request is cancelled no
        slot should stay busy: a worker that answers ``/health`` but never frees the slot
        (field case 10, a silent worker) has no slot left for anyone, takes no stall of
        another request that could complete a streak, and would stay in rotation unusable.
        The check (``workers.stall_check``) waits up to ``liveness_timeout_s`` for a slot to
        free, which llama-server does within about 0.5 s (streamed) or 2 s (not) of the
        cancel, so a worker that only went silent for that request passes and is kept; one
        whose slots stay busy with nothing moving is restarted. A stall that leaves other
        slots free counts toward the streak as before. Decided here, not in the watchdog or
        the supervisor: the dispatcher's view (pure, ``gateway.scheduling``) knows the leases
        and the polled slots, the supervisor does the I/O."""
        sup = self.supervisors.get(worker_id)
        if sup is not None:
            view = self.admission.dispatcher.workers.get(worker_id)
            sup.note_stall(no_free_slot=view is not None and view.all_slots_taken)

    def note_answered_elsewhere(self, worker_id: str) -> None:
        """Upstream: a request this worker sent nothing within ``first_byte_s`` was answered
        by another worker on its retry: the worker is suspect and checked at once, with a
        one-token completion (``WorkerSupervisor.note_silent``): a worker that accepts requests and never schedules
        them, while its main loop and ``/slots`` answer and its slots look idle, passed the
        check and kept every second request waiting ``first_byte_s`` (field case 10, "mark the
        worker suspect"; a fresh tester's find)."""
        sup = self.supervisors.get(worker_id)
        if sup is not None:
            sup.note_silent()

    def _on_check(self, sup: WorkerSupervisor, running: bool) -> None:
        """A stall check of the worker was asked for (True) or passed (False): while it
        runs, new work goes to the model's other workers (``Dispatcher.set_checking``)."""
        self.admission.worker_checking(sup.id, running)

    def note_progress(self, worker_id: str) -> None:
        """Watchdog: a request on this worker received data."""
        sup = self.supervisors.get(worker_id)
        if sup is not None:
            sup.note_progress()

    def _on_sample(self, worker_id: str, sample: Sample) -> None:
        self.admission.worker_load(worker_id, sample.load)
        plan = self.plans.get(worker_id)
        if plan is not None:
            self._apply_speeds(self.speeds.observe(worker_id, plan.model, sample.metrics))
        self._watch_slots(worker_id, sample)

    def _forget_slots(self, worker_id: str) -> None:
        watch = self.slot_watches.get(worker_id)
        if watch is not None:
            watch.reset()

    def _watch_slots(self, worker_id: str, sample: Sample) -> None:
        """Leaked slots (``gateway.scheduling.slot_leaks``): a slot busy with one task for
        ``llama_server.leaked_slot_s`` while no live lease on the worker is older than that
        task. The worker is then restarted as an admin restart does it (drain up to
        ``shutdown.drain_s``, stop, start: :meth:`restart_worker`), once: while that restart
        runs, while the worker is out of rotation for another reason (an operator's drain, a
        reload, crash-loop ``failed``) and while the gateway shuts down, slots are tracked but
        no leak is acted on; the new process starts with a fresh watch. One
        ``worker.slot_leaked`` warning per restart; the worker's ``slot_leaks`` and
        ``restarts`` count it (``/gateway/api/workers``)."""
        watch = self.slot_watches.get(worker_id)
        view = self.admission.dispatcher.workers.get(worker_id)
        if watch is None or view is None:
            return
        oldest = min((lease.granted_at for lease in view.leases), default=None)
        act = (view.in_rotation and worker_id not in self._leak_restarts
               and not self.admission.shutting_down)
        leaks = watch.observe(sample.slots, oldest, self.leaked_slot_s if act else 0.0)
        if leaks:
            self._restart_leaked(worker_id, leaks[0])

    def _restart_leaked(self, worker_id: str, leak: SlotLeak) -> None:
        sup = self.supervisors[worker_id]
        sup.slot_leaks += 1
        drain_s = self.config.shutdown.drain_s
        log.warning("worker.slot_leaked", worker=worker_id, gpu=sup.spec.gpu_label,
                    slot=leak.slot, id_task=leak.id_task, busy_s=round(leak.busy_s, 1),
                    unclaimed_s=round(leak.unclaimed_s, 1), leaked_slot_s=self.leaked_slot_s,
                    drain_s=drain_s, pid=sup.process.pid if sup.process else None)
        self._leak_restarts.add(worker_id)

        async def restart() -> None:
            try:
                await self.restart_worker(worker_id, drain_s)
            except KeyError:  # a reload removed it meanwhile
                pass
            except Exception:
                log.exception("worker.slot_leak_restart_failed", worker=worker_id)
            finally:
                self._leak_restarts.discard(worker_id)

        t = asyncio.get_running_loop().create_task(restart(), name=f"leak-restart-{worker_id}")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _apply_speeds(self, speeds: dict[str, float]) -> None:
        """Give the dispatcher the relative speeds of ``speeds`` (worker id → speed; ids it no
        longer has are skipped), or 1.0 for each with ``scheduler.measured_speed`` false. A
        change of 10 % or more is logged (``worker.speed``)."""
        d = self.admission.dispatcher
        for wid, speed in speeds.items():
            speed = speed if self.measured_speed else 1.0
            view = d.workers.get(wid)
            if view is None or view.speed == speed:
                continue
            if abs(speed / view.speed - 1.0) >= 0.1:
                rate = self.speeds.rate(wid)
                log.info("worker.speed", worker=wid, gpu=self.gpu_of(wid), speed=round(speed, 3),
                         previous=round(view.speed, 3),
                         sequence_tokens_per_s=round(rate, 1) if rate is not None else None)
            d.set_speed(wid, speed)

    async def _measure_tokenizer(self, sup: WorkerSupervisor) -> None:
        """Bytes per token of this model's tokenizer (``sizing.Ratios``), from the worker's
        ``/tokenize``: of digits and punctuation (``_DENSE_SAMPLE``), of ASCII prose
        (``_TOKENIZE_SAMPLE``, its few digits and punctuation counted at the dense ratio) and
        of non-ASCII text (the fewest among ``_WIDE_SAMPLES``, each sample's tokens all counted
        against its non-ASCII bytes)."""
        ep = self.endpoint_of(sup.id)
        if ep is None or self._session is None:
            return
        counts = []
        try:
            for text in (_TOKENIZE_SAMPLE, _DENSE_SAMPLE) + _WIDE_SAMPLES:
                async with self._session.post(ep.url + "/tokenize", json={"content": text},
                                              headers={"Authorization": f"Bearer {ep.api_key}"},
                                              timeout=aiohttp.ClientTimeout(total=5)) as r:
                    counts.append(len((await r.json(content_type=None)).get("tokens") or []))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            log.warning("tokenizer.measure_failed", worker=sup.id, error=str(e))
            return
        if all(counts):
            prose = _TOKENIZE_SAMPLE.encode()
            dense = len(_DENSE_SAMPLE) / counts[1]
            in_prose = dense_bytes(prose)
            # the prose's letters' own ratio: its tokens less those of its punctuation
            bpt = (len(prose) - in_prose) / max(counts[0] - in_prose / dense, counts[0] / 2)
            wide = min(wide_bytes(t.encode()) / n for t, n in zip(_WIDE_SAMPLES, counts[2:]))
            self.ratios[sup.spec.alias] = Ratios(bpt, wide, dense)
            log.info("tokenizer.measured", worker=sup.id, model=sup.spec.alias,
                     bytes_per_token=round(bpt, 3), wide_bytes_per_token=round(wide, 3),
                     dense_bytes_per_token=round(dense, 3))

    def ratios_of(self, model: str) -> Ratios:
        """Bytes per token of ``model``'s tokenizer as measured on a worker, else the
        configured ``scheduler.bytes_per_token`` for all text."""
        return self.ratios.get(model) or Ratios(self.config.scheduler.bytes_per_token)

    def estimate(self, model: str, body: dict, counted_tokens: int | None = None) -> SizeEstimate:
        """Size estimate and prefix key of an upstream body for ``model`` (gateway.sizing;
        ``counted_tokens``: its single prompt's tokens counted by a worker, if known)."""
        sc = self.config.scheduler
        n_ctx = max((w.n_ctx for w in self.admission.dispatcher.workers_for(model)), default=0)
        return estimate_with(body, self.ratios_of(model), prefix_bytes=sc.prefix_bytes,
                             unknown_num_predict=sc.unknown_num_predict_tokens, n_ctx=n_ctx,
                             counted_tokens=counted_tokens)

    def gpu_of(self, worker_id: str | None) -> str | None:
        """The worker's ``LaunchSpec.gpu_label`` ("0", "1,3", "cpu"); None for an unknown id."""
        sup = self.supervisors.get(worker_id) if worker_id else None
        return sup.spec.gpu_label if sup is not None else None

    def endpoint_of(self, worker_id: str) -> Endpoint | None:
        sup = self.supervisors.get(worker_id)
        if sup is None or sup.process is None or not sup.ready:
            return None
        return Endpoint(sup.process.url, sup.process.api_key, sup.process.has_exited)

    def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        for sup in self.supervisors.values():
            sup.start()
        for p in self.pollers.values():
            p.start(self._session)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        res = await asyncio.gather(*(s.wait_ready(timeout) for s in self.supervisors.values()))
        return all(res)

    def cancel_restarts(self) -> list[asyncio.Task]:
        """Cancel every restart under way (the gateway stops: none may start a worker after
        this; an admin restart already answered 503 went on to start one, a fresh tester's
        find); returns their tasks."""
        restarts = list(self._restarting.values())
        for t in restarts:
            t.cancel()
        return restarts

    async def stop(self) -> None:
        await asyncio.gather(*self.cancel_restarts(), return_exceptions=True)
        for p in self.pollers.values():
            await p.stop()
        for t in list(self._tasks):
            t.cancel()
        for sup in self.supervisors.values():
            self.admission.dispatcher.workers[sup.id].ready = False
        await asyncio.gather(*(s.stop() for s in self.supervisors.values()),
                             return_exceptions=True)
        if self.state_dir is not None:  # one per listen address: do not let them pile up
            remove_state_dir(self.state_dir)
        if self._session is not None:
            await self._session.close()
