"""Gateway's own API under ``/gateway/api``: live status (open) and admin actions (token).

Read-only (open without ``auth.keys``; with keys, the admin token or an ``admin: true`` key, a
plain key gets 403; ``/metrics`` stays open with ``auth.metrics_public``):

* ``GET /gateway/api/workers`` → ``{"workers": [{id, model, state, detail, draining, pid, port,
  gpus, slots, busy, prefill_backlog_tokens, restarts, crashes, wedges, crash_loops, slot_leaks,
  stall_check, n_ctx_slot,
  kv_fill, deferred, tokens_per_s, speed, sequence_tokens_per_s, gpu}],
  "queue": {"depth" (requests waiting, as ``max_pending`` counts them), "waiting_inputs"
  (tickets waiting, each input of an embedding request counted, and the inputs of admitted
  embedding requests not yet queued: ``Gateway.inputs_held``), "max_pending",
  "by_priority": {prio: n}}, "in_flight" (inference requests
  queued or running; this poll and other status/admin requests are not counted), "shutting_down",
  "gpus": [{index, name, util_percent, memory_used_bytes, memory_total_bytes, temperature_c,
  power_w}], "recent_errors": [{time, source, message}]}``. ``kv_fill`` (0..1),
  ``deferred`` and ``tokens_per_s`` are null while unknown; ``speed`` is the relative decode
  speed the scheduler uses (1.0 = its model's reference worker, or unmeasured) and
  ``sequence_tokens_per_s`` the measured per-sequence decode rate it comes from (null while
  unmeasured; ``gateway.speed``); ``slot_leaks`` counts the worker's restarts for a leaked
  slot (``llama_server.leaked_slot_s``; each is also one of its ``restarts``); ``stall_check``
  is true while the supervisor checks the worker after stalls (``Dispatcher.set_checking``);
  ``gpu`` is the
  first GPU's sample or null. Worker keys are never shown.
* ``GET /metrics``: Prometheus text (gateway/metrics.py).

Admin (``Authorization: Bearer <admin.token>``, compared in constant time, or with
``auth.keys`` an ``admin: true`` key). No token configured: 403; header missing or a wrong
token: 401 with ``WWW-Authenticate: Bearer`` (RFC 9110: the credential is not valid); a valid
API key without ``admin: true``: 403 (guard middleware). Errors are ``{"error": "..."}``,
application/json.

* ``POST /gateway/api/admin/workers/{id}/drain``: out of rotation; running requests finish.
  The drain lasts until an undrain, restarts of the worker included.
* ``POST /gateway/api/admin/workers/{id}/undrain``: back into rotation: ``{"worker",
  "draining", "restarting"}``; while a restart of the worker runs, ``draining`` and
  ``restarting`` are true and it returns once the restart has it ready.
* ``POST /gateway/api/admin/workers/{id}/restart``: drain (up to ``shutdown.drain_s``), stop
  (SIGTERM, ``stop_grace_s``, SIGKILL, reaped), start again; answers once it is ready again or
  its startup timeout passed: ``{"worker", "state", "pid", "detail", "draining"}`` (an
  operator's drain outlives the restart), 503 with an ``error`` too when it is not ready then
  (``failed`` in a crash loop, still ``starting``); 404 when a reload removed the worker
  meanwhile.
* ``POST /gateway/api/admin/reload``: reload the config file (gateway/reload.py);
  200 with what changed, or 400 ``{"error", "errors": [...]}`` when the file is invalid or a
  changed worker did not start with its new settings (``rolled_back``: it runs its previous
  ones again).

A restart or reload still running when the gateway begins to stop is answered 503 at once.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from gateway.api.errors import ApiError, json_body
from gateway.auth import ADMIN_TOKEN_ENV, admin_token, is_admin_token
from gateway.logs import get_logger
from gateway.metrics import worker_state
from gateway.texts import SHUTTING_DOWN_MESSAGE
from workers.gpu import read_gpu_stats

log = get_logger("gateway.api.admin")

TOKEN_ENV = ADMIN_TOKEN_ENV


def _json(body, status: int = 200) -> web.Response:
    return json_body(orjson.dumps(body), status)


def _round(v: float | None, digits: int) -> float | None:
    return round(v, digits) if v is not None else None


def snapshot(gw) -> dict:
    """The live state shown by ``/gateway/api/workers``, ``llama-gateway status`` and the page."""
    gpus = read_gpu_stats()
    out = []
    for sup in list(gw.fleet.supervisors.values()) if gw.fleet else ():
        view = gw.dispatcher.workers.get(sup.id)
        proc = sup.process
        ws = gw.worker_stats.get(sup.id)
        g = gpus.get(sup.spec.gpus[0]) if sup.spec.gpus else None
        out.append({
            "id": sup.id, "model": sup.spec.alias, "state": worker_state(gw, sup),
            "detail": sup.detail_now, "draining": bool(view and view.draining),
            "pid": proc.pid if proc and proc.returncode is None else None,
            "port": proc.port if proc else None, "gpus": list(sup.spec.gpus),
            "slots": view.slots if view else sup.spec.slots, "busy": view.busy if view else 0,
            "prefill_backlog_tokens": view.prefill_backlog if view else 0,
            "restarts": sup.restarts, "n_ctx_slot": sup.slots_n_ctx,
            "kv_fill": ws.kv_fill, "deferred": ws.deferred,
            "tokens_per_s": _round(ws.tokens_per_s, 1),
            "speed": round(view.speed, 3) if view else 1.0,
            "sequence_tokens_per_s": _round(gw.fleet.speeds.rate(sup.id), 1),
            "gpu": g.__dict__ if g else None,
            "crashes": sup.crashes, "wedges": sup.wedges, "crash_loops": sup.crash_loops,
            "slot_leaks": sup.slot_leaks, "stall_check": bool(view and view.checking),
        })
    return {"workers": out,
            "queue": {"depth": gw.dispatcher.queue.requests(),
                      "waiting_inputs": len(gw.dispatcher.queue) + sum(gw.inputs_held.values()),
                      "max_pending": gw.dispatcher.max_pending,
                      "by_priority": {str(k): v for k, v in
                                      sorted(gw.dispatcher.queue.depth_by_priority().items())}},
            "in_flight": gw.inference_in_flight, "shutting_down": gw.draining,
            "gpus": [g.__dict__ for g in gpus.values()],
            "recent_errors": gw.metrics.errors.list()}


async def workers(request: web.Request) -> web.Response:
    return _json(snapshot(request.app["gw"]))


async def metrics(request: web.Request) -> web.Response:
    body = request.app["gw"].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _check_token(request: web.Request) -> None:
    """Admin access: the admin token, or (with ``auth.keys``) an ``admin: true`` key, both
    already checked by the guard middleware (``request["admin_auth"]``)."""
    if request.get("admin_auth"):
        return
    config = request.app["gw"].config
    if not admin_token(config):
        raise ApiError(403, f"admin API disabled: set admin.token in the config or {TOKEN_ENV}")
    auth = request.headers.get("Authorization", "")
    challenge = {"WWW-Authenticate": 'Bearer realm="llama-gateway admin"'}
    if not auth.startswith("Bearer "):
        raise ApiError(401, "admin token required: Authorization: Bearer <token>", challenge)
    if not is_admin_token(auth, config):
        log.warning("admin.bad_token", remote=request.remote, path=request.path)
        raise ApiError(401, "invalid admin token", challenge)


def _worker(request: web.Request):
    gw = request.app["gw"]
    wid = request.match_info["worker"]
    sup = gw.fleet.supervisors.get(wid) if gw.fleet else None
    if sup is None:
        raise ApiError(404, f"worker '{wid}' not found")
    return gw, sup


async def drain(request: web.Request) -> web.Response:
    _check_token(request)
    gw, sup = _worker(request)
    gw.fleet.operator_drain(sup.id)
    return _json({"worker": sup.id, "draining": True, "busy": gw.dispatcher.workers[sup.id].busy})


async def undrain(request: web.Request) -> web.Response:
    _check_token(request)
    gw, sup = _worker(request)
    now = gw.fleet.operator_undrain(sup.id)
    # during a restart, it returns to rotation once the restart has it ready
    return _json({"worker": sup.id, "draining": not now, "restarting": not now})


async def _unless_stopping(gw, work: asyncio.Future, what: str):
    """``work``'s result, or ApiError 503 (``SHUTTING_DOWN_MESSAGE``) as soon as the gateway
    begins to stop: a restart or reload waits for a worker to start (up to its startup
    timeout), which the shutdown drain must not wait for, and which its end would cut with no
    answer at all (a fresh tester's admin restart during SIGTERM). ``work`` goes on; the stop
    cancels worker restarts (``Fleet.stop``)."""
    stopping = asyncio.ensure_future(gw.stopping.wait())
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    # a reload the stop cancelled (Reloader.cancel_all) is answered too, not cut off
    if work.done() and not work.cancelled():
        return work.result()
    raise ApiError(503, f"{SHUTTING_DOWN_MESSAGE}: the gateway began to stop before the {what} "
                        f"finished")


async def restart(request: web.Request) -> web.Response:
    _check_token(request)
    gw, sup = _worker(request)
    log.info("admin.restart", worker=sup.id)
    try:  # returns once ready (or failed, or past the startup timeout)
        await _unless_stopping(gw, asyncio.ensure_future(
            gw.fleet.restart_worker(sup.id, gw.config.shutdown.drain_s)), "restart")
    except KeyError:  # a reload removed it before this restart got to it
        cur = None
    else:
        cur = gw.fleet.supervisors.get(sup.id)  # a reload may have removed or replaced it
    if cur is None or sup.id in gw.fleet.retired:  # removed, or a reload is removing it
        raise ApiError(404, f"worker '{sup.id}' was removed by a config reload during its restart")
    proc = cur.process
    out = {"worker": cur.id, "state": worker_state(gw, cur), "detail": cur.detail_now,
           "pid": proc.pid if proc and proc.returncode is None else None,
           "draining": gw.fleet.draining(cur.id)}
    if not cur.ready:  # 200 read as success in scripts (`worker restart X && …`; a fresh
        # tester's find), as a reload whose worker does not start answers 400
        why = f"{out['state']}: {out['detail']}" if out["detail"] else out["state"]
        return _json({"error": f"worker {cur.id} is not ready after its restart ({why})",
                      **out}, 503)
    return _json(out)


async def reload(request: web.Request) -> web.Response:
    _check_token(request)
    # Its own task: a client that leaves mid-reload (aiohttp then cancels this handler) must
    # not stop the reload halfway, with some workers restarted and others not.
    task = request.app["gw"].reloader.spawn()  # kept while it runs, also after this handler
    res = await _unless_stopping(request.app["gw"], asyncio.shield(task), "reload")
    if not res.ok:
        what = "config not fully applied: " if res.rolled_back else "config not reloaded: "
        return _json({"error": what + "; ".join(res.errors), **res.as_dict()}, 400)
    return _json(res.as_dict())


def routes() -> list[web.RouteDef]:
    return [web.get("/gateway/api/workers", workers), web.get("/metrics", metrics),
            web.post("/gateway/api/admin/workers/{worker}/drain", drain),
            web.post("/gateway/api/admin/workers/{worker}/undrain", undrain),
            web.post("/gateway/api/admin/workers/{worker}/restart", restart),
            web.post("/gateway/api/admin/reload", reload)]
