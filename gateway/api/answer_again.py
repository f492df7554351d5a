"""Answer again: a request whose worker's answer broke off before anything reached its client
runs once more on another worker of its model (Ollama and ``/v1`` routes alike).

The client got a 502 although another worker was idle (a fresh tester's find). Only once: a
request that crashes workers then takes down two, as the retry rule of ``Upstream.request``
allows; never on the same worker, and not while the gateway stops.
"""

from __future__ import annotations

from aiohttp import web

from gateway.logs import get_logger
from gateway.upstream import UpstreamError

log = get_logger("gateway.api.answer_again")

#: Upstream failures after a worker began an answer that a request nothing was written for
#: yet is sent again for: its worker went down (crash, wedge, a restart whose drain ran out)
#: or its connection broke mid-answer.
ANSWER_AGAIN_KINDS = ("worker_down", "stream_broken")


def answer_again(gw, ticket, failure: UpstreamError, request: web.Request) -> bool:
    """Whether the request of ``ticket``, whose answer broke off with ``failure`` before
    anything of it reached the client (the caller's check), runs again: on another worker of
    its model in rotation, one not in ``ticket.avoid``. When it does, the failed worker
    (``request["worker"]``) joins ``ticket.avoid`` and ``upstream.answer_again`` is logged
    (``request_id``, ``worker``, ``reason``)."""
    wid = request.get("worker")
    if failure.kind not in ANSWER_AGAIN_KINDS or wid is None or gw.admission.shutting_down:
        return False
    if not any(w.model == ticket.model and w.id != wid and w.id not in ticket.avoid
               and w.in_rotation for w in gw.dispatcher.workers.values()):
        return False
    ticket.avoid = ticket.avoid | {wid}
    log.warning("upstream.answer_again", request_id=ticket.request_id, worker=wid,
                reason=failure.message)
    return True
