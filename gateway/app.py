"""The running gateway: config → binary, models, fleet, scheduler, HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

from aiohttp import web

from gateway import __version__, early_hup
from gateway.admission import Admission
from gateway.api import admin as admin_api
from gateway.api import embeddings as embeddings_api
from gateway.api import ollama_manage as ollama_manage_api
from gateway.api import ollama as ollama_api
from gateway.api import openai as openai_api
from gateway.api import status_page
from gateway.body_errors import GatewayAppRunner
from gateway.config import (ConfigError, GatewayConfig, ModelConfig, PlanDiff, WorkerPlan, diff_plans,
                            models_without_workers, plan_workers)
from gateway.texts import no_workers
from gateway.drain import graceful_stop
from gateway.expect import with_expect
from gateway.fleet import Fleet
from gateway.inventory import Inventory, ModelEntry, file_id, full_name
from gateway.listen import address, bind_listen, raise_open_files_limit
from gateway.logs import ServerLogger, get_logger
from gateway.metrics import GatewayMetrics, worker_state
from gateway.middleware import Guard, gateway_middleware, guard_middleware
from gateway.open_batches import OpenBatches
from gateway.notify import EXTEND_BY_S, EXTEND_EVERY_S, Notifier, fleet_status
from gateway.reload import Reloader
from gateway.scheduling import Dispatcher
from gateway.upstream import Upstream
from gateway.worker_stats import WorkerStatsView
from workers.demo_model import demo_model_path, ensure_demo_model
from workers.gpu import detect_gpus
from workers.process import reap_stale_workers, remove_state_dir
from workers.provision import ProvisionError, cache_root, ensure_llama_server

log = get_logger("gateway.app")

#: Names whose ``Gateway.model_config`` answer is remembered (per config; names come from
#: requests, so the memo is bounded).
MODEL_CONFIG_MEMO = 256


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, streamed ones too, carries the request's X-Request-ID."""
    if "request_id" in request:
        response.headers.setdefault("X-Request-ID", request["request_id"])


class Gateway:
    """All live parts of one gateway process. ``await start()``, then ``await stop()``."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None,
                 notifier: Notifier | None = None):
        self.config = config
        self._model_configs: tuple[GatewayConfig | None, dict] = (None, {})  # model_config
        self.inventory: Inventory | None = None
        #: models whose file the last ``load_models`` found replaced in place (full names)
        self.files_changed: set[str] = set()
        self.dispatcher = Dispatcher(time.monotonic, max_pending=config.queue.max_pending)
        self.admission = Admission(self.dispatcher)
        self.fleet: Fleet | None = None
        self.upstream: Upstream | None = None
        self.runner: web.AppRunner | None = None
        self._socks: list = []  # listening sockets (gateway.listen), bound first at start
        self.stopping = asyncio.Event()
        #: the fleet is built and started (``start``): a reload waits for it (a SIGHUP during
        #: start-up found no fleet yet and its reload task died of an AttributeError)
        self.started = asyncio.Event()
        #: a second SIGTERM/SIGINT during the stop: end the drain now (gateway/drain.py)
        self.hurry = asyncio.Event()
        self.draining_requests = False  # the drain's wait for running requests is on
        self.inflight: dict[int, web.Request] = {}  # id(request) -> request being handled (middleware)
        #: Inference requests accepted and not yet answered (queued or running; the guard
        #: middleware counts them): the in-flight figure of /metrics and the status API.
        self.inference_in_flight = 0
        #: id(request) -> inputs of that admitted embedding request that wait for its bound on
        #: inputs in flight before they are even queued (``gateway.api.embeddings.embed_many``):
        #: part of ``waiting_inputs`` in the status API.
        self.inputs_held: dict[int, int] = {}
        #: embedding batches running, per model: a reload that removes the model lets them end
        self.open_batches = OpenBatches()
        self.draining = False  # True once shutdown began: new requests get 503
        self.notifier = notifier or Notifier()
        self.ready_sent = False  # systemd READY=1 of the start-up was sent (_watch)
        self.metrics = GatewayMetrics(self)
        self.worker_stats = WorkerStatsView(self._last_sample)
        self.reloader = Reloader(self, config_path)
        self.plans: list[WorkerPlan] = []
        self._tasks: list[asyncio.Task] = []

    def model_config(self, name: str) -> ModelConfig | None:
        """The ``models:`` entry whose full name ``name`` is (any case), or None. Answers are
        remembered per ``config`` object (a reload replaces it), for up to
        ``MODEL_CONFIG_MEMO`` names: a request looked its model up three times."""
        config, memo = self._model_configs
        if config is not self.config:
            config, memo = self._model_configs = (self.config, {})
        if name in memo:
            return memo[name]
        key = full_name(name).lower()
        found = next((m for m in config.models if m.full_name.lower() == key), None)
        if len(memo) < MODEL_CONFIG_MEMO:
            memo[name] = found
        return found

    def context_per_slot(self, name: str) -> int:
        """Real per-slot context (tokens) read back from a worker's ``/slots``; before any worker
        reported one, the configured context capped at the model's trained context (the GGUF's
        ``<arch>.context_length``), as llama-server caps it (``check-config`` shows the same)."""
        if self.fleet:
            for s in self.fleet.supervisors.values():
                if s.spec.alias == name and s.slots_n_ctx:
                    return int(s.slots_n_ctx)
        m = self.model_config(name)
        if m is None:
            return 0
        entry = self.inventory.resolve(name) if self.inventory is not None else None
        trained = entry.context_length if entry is not None else 0
        return min(m.context, trained) if trained else m.context

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[gateway_middleware, guard_middleware],
                              client_max_size=self.config.limits.max_body_bytes)
        app["gw"] = self
        app.on_response_prepare.append(_request_id_header)
        app["guard"] = guard = Guard(self.config)
        app.on_response_prepare.append(guard.on_response_prepare)
        for routes in (ollama_api.routes(), openai_api.routes(), admin_api.routes(),
                       embeddings_api.routes(), ollama_manage_api.routes(), status_page.routes()):
            app.add_routes(with_expect(routes))
        return app

    # ---- models, reload ----------------------------------------------------------------------
    async def load_models(self, cfg: GatewayConfig) -> tuple[dict[str, Path], list[ModelEntry]]:
        """Model files and inventory entries of ``cfg``; entries of models already loaded with
        the same path and flags are reused. Raises ConfigError naming ``models[i].path`` for a
        file that is not a readable GGUF."""
        old = {e.name: e for e in self.inventory.entries} if self.inventory else {}
        paths: dict[str, Path] = {}
        entries = []
        self.files_changed = set()
        for i, m in enumerate(cfg.models):
            try:
                p = await asyncio.to_thread(ensure_demo_model) if m.is_builtin \
                    else Path(m.path).expanduser()
            except OSError as e:  # a traceback and exit 1 before (a fresh tester's find)
                raise ConfigError(f"models[{i}].path: cannot write the built-in demo model to "
                                  f"{demo_model_path()} ($LLAMA_GATEWAY_CACHE, default "
                                  f"~/.cache/llama-gateway): {e.strerror or e}", cfg.source) from None
            paths[m.full_name] = p
            e = old.get(m.full_name)
            try:
                same_file = e is not None and e.file_id == await asyncio.to_thread(file_id, p)
            except OSError:
                same_file = False  # ModelEntry.load says why
            if e is not None and Path(e.path) == p and not same_file:
                # replaced in place: its workers restart on the new file (``diff_with``), and
                # /api/tags shows the new digest (a fresh tester's find: neither happened)
                self.files_changed.add(m.full_name)
            if e is None or Path(e.path) != p or e.embeddings != m.embeddings \
                    or e.aliases != tuple(full_name(a) for a in m.aliases) or not same_file:
                try:
                    e = await asyncio.to_thread(ModelEntry.load, m.full_name, p, m.aliases,
                                                m.embeddings)
                except (OSError, ValueError) as err:  # gguf: "GGUF magic invalid", empty file …
                    raise ConfigError(f"models[{i}].path: not a readable GGUF file: {p} ({err})",
                                      cfg.source) from None
                e.compute_digest_in_background()
            entries.append(e)
        return paths, entries

    def diff_with(self, new: GatewayConfig, plans: list[WorkerPlan],
                  entries: list[ModelEntry] = ()) -> PlanDiff:
        """What a reload to ``new`` starts, stops and restarts; the workers of a model whose
        file :meth:`load_models` found replaced count as changed. ``entries``: the new
        config's models (:meth:`load_models`), whose training contexts cap the compared
        per-slot contexts as they cap the workers' own."""
        diff = diff_plans(self.plans, plans, self.config, new,
                          self.fleet.launched if self.fleet else None,
                          {e.name: e.facts.context_length for e in entries})
        moved = [p for p in diff.unchanged if p.model in self.files_changed]
        if moved:
            diff = dataclasses.replace(
                diff, unchanged=[p for p in diff.unchanged if p not in moved],
                changed=[p for p in plans if p in diff.changed or p in moved])
        self.plans = plans
        return diff

    def apply_settings(self, new: GatewayConfig,
                       models: tuple[dict[str, Path], list[ModelEntry]]) -> None:
        """Make ``new`` the live config for everything that has no process behind it: queue,
        timeouts and watchdog limits (running streams too), write buffer and body limits,
        scheduler, auth/CORS/Host rules, models. What only a restart changes is listed in
        :data:`gateway.reload.RESTART_ONLY` (the reload keeps the old value)."""
        self.config = new
        self.dispatcher.max_pending = new.queue.max_pending
        if self.upstream:
            self.upstream.configure(new)
        if self.fleet:
            self.fleet.config = new
            self.fleet.apply_scheduler(new.scheduler)
            self.fleet.apply_supervision(new.llama_server)
            self.fleet.add_models(models)
        self.inventory = Inventory(models[1])
        if self.runner is not None and "guard" in self.runner.app:
            self.runner.app["guard"].update(new)  # API keys, CORS, Host rules

    # ---- live status -------------------------------------------------------------------------
    def _last_sample(self, worker_id: str):
        poller = self.fleet.pollers.get(worker_id) if self.fleet else None
        return poller.last if poller is not None else None

    def worker_states(self) -> dict[str, str]:
        sups = self.fleet.supervisors.values() if self.fleet else ()
        return {s.id: worker_state(self, s) for s in sups}

    def _forget_props(self, model: str) -> None:
        """A new worker process of ``model`` is ready: what an earlier one's ``/props`` said
        (chat template, vision) is asked again when next needed. A reload or restart that
        changed ``--chat-template-file`` kept the old template's capabilities until the
        gateway restarted: tools refused, or accepted and dropped (a fresh tester's find).
        The chat-template renders learned by shape (``gateway.template_shapes``) go too."""
        entry = self.inventory.resolve(model) if self.inventory is not None else None
        if entry is not None:
            entry.worker_template, entry.worker_vision = None, False
            entry.opens_reasoning = None
            entry.template_shapes.clear()

    def fleet_status(self) -> str:
        return fleet_status(self.worker_states())

    async def _watch(self) -> None:
        """systemd READY=1 once every worker is ready or has ended its first start attempt
        (crashed, or not ready within ``startup_timeout_s``; it goes on restarting in the
        background, and its model's requests wait or get 503 meanwhile). Waiting for a crash
        loop to end held READY for ``crash_loop_restarts`` × ``startup_timeout_s`` (about 15
        min for a worker that hangs while it loads) until systemd's ``TimeoutStartSec`` killed
        the gateway, healthy models included (fresh testers' finds). Until READY, the start
        timeout is extended (``EXTEND_TIMEOUT_USEC``) every 20 s while a first attempt runs, so a
        model whose load takes longer than ``TimeoutStartSec`` (but not ``startup_timeout_s``)
        is not killed. STATUS= on every change (none once the gateway stops); worker failures
        into the recent-errors list."""
        details: dict[str, str] = {}
        extended = time.monotonic()
        while not self.stopping.is_set():
            self.notifier.status(self.fleet_status())
            sups = list(self.fleet.supervisors.values()) if self.fleet else []
            for s in sups:
                if s.state == "backoff" and s.detail and details.get(s.id) != s.detail:
                    self.metrics.errors.add(s.id, s.detail)
                details[s.id] = s.detail
            # every worker ready or past its first try; with none planned (no GPU,
            # cpu_fallback 0) at once, so that systemd's start does not time out on a gateway
            # that answers every request 503
            if not self.ready_sent:
                # runs_ended, not restarts: a worker a reload or an admin restarted while it
                # started carries its count over, and was reported failed while it loaded
                if all(s.ready or s.state == "failed" or s.runs_ended > 0 for s in sups):
                    self.ready_sent = True
                    log.info("gateway.ready", workers=len(sups),
                             failed=[s.id for s in sups if not s.ready])
                    self.notifier.ready(self.fleet_status())
                elif time.monotonic() - extended >= EXTEND_EVERY_S:
                    extended = time.monotonic()
                    self.notifier.extend_start(EXTEND_BY_S)
            await asyncio.sleep(0.2)

    async def start(self) -> None:
        cfg = self.config
        ls = cfg.llama_server
        host, port = cfg.host, cfg.port
        # First: owning the address is what makes run/<host>_<port>/ this process's to reap.
        self._socks = bind_listen(host.strip("[]"), port, cfg.source)
        if port == 0:  # the port the system picked: a run directory of its own (with "_0" every
            # port-0 gateway reaped the others' workers at start; a fresh tester's find)
            port = self._socks[0].getsockname()[1]
        self.notifier.start_watchdog()  # pings from the event loop, a build included
        try:
            binary = await self.notifier.extending(
                asyncio.to_thread(ensure_llama_server, ls.binary,
                                  None if ls.backend == "auto" else ls.backend),
                "finding or building llama-server")
        except ProvisionError as e:
            raise ConfigError(f"llama_server.binary: {e}", cfg.source) from None
        except OSError as e:  # the cache the build goes to (a traceback before)
            raise ConfigError(f"llama_server.binary: cannot use the cache {cache_root()} "
                              f"($LLAMA_GATEWAY_CACHE, default ~/.cache/llama-gateway): "
                              f"{e.strerror or e}", cfg.source) from None
        models = await self.load_models(cfg)
        self.inventory = Inventory(models[1])
        state_dir = cache_root() / "run" / f"{host.strip('[]')}_{port}"
        try:  # the workers' pid files go there: without it no worker could be tracked
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the workers' run directory {state_dir} "
                              f"($LLAMA_GATEWAY_CACHE, default ~/.cache/llama-gateway): "
                              f"{e.strerror or e}", cfg.source) from None
        for pid in reap_stale_workers(state_dir):
            log.warning("gateway.stale_worker_reaped", pid=pid)
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            # NVML, which plans the workers, ignores it, and every worker gets its own: an
            # operator who set it to keep GPUs for something else would have been ignored
            # without a word (a fresh tester's find)
            log.warning("gateway.cuda_visible_devices_ignored",
                        value=os.environ["CUDA_VISIBLE_DEVICES"],
                        hint="choose GPUs per model with models[].gpus in the config")
        try:
            plans = self.plans = plan_workers(cfg, detect_gpus())
        except ConfigError:  # no worker was started: leave no empty run directory behind
            remove_state_dir(state_dir)
            raise
        for model in models_without_workers(cfg, plans):
            log.warning("gateway.model_without_workers", model=model, reason=no_workers(model))
        self.fleet = Fleet(cfg, binary, models, self.admission, state_dir)
        self.fleet.build(plans)
        self.upstream = Upstream(self.admission, self.fleet.endpoint_of, cfg,
                                 on_stall=self.fleet.note_stall,
                                 on_progress=self.fleet.note_progress,
                                 on_answered_elsewhere=self.fleet.note_answered_elsewhere)
        self.fleet.upstream = self.upstream
        self.fleet.on_new_process = self._forget_props
        await self.upstream.start()
        # Listen first: requests that arrive while workers load wait in the queue.
        # keepalive_timeout doubles as the header read timeout: aiohttp closes a connection
        # whose request has not fully arrived that long after connect / the last response.
        # auto_decompress=False: gateway/limits.py read_body decodes bodies itself, bounded by
        # the current limits.max_body_bytes.
        # logger: counts the requests aiohttp's parser refuses (no gateway code sees them).
        # GatewayAppRunner: a body whose framing breaks after the headers is refused at once
        # (gateway/body_errors.py).
        self.runner = GatewayAppRunner(self.build_app(), handler_cancellation=True,
                                    access_log=None, shutdown_timeout=1.0, auto_decompress=False,
                                    keepalive_timeout=cfg.timeouts.header_read_s,
                                    logger=ServerLogger(self.metrics.unparsed.inc))
        await self.runner.setup()
        for sock in self._socks:
            await web.SockSite(self.runner, sock).start()
        log.info("gateway.listening", listen=address(host, port), version=__version__,
                 workers=[p.id for p in plans], binary=str(binary))
        self.fleet.start()
        self.started.set()
        self._tasks.append(asyncio.create_task(self._watch(), name="gateway-watch"))

    async def stop(self) -> None:
        log.info("gateway.stopping")
        for t in self._tasks:
            t.cancel()
        if self.runner:
            await self.runner.cleanup()
        for sock in self._socks:
            sock.close()  # the runner closed those it served; this closes any it never did
        if self.upstream and self.upstream.spares is not None:
            self.upstream.spares.close()  # before the workers stop: nothing will use them
        if self.fleet:
            await self.fleet.stop()
        if self.upstream:
            await self.upstream.close()
        self.admission.close()
        self.notifier.close()
        log.info("gateway.stopped")


async def serve(config: GatewayConfig, config_path: str | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (0 on a clean stop).

    SIGTERM/SIGINT: graceful stop (gateway/drain.py); a second one during it ends the drain at
    once (``gateway.drain_cut_short``). SIGHUP: reload ``config_path`` (gateway/reload.py).
    """
    before, after = raise_open_files_limit()
    if after != before:
        log.info("gateway.open_files_limit", before=before, after=after)
    gw = Gateway(config, config_path)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gw.stopping.set)

    def on_hup() -> None:
        log.info("gateway.sighup")
        gw.reloader.spawn()

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    if early_hup.take():  # signalled before the handler existed: reload now (gateway.early_hup)
        log.info("gateway.sighup", early=True)
        loop.call_soon(gw.reloader.spawn)
    try:
        await gw.start()
        await gw.stopping.wait()
        # No reload once the stop began; the signal must still be caught: its default action
        # ends the process at once (exit 129, streams cut, no drain; a fresh tester's find).
        loop.add_signal_handler(signal.SIGHUP, lambda: log.info("gateway.sighup_ignored",
                                                                reason="shutting down"))

        def hurry(sig: signal.Signals) -> None:  # Ctrl-C twice: do not wait out drain_s
            if gw.hurry.is_set():
                return
            gw.hurry.set()
            if gw.draining_requests:
                log.warning("gateway.drain_cut_short", signal=sig.name)
            else:  # the drain is over: the workers are being stopped
                log.info("gateway.signal_ignored", signal=sig.name, reason="stopping workers")

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, hurry, sig)
        gw.reloader.cancel_all()
        if gw.fleet:
            gw.fleet.cancel_restarts()
        await graceful_stop(gw)
    finally:
        gw.reloader.cancel_all()
        await gw.stop()
    return 0
