"""Hot reload of gateway.yaml (SIGHUP, ``POST /gateway/api/admin/reload``).

Validate first: a file that does not load, validate or plan changes nothing, and the reason
is logged (``config.reload_rejected`` with the key-path errors) and returned.

Then apply only the difference (:func:`gateway.config.diff_plans`):

* settings without processes (queue, timeouts, generation, log, shutdown, admin, model
  priorities/aliases) take effect at once for new requests;
* ``added`` workers start (they join rotation when ready); one that does not become ready
  is removed again (``Reloader._check_added``);
* ``changed`` workers restart one at a time: drain (no new leases; running requests finish,
  up to ``shutdown.drain_s``), stop, start with the new plan (e.g. a new ``-np`` after a slot
  change), wait until ready, then the next one. Meanwhile requests go to the model's other
  workers or wait in the queue, so none is dropped. One that does not become ready stops the
  roll-out and runs its previous settings again (``Reloader._roll_out``);
* ``removed`` workers drain and stop; a model removed altogether first lets its running
  embedding batches end (up to ``shutdown.drain_s``; ``gateway.open_batches``).

``llama_server`` supervision settings (startup timeout, restart backoff, stop grace, health
and liveness probes, crash-loop guard) apply to every existing worker from its next start,
probe or stop on (:meth:`gateway.fleet.Fleet.apply_supervision`), without restarting it.

What only a restart changes (:data:`RESTART_ONLY`: ``listen``; ``timeouts.header_read_s``,
which aiohttp fixes per server as its keep-alive timeout when the server starts;
``llama_server.spare_connections``, fixed when the upstream client starts;
``llama_server.binary`` and ``backend``, resolved to one llama-server file when the gateway
starts) keeps its old value: each change is logged (``config.reload_needs_restart``) and named
in the result's ``notes``, and no worker restarts for it. The binary is still validated as
``check-config`` does (:func:`workers.provision.find_llama_server`; nothing is built): a path
that is missing or not executable rejects the reload, so the file the next start would use is
known to be good.
Reloads are serialised; systemd sees ``RELOADING=1`` … ``READY=1``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.config import ConfigError, GatewayConfig, load_config, plan_workers
from gateway.logs import configure, get_logger
from workers.gpu import detect_gpus
from workers.provision import ProvisionError, find_llama_server

if TYPE_CHECKING:
    from gateway.app import Gateway

log = get_logger("gateway.reload")

#: Settings a reload cannot apply (section, key; key None: a top-level setting). See module doc.
RESTART_ONLY: tuple[tuple[str, str | None], ...] = (
    ("listen", None), ("timeouts", "header_read_s"), ("llama_server", "spare_connections"),
    ("llama_server", "binary"), ("llama_server", "backend"))


def check_binary(cfg: GatewayConfig) -> None:
    """Raise ConfigError (``llama_server.binary: <why>``) when the configured llama-server (or
    ``$LLAMA_SERVER``) is missing or not executable, as ``check-config`` and ``serve`` refuse
    it. Finding none at all is not an error here (the running gateway has its own)."""
    ls = cfg.llama_server
    try:
        find_llama_server(ls.binary, None if ls.backend == "auto" else ls.backend)
    except ProvisionError as e:
        raise ConfigError(f"llama_server.binary: {e}", cfg.source) from None


def _setting(cfg: GatewayConfig, section: str, key: str | None):
    value = getattr(cfg, section)
    return getattr(value, key) if key else value


def keep_restart_only(old: GatewayConfig, new: GatewayConfig) -> tuple[GatewayConfig, list[str]]:
    """``new`` with every :data:`RESTART_ONLY` setting put back to its value in ``old``, and one
    note per setting that differed (``"<key>: <old> -> <new> needs a restart; still <old>"``)."""
    notes = []
    for section, key in RESTART_ONLY:
        name = f"{section}.{key}" if key else section
        was, want = (_setting(c, section, key) for c in (old, new))
        if was == want:
            continue
        log.warning("config.reload_needs_restart", key=name, old=was, new=want)
        notes.append(f"{name}: {was!r} -> {want!r} needs a restart; still {was!r}")
        if key:
            part = getattr(new, section).model_copy(update={key: was})
            new = new.model_copy(update={section: part})
        else:
            new = new.model_copy(update={section: was})
    return new, notes


@dataclass
class ReloadResult:
    """What a reload did. ``ok`` False: ``errors`` say why; with ``rolled_back`` empty the file
    was rejected and nothing changed, else those workers did not start with their new settings
    and run their previous ones again (``Reloader._roll_out``) while the rest of the file
    applies. ``changed``: workers restarted with new settings."""

    ok: bool
    errors: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _not_ready_why(sup, ready_timeout_s: float) -> str:
    """Why a worker a reload started is not ready, in words: its state and detail (its next
    automatic try is moot: the reload undoes it now), or the wait that ran out (a worker still
    ``starting`` said only "(starting)"; a fresh tester's find)."""
    if sup.state == "starting":
        return f"not ready within {ready_timeout_s:g} s (llama_server.startup_timeout_s)"
    detail = sup.detail.partition("; next try in")[0]
    return f"{sup.state}: {detail}" if detail else sup.state


class Reloader:
    """Reloads ``path`` into the running gateway ``gw``."""

    def __init__(self, gw: "Gateway", path: str | None):
        self.gw = gw
        self.path = path
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def spawn(self) -> asyncio.Task:
        """Run :meth:`reload` as a task of its own (SIGHUP; the admin API, whose client may
        leave mid-reload), kept until it ends or :meth:`cancel_all`."""
        t = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def cancel_all(self) -> None:
        """The gateway stops: running reloads start no further worker (a restart already
        under way is the fleet's to cancel)."""
        for t in list(self._tasks):
            t.cancel()

    async def reload(self) -> ReloadResult:
        """Reload ``path`` into the gateway, once its fleet is started (``Gateway.started``:
        a SIGHUP during start-up, a llama-server build included, waits for it)."""
        await self.gw.started.wait()
        async with self._lock:
            gw = self.gw
            # RELOADING=1 … READY=1 only once start-up's READY=1 was sent: a READY=1 before it
            # told systemd the service was up while no worker was (a fresh tester's find)
            told = gw.ready_sent
            try:
                if told:
                    # systemd times the reload by TimeoutStartSec (300 s in the unit), and a
                    # roll-out restarts changed workers one after another, each up to
                    # startup_timeout_s: extend it while the reload goes on, as at start-up
                    gw.notifier.reloading()
                    res = await gw.notifier.extending(self._reload(), "reloading")
                else:
                    res = await self._reload()
            finally:
                if told and not gw.stopping.is_set():  # after STOPPING=1, no READY=1 (a
                    gw.notifier.ready(gw.fleet_status())  # fresh tester's find)
            gw.metrics.reloads.labels("ok" if res.ok else "rolled_back" if res.rolled_back
                                      else "rejected").inc()
            return res

    async def _reload(self) -> ReloadResult:
        gw = self.gw
        if not self.path:
            return ReloadResult(False, ["the gateway was not started from a config file"])
        log.info("config.reloading", path=self.path)
        try:
            new = await asyncio.to_thread(load_config, self.path)
            await asyncio.to_thread(check_binary, new)
            plans = plan_workers(new, await asyncio.to_thread(detect_gpus))
            models = await gw.load_models(new)
        except ConfigError as e:
            errors = str(e).splitlines()  # "<file>: <key path>: <what>" per line
            log.error("config.reload_rejected", path=self.path, errors=errors)
            return ReloadResult(False, errors)
        except (OSError, ValueError) as e:
            log.error("config.reload_rejected", path=self.path, errors=[str(e)])
            return ReloadResult(False, [f"{self.path}: {e}"])
        old = gw.config
        new, notes = keep_restart_only(old, new)  # before the diff: a kept binary restarts none
        diff = gw.diff_with(new, plans, models[1])
        res = ReloadResult(True, added=[p.id for p in diff.added],
                           changed=[p.id for p in diff.changed],
                           removed=[p.id for p in diff.removed],
                           unchanged=[p.id for p in diff.unchanged], notes=notes)
        gw.apply_settings(new, models)
        if (new.log.level, new.log.format) != (old.log.level, old.log.format):
            configure(new.log.level, new.log.format)
        drain_s = new.shutdown.drain_s
        fleet = gw.fleet
        for plan in diff.added:  # on trial until _check_added: a crash loop is not the model's
            fleet.trials.add(plan.id)
            fleet.add_worker(plan)
        res.changed = await self._roll_out(diff.changed, drain_s,
                                           new.llama_server.startup_timeout_s, res)
        await self._check_added(diff.added, drain_s, new.llama_server.startup_timeout_s, res)
        await self._let_batches_end(diff.removed, plans, drain_s)
        for plan in diff.removed:  # no new leases; a model left without workers is refused
            fleet.retire(plan.id)
        gw.admission.refuse_queued()  # its queued requests now, not after the drain and stop
        for plan in diff.removed:
            await fleet.remove_retired(plan.id, drain_s)
        log.info("config.reloaded", path=self.path, added=res.added, changed=res.changed,
                 removed=res.removed, unchanged=len(res.unchanged), rolled_back=res.rolled_back)
        return res

    async def _let_batches_end(self, removed: list, plans: list, drain_s: float) -> None:
        """Wait up to ``drain_s`` seconds for the embedding batches running now of the models
        this reload removes altogether (``removed`` workers' models that no plan of ``plans``
        serves), before their workers retire: a batch's later inputs are new tickets, which a
        retired model refuses (``gateway.open_batches``). A model that keeps a worker needs no
        wait: its batches' later inputs go to that worker."""
        kept = {p.model for p in plans}
        gone = {p.model for p in removed} - kept
        running = self.gw.open_batches.count(gone)
        if not running:
            return
        log.info("config.reload_batches_wait", models=sorted(gone), batches=running,
                 drain_s=drain_s)
        left = await self.gw.open_batches.wait(gone, drain_s)
        if left:
            log.warning("config.reload_batches_cut", models=sorted(gone), batches=left,
                        drain_s=drain_s)

    async def _check_added(self, added: list, drain_s: float, ready_timeout_s: float,
                           res: ReloadResult) -> None:
        """Wait for the ``added`` workers (started before the roll-out, so they load meanwhile)
        to become ready. One that does not (``failed`` in a crash loop, or not ready within
        ``ready_timeout_s``) is removed again, as a changed worker is rolled back: ``res``
        names it in ``rolled_back`` and ``errors`` (``ok`` false), and reloading the same
        file tries it again (it answered 200 ``ok`` and crash-looped on; a fresh tester's
        find). Workers that did start stay."""
        fleet = self.gw.fleet
        dispatcher = self.gw.admission.dispatcher
        sups = [(p, fleet.supervisors[p.id]) for p in added if p.id in fleet.supervisors]
        try:
            ok = await asyncio.gather(*(sup.wait_ready(ready_timeout_s) for _, sup in sups))
        finally:
            # Requests for a new model wait meanwhile (Fleet.trials): they got the crash loop's
            # 503 "tries again in 300 s, or restart it" for a worker that was then removed (a
            # fresh tester's find); a removed one leaves them NotStarted (refuse_queued).
            for p in added:
                fleet.trials.discard(p.id)
        failed = {p.id for (p, _), ready in zip(sups, ok) if not ready}
        for (plan, sup), ready in zip(sups, ok):
            if ready:
                continue
            wid = plan.id
            why = _not_ready_why(sup, ready_timeout_s)
            log.error("worker.reload_not_ready", worker=wid, state=sup.state, detail=sup.detail,
                      not_restarted=[])
            if all(w.id in failed for w in dispatcher.workers.values() if w.model == plan.model):
                # the model is left without a worker: say why, not "removed by a reload"
                dispatcher.not_started[plan.model] = why
            fleet.retire(wid)
            await fleet.remove_retired(wid, drain_s)
            # not planned any more: the next reload's diff adds it again
            self.gw.plans = [p for p in self.gw.plans if p.id != wid]
            res.ok = False
            res.added.remove(wid)
            res.rolled_back.append(wid)
            res.errors.append(f"worker {wid} did not become ready ({why}); it was removed "
                              f"again; the rest of the file is in effect")

    async def _roll_out(self, changed: list, drain_s: float, ready_timeout_s: float,
                        res: ReloadResult) -> list[str]:
        """Restart the ``changed`` workers with their new plans one at a time, each drained
        first; returns the ids restarted that way. The first that does not become ready
        (``failed`` in a crash loop, or not ready within ``ready_timeout_s``: a new argument
        llama-server refuses, a model that no longer loads) stops the roll-out: it is started
        again as it ran before (its previous plan and command line), the ones after it are
        not restarted, and ``res`` says so (``ok`` false, ``errors``, ``rolled_back``). So a
        reload that breaks workers takes down at most one, for one start, not the model."""
        fleet, done = self.gw.fleet, []
        for i, plan in enumerate(changed):
            log.info("worker.reload_restart", worker=plan.id, slots=plan.slots,
                     context=plan.context)
            before = fleet.plans[plan.id], (fleet.supervisors[plan.id].spec,
                                            fleet.launched[plan.id])
            fleet.trials.add(plan.id)  # its requests wait for the rollback, not 503 "failed"
            try:
                sup = await fleet.restart_worker(plan.id, drain_s, plan, ready_timeout_s)
            finally:
                fleet.trials.discard(plan.id)
            if sup.ready:
                done.append(plan.id)
                continue
            why = _not_ready_why(sup, ready_timeout_s)
            rest = [p.id for p in changed[i + 1:]]
            log.error("worker.reload_not_ready", worker=plan.id, state=sup.state,
                      detail=sup.detail, not_restarted=rest)
            await fleet.restart_worker(plan.id, drain_s, before[0], ready_timeout_s,
                                       launch=before[1])
            res.ok = False
            res.rolled_back = [plan.id]
            res.errors.append(
                f"worker {plan.id} did not become ready with its new settings ({why}); it was "
                f"started again with its previous settings"
                + (f", and {', '.join(rest)} kept theirs" if rest else "")
                + "; the rest of the file is in effect")
            break
        return done
