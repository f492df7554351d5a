"""Gateway's own read-only status API under ``/gateway/api``.

``GET /gateway/api/workers`` → ``{"workers": [{id, model, state, detail, pid, port, gpus,
slots, busy, restarts, crashes, wedges, crash_loops, n_ctx_slot}], "queue": {"depth", "max_pending"}}``. Worker keys are never
shown.
"""

from __future__ import annotations

import orjson
from aiohttp import web


async def workers(request: web.Request) -> web.Response:
    gw = request.app["gw"]
    out = []
    for sup in gw.fleet.supervisors.values() if gw.fleet else ():
        view = gw.dispatcher.workers.get(sup.id)
        proc = sup.process
        out.append({
            "id": sup.id, "model": sup.spec.alias, "state": sup.state, "detail": sup.detail,
            "pid": proc.pid if proc and proc.returncode is None else None,
            "port": proc.port if proc else None, "gpus": list(sup.spec.gpus),
            "slots": view.slots if view else sup.spec.slots, "busy": view.busy if view else 0,
            "restarts": sup.restarts, "n_ctx_slot": sup.slots_n_ctx,
            "crashes": sup.crashes, "wedges": sup.wedges, "crash_loops": sup.crash_loops,
        })
    body = {"workers": out, "queue": {"depth": len(gw.dispatcher.queue),
                                      "max_pending": gw.dispatcher.max_pending}}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def routes() -> list[web.RouteDef]:
    return [web.get("/gateway/api/workers", workers)]
