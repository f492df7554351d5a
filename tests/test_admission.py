"""Admission (the live wrapper around the dispatcher): queued requests are answered at once, with
why, when no worker can take them any more; they keep waiting while one is starting."""

import asyncio
import time

import pytest

from gateway.admission import Admission, QueueTimeout
from gateway.scheduling import (AllDrained, AllFailed, Dispatcher, ModelRemoved, ShuttingDown,
                                Ticket, make_scorer)

M = "demo:latest"


def admission(n_workers=1, slots=1) -> Admission:
    d = Dispatcher(time.monotonic, max_pending=10)
    for i in range(n_workers):
        d.add_worker(f"w{i}", M, slots)
        d.set_ready(f"w{i}", True)
    return Admission(d, expire_interval_s=0.05)


def ticket(i: int, timeout_s: float | None = 30.0) -> Ticket:
    return Ticket(request_id=f"r{i}", model=M, queue_timeout_s=timeout_s)


async def queued(adm: Admission, n: int) -> list[asyncio.Task]:
    """``n`` acquires that wait in the queue (every slot is taken first)."""
    tasks = [asyncio.create_task(adm.acquire(ticket(100 + i))) for i in range(n)]
    await asyncio.sleep(0.01)
    assert len(adm.dispatcher.queue) == n and not any(t.done() for t in tasks)
    return tasks


async def one_busy_worker(n_queued: int):
    """An admission with one worker of one slot, leased, and ``n_queued`` acquires waiting:
    (admission, the lease, the waiting tasks)."""
    adm = admission()
    lease = await adm.acquire(ticket(0))
    return adm, lease, await queued(adm, n_queued)


async def test_queued_requests_get_all_failed_when_the_last_worker_fails_not_before():
    adm = admission(n_workers=2)
    busy = [await adm.acquire(ticket(i)) for i in range(2)]
    waiting = await queued(adm, 2)
    adm.worker_ready("w0", False)
    adm.worker_failed("w0", True, time.monotonic() + 300)
    adm.worker_ready("w1", False)  # crashed; the supervisor restarts it (backoff): they wait
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in waiting)
    t0 = time.monotonic()
    adm.worker_failed("w1", True, time.monotonic() + 120)
    for t in waiting:
        with pytest.raises(AllFailed) as e:
            await t
        assert e.value.headers(2) == {"Retry-After": "120"}
    assert time.monotonic() - t0 < 0.5 and len(adm.dispatcher.queue) == 0
    with pytest.raises(AllFailed):  # new requests: refused at once
        await adm.acquire(ticket(9))
    for lease in busy:
        adm.release(lease)
    # the supervisor (or an admin restart) starts w1 again: accepted and served when ready
    adm.worker_failed("w1", False)
    later = asyncio.create_task(adm.acquire(ticket(10)))
    await asyncio.sleep(0.01)
    assert not later.done()
    adm.worker_ready("w1", True)
    lease = await asyncio.wait_for(later, 1)
    assert lease.worker.id == "w1"
    adm.release(lease)
    adm.close()


async def test_operator_drain_still_fails_fast():
    adm, lease, (waiting,) = await one_busy_worker(1)
    adm.worker_draining("w0", True, held=True)
    with pytest.raises(AllDrained):
        await waiting
    adm.release(lease)
    adm.close()


async def test_shut_down_answers_queued_and_later_requests_with_the_shutdown_text():
    adm, lease, waiting = await one_busy_worker(2)
    assert adm.shut_down() == 2
    for t in waiting:
        with pytest.raises(ShuttingDown, match="server shutting down, please try again"):
            await t
    with pytest.raises(ShuttingDown):
        await adm.acquire(ticket(5))
    assert isinstance(adm.refusal(M), ShuttingDown)
    assert ShuttingDown(M).status == 503 and ShuttingDown(M).headers(2) == {"Retry-After": "2"}
    adm.release(lease)
    adm.close()


async def test_queued_requests_of_a_removed_model_get_404_after_the_reload():
    adm, lease, (waiting,) = await one_busy_worker(1)
    adm.worker_draining("w0", True)  # the reload drains the removed worker: they still wait
    await asyncio.sleep(0.05)
    assert not waiting.done()
    adm.release(lease)
    adm.dispatcher.remove_worker("w0")
    adm.refuse_queued()  # as the reload does once its workers are retired
    with pytest.raises(ModelRemoved) as e:
        await waiting
    assert e.value.status == 404 and "removed" in str(e.value)
    adm.close()


async def test_queue_timeout_is_unchanged_while_workers_are_starting():
    adm = admission()
    adm.worker_ready("w0", False)  # starting: not failed, not drained
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout):
        await adm.acquire(ticket(1, timeout_s=0.2))
    assert 0.2 <= time.monotonic() - t0 < 1.0
    adm.close()


async def test_an_affinity_wait_ends_on_time_without_a_release():
    """A chat turn waiting for the busy worker that holds its prefix (delay scheduling) gets the
    free worker when its wait ends, woken by the dispatcher's ``next_wakeup``, not by the next
    release or the (here one-minute) expiry check."""
    d = Dispatcher(time.monotonic, max_pending=10,
                   scorer=make_scorer("least_loaded", affinity_wait_ms_per_1k_tokens=100.0))
    for i in range(2):
        d.add_worker(f"w{i}", M, 1)
        d.set_ready(f"w{i}", True)
    adm = Admission(d, expire_interval_s=60.0)
    chain = ((1, 500), (2, 1100), (3, 1700))
    turn1 = await adm.acquire(Ticket("turn1", M, prefix_key=1, prefix_chain=chain[:2]))
    assert turn1.worker.id == "w0"
    t0 = time.monotonic()
    nxt = await asyncio.wait_for(adm.acquire(Ticket("turn2", M, prefix_key=1, prefix_chain=chain)),
                                 timeout=5.0)
    waited = time.monotonic() - t0
    assert nxt.worker.id == "w1" and 0.09 <= waited < 1.0  # 1,100 tokens × 0.1 ms = 0.11 s
    adm.release(nxt)
    adm.release(turn1)
    adm.close()
