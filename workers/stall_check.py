"""Does a worker whose requests stalled still work? Asked before stalls restart it.

The watchdog sees requests that stall, not why: a request can make llama-server go silent for
itself alone (the pinned build never answered ``n`` ≥ 2 with an empty prompt), or the worker
can stop working for everyone. ``wedge_after_stalls`` stalls in a row used to restart the
worker either way, so a client could restart workers at will. Now the supervisor first runs
``check_worker`` (bounded by ``llama_server.liveness_timeout_s``); only a worker that fails it
is restarted. It runs after that streak, or after a single stall of a request that held the
worker's last free slot (``gateway.fleet.Fleet.note_stall``). Two reads, checked against the
pinned llama-server (llama.cpp ``0c1e570``, ``tools/server/``):

1. ``GET /lora-adapters`` answers 200. Its handler (``server-context.cpp``,
   ``get_lora_adapters``) posts a ``SERVER_TASK_TYPE_GET_LORA`` task and waits for the result.
   Tasks are run by the main loop between two ``update_slots`` passes
   (``server_queue::start_loop``), and while a decode runs by a helper thread
   (``yield_to_queue``) that takes only ``SERVER_TASK_TYPE_METRICS`` and ``SLOT_GET``:
   ``process_single_task`` declines every other task until the decode has returned. So this
   answer shows that the main loop went round (not frozen, not stuck inside a decode), which
   ``/slots`` and ``/metrics`` cannot show (they are answered during a decode that never
   returns), and ``/health`` even less (answered on the HTTP thread, no task). It needs no
   free slot: with every slot generating it is answered when the current decode step ends
   (measured on the demo model, 2 of 2 slots generating: 2–4 ms; the same worker under
   SIGSTOP answered nothing in 2 s). It reads the adapter list and changes nothing. A build without the route (404) fails the check: such a worker is
   restarted as before this check existed.
2. ``GET /slots``, read again every ``poll_s`` until one slot is idle (the worker can take a
   request now) or the busy slots' work moved between two reads (a slot's task id, prompt
   tokens processed or tokens decoded changed: work is being done or changing hands). Every
   slot busy with nothing moving until the deadline (a slot that never frees, so requests
   wait in llama-server forever: field case 10, "accepted but never scheduled") fails the
   check. A slot the stalled request held is freed once the gateway has closed that request
   (this build: about 0.5 s streamed, 2 s not), within the default 5 s bound. Checked with the
   one request-specific silence known in this build (``n`` 2, empty prompt, sent straight to
   a worker): once its client left, every slot was idle and ``/lora-adapters`` answered in
   1–2 ms, so that worker passes. So does a worker that never frees one slot of several while
   the others work (work moves): ``gateway.scheduling.slot_leaks`` finds that slot from the
   polled ``/slots`` and the gateway's leases, and the fleet restarts the worker.

3. With ``completion`` (the supervisor's checks always ask it), once ``/slots`` shows an
   idle slot: ``POST /completion`` of one token (:data:`PROBE_BODY`),
   which must be answered 200 within what is left of ``timeout_s``. A worker that accepts
   requests and never schedules them (its main loop and ``/slots`` answer, its slots look
   idle, the requests wait forever: field case 10, "accepted but never scheduled") passed
   steps 1 and 2 and kept every second request waiting ``first_byte_s`` (a fresh tester's
   find, with a wrapper in front of llama-server that held completions); with every worker of
   the model that way, each request waited 3 × ``first_byte_s`` for its 504, for good (another
   tester's). A request that silences a worker for itself alone (the pinned build's ``n`` 2
   with an empty prompt) leaves it answering this probe, so that worker is kept. The probe takes the
   idle slot for one decode step (milliseconds on the demo model); with every slot busy and
   moving the worker is working and no probe is sent.

``slots_work`` is the pure part of step 2; ``check_worker`` does the I/O.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from workers.telemetry import parse_slot

LORA_PATH = "/lora-adapters"

#: The one-token completion of step 3 (llama-server ``/completion``: one token generated, no
#: slot cache kept for it).
PROBE_BODY = {"prompt": "ok", "n_predict": 1, "cache_prompt": False, "stream": False}


def slots_work(slots: Any) -> frozenset | None:
    """What the busy slots of a ``/slots`` body (parsed JSON) are doing.

    Returns None when some slot is idle (the worker can take work), else a frozenset of
    ``(slot id, id_task, n_prompt_tokens_processed, n_decoded)`` per slot: two reads that
    differ show work moving. A body that is not a non-empty list of objects gives an empty
    frozenset (no idle slot, nothing moving)."""
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return frozenset()
    work = []
    for obj in slots:
        s = parse_slot(obj)
        if not s.busy:
            return None
        work.append((s.id, s.id_task, obj.get("n_prompt_tokens_processed"), s.n_decoded))
    return frozenset(work)


async def check_worker(http: aiohttp.ClientSession, url: str, headers: dict, timeout_s: float,
                       poll_s: float = 0.1, completion: bool = False) -> str | None:
    """Ask the worker at ``url`` whether it still works (module doc), within ``timeout_s`` s;
    ``completion``: also step 3 when a slot is idle.

    Returns None when it does, else why not (one line, for the wedge reason and the log).
    Never raises for the worker's failures (timeouts, refused connections, bad bodies)."""
    deadline = time.monotonic() + timeout_s
    asking = "its main loop (GET /lora-adapters)"
    first: frozenset | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(url + LORA_PATH, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=None)) as r:
                await r.read()
                if r.status != 200:
                    return f"{asking} answered HTTP {r.status}"
            asking = "GET /slots"
            while True:
                async with http.get(url + "/slots", headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=None)) as r:
                    if r.status != 200:
                        return f"{asking} answered HTTP {r.status}"
                    work = slots_work(await r.json(content_type=None))
                if work is None and completion:
                    asking = "a one-token completion (POST /completion) while a slot was idle"
                    async with http.post(url + "/completion", json=PROBE_BODY, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=None)) as r:
                        await r.read()
                        if r.status != 200:
                            return f"{asking} answered HTTP {r.status}"
                    return None
                if work is None or (first is not None and work != first):
                    return None
                if first is None:
                    first = work
                if time.monotonic() + poll_s >= deadline:
                    return f"every slot stayed busy with no progress for {timeout_s:g} s"
                await asyncio.sleep(poll_s)
    except TimeoutError:
        if first is not None:  # /slots answered, all busy; the deadline fell in a later poll
            return f"every slot stayed busy with no progress for {timeout_s:g} s"
        return f"{asking} did not answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return f"{asking} failed: {e}"
