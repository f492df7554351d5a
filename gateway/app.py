"""The running gateway: config → binary, models, fleet, scheduler, HTTP server."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from aiohttp import web

from gateway import __version__
from gateway.admission import Admission
from gateway.api import admin as admin_api
from gateway.api import ollama as ollama_api
from gateway.api import openai as openai_api
from gateway.config import GatewayConfig, ModelConfig, plan_workers
from gateway.fleet import Fleet
from gateway.inventory import Inventory, ModelEntry, full_name
from gateway.logs import get_logger
from gateway.middleware import Guard, gateway_middleware, guard_middleware
from gateway.scheduling import Dispatcher
from gateway.upstream import Upstream
from workers.demo_model import ensure_demo_model
from workers.gpu import detect_gpus
from workers.process import reap_stale_workers
from workers.provision import cache_root, ensure_llama_server

log = get_logger("gateway.app")


class Gateway:
    """All live parts of one gateway process. ``await start()``, then ``await stop()``."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.inventory: Inventory | None = None
        self.dispatcher = Dispatcher(time.monotonic, max_pending=config.queue.max_pending)
        self.admission = Admission(self.dispatcher)
        self.fleet: Fleet | None = None
        self.upstream: Upstream | None = None
        self.runner: web.AppRunner | None = None
        self.stopping = asyncio.Event()

    def model_config(self, name: str) -> ModelConfig | None:
        for m in self.config.models:
            if m.full_name.lower() == full_name(name).lower():
                return m
        return None

    def context_per_slot(self, name: str) -> int:
        """Real per-slot context (tokens) read back from a worker's ``/slots``, else configured."""
        if self.fleet:
            for s in self.fleet.supervisors.values():
                if s.spec.alias == name and s.slots_n_ctx:
                    return int(s.slots_n_ctx)
        m = self.model_config(name)
        return m.context if m else 0

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[gateway_middleware, guard_middleware],
                              client_max_size=self.config.limits.max_body_bytes)
        app["gw"] = self
        app["guard"] = guard = Guard(self.config)
        app.on_response_prepare.append(guard.on_response_prepare)
        app.add_routes(ollama_api.routes())
        app.add_routes(openai_api.routes())
        app.add_routes(admin_api.routes())
        return app

    async def start(self) -> None:
        cfg = self.config
        ls = cfg.llama_server
        binary = await asyncio.to_thread(ensure_llama_server, ls.binary,
                                         None if ls.backend == "auto" else ls.backend)
        paths: dict[str, Path] = {}
        entries = []
        for m in cfg.models:
            p = await asyncio.to_thread(ensure_demo_model) if m.is_builtin else Path(m.path).expanduser()
            paths[m.full_name] = p
            e = await asyncio.to_thread(ModelEntry.load, m.full_name, p, m.aliases, m.embeddings)
            e.compute_digest_in_background()
            entries.append(e)
        self.inventory = Inventory(entries)
        host, port = cfg.host, cfg.port
        state_dir = cache_root() / "run" / f"{host.strip('[]')}_{port}"
        for pid in reap_stale_workers(state_dir):
            log.warning("gateway.stale_worker_reaped", pid=pid)
        plans = plan_workers(cfg, detect_gpus())
        self.fleet = Fleet(cfg, binary, paths, self.admission, state_dir)
        self.fleet.build(plans)
        t = cfg.timeouts
        self.upstream = Upstream(self.admission, self.fleet.endpoint_of,
                                 first_byte_s=t.first_byte_s, request_s=t.request_s,
                                 inter_token_s=t.inter_token_s, client_write_s=t.client_write_s,
                                 write_buffer_bytes=cfg.limits.write_buffer_bytes,
                                 on_stall=self.fleet.note_stall,
                                 on_progress=self.fleet.note_progress)
        self.fleet.upstream = self.upstream
        await self.upstream.start()
        # Listen first: requests that arrive while workers load wait in the queue.
        # keepalive_timeout doubles as the header read timeout: aiohttp closes a connection
        # whose request has not fully arrived that long after connect / the last response.
        self.runner = web.AppRunner(self.build_app(), handler_cancellation=True,
                                    access_log=None, shutdown_timeout=1.0,
                                    keepalive_timeout=cfg.timeouts.header_read_s)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host.strip("[]"), port, reuse_address=True)
        await site.start()
        log.info("gateway.listening", listen=cfg.listen, version=__version__,
                 workers=[p.id for p in plans], binary=str(binary))
        self.fleet.start()

    async def stop(self) -> None:
        log.info("gateway.stopping")
        if self.runner:
            await self.runner.cleanup()
        if self.fleet:
            await self.fleet.stop()
        if self.upstream:
            await self.upstream.close()
        self.admission.close()
        log.info("gateway.stopped")


async def serve(config: GatewayConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status (0 on a clean stop)."""
    gw = Gateway(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, gw.stopping.set)
    try:
        await gw.start()
        await gw.stopping.wait()
    finally:
        await gw.stop()
    return 0
