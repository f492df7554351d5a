"""Unit tests of the pure dispatcher: slot bound, queue bound, FIFO hand-off, cancel, expiry."""

import pytest

from gateway.scheduling import (AllDrained, AllFailed, Dispatcher, ModelRemoved, NoWorkers,
                                NotStarted, QueueFull, Ticket, TooManySlots, Unavailable)


class FakeClock:
    """Injected clock (seconds); the only 'fake' here: the scheduler takes time as input."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def mk(n_workers=2, slots=2, max_pending=4, ready=True):
    clock = FakeClock()
    d = Dispatcher(clock, max_pending=max_pending)
    for i in range(n_workers):
        d.add_worker(f"w{i}", "demo:latest", slots)
        if ready:
            d.set_ready(f"w{i}", True)
    return d, clock


def t(i, model="demo:latest", **kw):
    return Ticket(request_id=f"r{i}", model=model, **kw)


def test_spreads_then_queues_then_rejects():
    d, _ = mk()
    leases = [d.submit(t(i)) for i in range(4)]
    assert all(leases)
    assert sorted(l.worker.id for l in leases) == ["w0", "w0", "w1", "w1"]
    # spread 1-1 before 2-2
    assert [l.worker.id for l in leases[:2]] == ["w0", "w1"]
    queued = [d.submit(t(10 + i)) for i in range(4)]
    assert queued == [None] * 4 and len(d.queue) == 4
    with pytest.raises(QueueFull):
        d.submit(t(99))
    assert len(d.queue) == 4
    assert all(w.busy == 2 for w in d.workers.values())


def test_release_hands_slot_to_oldest_waiter():
    d, clock = mk(max_pending=10)
    leases = [d.submit(t(i)) for i in range(4)]
    waiting = [t(10 + i) for i in range(3)]
    for w in waiting:
        clock.t += 0.001
        assert d.submit(w) is None
    freed = leases[3].worker
    out = leases[3].release()
    assert len(out) == 1
    ticket, lease = out[0]
    assert ticket is waiting[0] and lease.worker is freed
    (t2, _l2), = lease.release()  # the next waiter follows in arrival order
    assert t2 is waiting[1]
    assert leases[3].release() == []  # idempotent


def test_never_exceeds_slots_and_never_negative():
    d, _ = mk(n_workers=1, slots=3, max_pending=100)
    leases = []
    for i in range(50):
        l = d.submit(t(i))
        if l:
            leases.append(l)
        w = d.workers["w0"]
        assert 0 <= w.busy <= w.slots
    assert len(leases) == 3
    for l in leases:
        for _t, nl in l.release():
            leases.append(nl)
        l.release()
        assert 0 <= d.workers["w0"].busy <= 3


def test_not_ready_and_draining_get_nothing():
    d, _ = mk(ready=False, max_pending=10)
    assert d.submit(t(1)) is None
    assert d.workers["w0"].busy == 0
    out = d.set_ready("w0", True)
    assert len(out) == 1 and out[0][1].worker.id == "w0"
    d.set_draining("w1", True)
    d.set_ready("w1", True)
    l2 = d.submit(t(2))
    assert l2.worker.id == "w0"
    assert d.submit(t(3)) is None  # w0 full, w1 draining
    out = d.set_draining("w1", False)
    assert out and out[0][1].worker.id == "w1"


def test_all_drained_fails_fast_and_empties_the_queue_but_starting_workers_are_waited_for():
    d, _ = mk(max_pending=10)
    d.submit(t(1)), d.submit(t(2)), d.submit(t(3)), d.submit(t(4))
    queued = t(5)
    assert d.submit(queued) is None
    d.set_draining("w0", True, held=True)
    assert d.drop_refused() == []  # w1 is still in rotation
    d.set_draining("w1", True)  # a reload's drain: requests wait for the new worker
    assert d.drop_refused() == [] and len(d.queue) == 1
    d.set_draining("w1", True, held=True)
    (gone, why), = d.drop_refused()
    assert gone is queued and isinstance(why, AllDrained) and len(d.queue) == 0
    assert why.status == 503 and why.headers(2) == {"Retry-After": "2"}  # an undrain helps
    with pytest.raises(AllDrained, match="drained"):
        d.submit(t(6))
    d.set_draining("w0", False)
    d.set_ready("w0", False)  # restarting, not drained: requests wait for it
    assert d.submit(t(8)) is None


def test_a_retry_avoids_the_worker_it_failed_on_unless_nothing_else_is_free():
    d, _ = mk(n_workers=2, slots=1)
    first = d.submit(t(1, prefix_key=7))
    failed_on = first.worker.id
    first.release()
    retry = t(1, prefix_key=7, avoid=frozenset({failed_on}))
    other = d.submit(retry)
    assert other.worker.id != failed_on  # even against its prefix affinity
    assert d.submit(t(2, avoid=frozenset({other.worker.id}))).worker.id == failed_on
    assert d.submit(t(3, avoid=frozenset({failed_on}))) is None  # nothing free: it waits


def test_a_worker_under_stall_check_gets_work_only_when_no_other_is_in_rotation():
    """While a worker's stall check runs, new requests go to the model's other workers, or
    wait for one of them; the check's end (passed) hands the queue out again. A model whose
    only worker is under check still sends work to it (it fails fast if silent)."""
    d, _ = mk(n_workers=2, slots=2)
    assert d.set_checking("w0", True) == []
    a, b = d.submit(t(1)), d.submit(t(2))
    assert [a.worker.id, b.worker.id] == ["w1", "w1"]  # w0 has 2 free slots, but is checked
    queued = t(3)
    assert d.submit(queued) is None  # waits for w1 (or the check's end), not w0's free slots
    (got, lease), = d.set_checking("w0", False)  # passed: back in rotation, queue pumped
    assert got is queued and lease.worker.id == "w0"
    assert d.set_checking("w0", False) == [] and d.set_checking("nope", True) == []
    d.set_checking("w0", True)
    a.release()  # a slot of the steady worker frees: the queue goes there, not to w0
    c = d.submit(t(4))
    assert c.worker.id == "w1"
    # the steady worker leaves rotation: the worker under check is the model's last resort
    d.set_draining("w1", True)
    assert d.submit(t(5)).worker.id == "w0"
    # a model with one worker, under check: it still gets the work
    solo, _ = mk(n_workers=1, slots=1)
    solo.set_checking("w0", True)
    assert solo.submit(t(6)).worker.id == "w0"


def test_queue_wait_adds_up_the_attempts_of_a_retried_ticket():
    """A retry submits the same ticket again: ``queue_wait_s`` is the wait of every attempt
    that got a slot, plus the time so far while it waits again, never its time on a worker."""
    d, clock = mk(n_workers=2, slots=1)
    clock.t = 1.0
    blockers = [d.submit(t(i)) for i in range(2)]
    retried = t(9)
    assert d.submit(retried) is None
    clock.t = 3.0
    (_, lease), = blockers[0].release()
    assert lease.ticket is retried and retried.queue_wait_s(clock.t) == 2.0
    clock.t = 3.5  # its worker fails it before any byte: it is retried
    assert retried.queue_wait_s(clock.t) == 2.0
    lease.release()
    assert d.submit(t(10)) is not None  # takes the freed slot: the retry has to wait
    assert d.submit(retried) is None
    clock.t = 4.0
    assert retried.queue_wait_s(clock.t) == 2.5
    clock.t = 4.5
    (_, again), = blockers[1].release()
    assert again.ticket is retried and retried.queue_wait_s(9.0) == 3.0


def test_cancel_removes_from_queue():
    d, _ = mk(n_workers=1, slots=1)
    d.submit(t(1))
    q = t(2)
    assert d.submit(q) is None
    assert d.cancel(q) is True
    assert len(d.queue) == 0
    assert d.cancel(q) is False


def test_expire_after_queue_timeout():
    d, clock = mk(n_workers=1, slots=1)
    d.submit(t(1))
    q = t(2, queue_timeout_s=5)
    d.submit(q)
    clock.t = 4.9
    assert d.expire() == []
    clock.t = 5.0
    assert d.expire() == [q]
    assert len(d.queue) == 0


def test_max_pending_zero_rejects_when_full():
    d, _ = mk(n_workers=1, slots=1, max_pending=0)
    assert d.submit(t(1))
    with pytest.raises(QueueFull):
        d.submit(t(2))


def test_a_retried_ticket_is_admitted_again_past_max_pending():
    """A request whose worker failed before any answer byte is submitted again (the next
    attempt of Upstream.request) while the queue is full: the accepted request was answered
    503 "maximum pending requests exceeded" (a fresh tester's find, max_pending 1, a worker
    killed). It waits instead, and counts in the queue."""
    d, _ = mk(n_workers=2, slots=1, max_pending=1)
    d.submit(t(0))
    retried = t(1)
    lease = d.submit(retried)
    assert lease.worker.id == "w1" and retried.admitted
    assert d.submit(t(2)) is None  # the one queue place
    d.set_ready("w1", False)  # its worker went down under it
    lease.release()
    assert d.submit(retried) is None  # queued again, past the bound
    assert d.queue.requests() == 2
    with pytest.raises(QueueFull):  # new requests still are not
        d.submit(t(3))


def test_follow_on_tickets_wait_beyond_max_pending_and_do_not_count_there():
    """The inputs of an accepted embedding batch (``follow_on``) are never refused by a full
    queue, and they do not count in it: ``max_pending`` counts requests (Ollama's
    ``OLLAMA_MAX_QUEUE``; field case 2). They still get slots in order."""
    d, _ = mk(n_workers=1, slots=1, max_pending=2)
    first = d.submit(t(0))
    assert d.submit(t(1)) is None  # one request waits
    assert d.submit(t(3, follow_on=True)) is None and d.submit(t(5, follow_on=True)) is None
    assert len(d.queue) == 3 and d.queue.requests() == 1
    assert d.queue.depth_by_priority() == {0: 1}
    assert d.submit(t(4)) is None  # the second place: the inputs took none
    with pytest.raises(QueueFull):
        d.submit(t(6))
    nxt = first.release()
    assert [tk.request_id for tk, _ in nxt] == ["r1"]
    assert [tk.request_id for tk, _ in nxt[0][1].release()] == ["r3"]
    assert d.queue.requests() == 1 and len(d.queue) == 2  # r4 and the input r5


def test_priority_first_and_aging():
    d, clock = mk(n_workers=1, slots=1, max_pending=10)
    held = d.submit(t(0))
    low = t(1, priority=0)
    d.submit(low)
    clock.t = 1.0
    high = t(2, priority=1)
    d.submit(high)
    (first, lease), = held.release()
    assert first is high
    # low has now waited; a fresh high-priority ticket arriving much later loses to it
    clock.t = 30.0
    late_high = t(3, priority=1)
    d.submit(late_high)
    (nxt, _), = lease.release()
    assert nxt is low


def test_queued_model_does_not_jump_fifo_for_same_model():
    d, _ = mk(n_workers=1, slots=1, max_pending=10)
    l0 = d.submit(t(0))
    q1 = t(1)
    d.submit(q1)
    # slot frees and is immediately taken by q1, a newcomer must queue behind nobody
    (tk, _l), = l0.release()
    assert tk is q1


def test_other_models_not_blocked():
    clock = FakeClock()
    d = Dispatcher(clock, max_pending=10)
    d.add_worker("a", "a:latest", 1)
    d.add_worker("b", "b:latest", 1)
    d.set_ready("a", True)
    d.set_ready("b", True)
    assert d.submit(t(0, model="a:latest"))
    assert d.submit(t(1, model="a:latest")) is None
    lb = d.submit(t(2, model="b:latest"))
    assert lb and lb.worker.id == "b"


def test_phantom_ignores_slots_freed_after_the_poll():
    """A poll is up to one interval old: slots whose leases ended after it are not phantom load,
    but slots still busy in a poll taken after their release are (a cancelled request winding
    down in the worker)."""
    from gateway.scheduling import WorkerLoad

    d, clock = mk(n_workers=1, slots=4, max_pending=10)
    w = d.workers["w0"]
    leases = [d.submit(t(i)) for i in range(2)]
    clock.t = 1.0
    d.update_load("w0", WorkerLoad(at=1.0, processing=2))
    assert w.phantom == 0
    clock.t = 1.1
    for l in leases:
        l.release()
    assert w.busy == 0 and w.phantom == 0  # the 1.0 poll predates both releases
    d.update_load("w0", WorkerLoad(at=1.3, processing=1))  # one request still winding down
    assert w.phantom == 1


def test_every_worker_failed_refuses_at_once_with_the_next_try_as_retry_after():
    d, clock = mk(max_pending=10)
    leases = [d.submit(t(i)) for i in range(4)]
    queued = [t(10), t(11)]
    assert [d.submit(q) for q in queued] == [None, None]
    d.set_ready("w0", False)  # crashed ...
    d.set_failed("w0", True, retry_at=clock.t + 300)  # ... and the supervisor gave up
    assert d.drop_refused() == [] and len(d.queue) == 2  # w1 can still take them
    d.set_ready("w1", False)
    assert d.drop_refused() == []  # w1 is restarting (backoff, starting): requests wait
    clock.t = 10.4
    d.set_failed("w1", True, retry_at=clock.t + 30)
    gone = d.drop_refused()
    assert [g for g, _ in gone] == queued and len(d.queue) == 0
    assert all(isinstance(why, AllFailed) and why.status == 503 for _, why in gone)
    why = gone[0][1]
    assert why.headers(2) == {"Retry-After": "30"}  # w1's next start, the earliest one
    assert "every worker of it failed" in str(why) and "crash loop" in str(why)
    assert "worker restart" in str(why)
    with pytest.raises(AllFailed):
        d.submit(t(20))
    # leases taken before the failure stay valid; releasing them dispatches nothing
    assert all(l.release() == [] for l in leases)
    assert all(w.busy == 0 and w.free == 0 for w in d.workers.values())
    # the supervisor starts w1 again: requests wait for it, and run once it is ready
    d.set_failed("w1", False)
    waiting = t(21)
    assert d.submit(waiting) is None
    (tk, lease), = d.set_ready("w1", True)
    assert tk is waiting and lease.worker.id == "w1"


def test_failed_and_operator_drained_together_refuse_with_the_failed_text():
    d, clock = mk(max_pending=10)
    d.set_draining("w0", True, held=True)
    d.set_ready("w1", False)
    d.set_failed("w1", True, retry_at=None)  # no automatic start scheduled
    why = d.refusal("demo:latest")
    assert isinstance(why, AllFailed) and "1 of them drained by the operator" in str(why)
    assert why.headers(2) == {}  # nothing will bring it back by itself: no Retry-After
    d.set_draining("w0", False)  # the operator undrains w0: in rotation again
    assert d.refusal("demo:latest") is None
    assert d.submit(t(1)).worker.id == "w0"


def test_a_failed_worker_never_gets_a_lease_even_if_marked_ready():
    d, _ = mk(n_workers=1, slots=2, max_pending=10)
    d.set_failed("w0", True, retry_at=5.0)
    assert d.workers["w0"].ready is False and d.workers["w0"].free == 0
    d.set_failed("gone", True)  # a replaced worker's last report is ignored
    d.set_failed("w0", False)
    assert d.workers["w0"].retry_at is None and d.refusal("demo:latest") is None


def test_a_removed_model_is_refused_404_and_a_restart_is_not_a_removal():
    d, _ = mk(n_workers=1, slots=1, max_pending=10)
    d.submit(t(1))
    queued = t(2)
    assert d.submit(queued) is None
    d.remove_worker("w0")  # a restart: removed, then added again with nothing in between
    d.add_worker("w0", "demo:latest", 1)
    assert d.drop_refused() == [] and d.refusal("demo:latest") is None
    d.remove_worker("w0")  # a reload removed the model
    (gone, why), = d.drop_refused()
    assert gone is queued and isinstance(why, ModelRemoved)
    assert why.status == 404 and why.headers(2) == {}  # retrying cannot help
    assert str(why) == "model 'demo:latest' not found (removed from the gateway's config by a reload)"
    with pytest.raises(ModelRemoved):
        d.submit(t(3))
    assert isinstance(d.refusal("never-had-workers:latest"), NoWorkers)  # nothing planned here
    d.add_worker("w9", "demo:latest", 1)  # configured again
    assert d.submit(t(4)) is None


def test_a_model_is_refused_once_a_reload_retires_its_last_worker_before_it_stops():
    d, _ = mk(n_workers=2, slots=1, max_pending=10)
    running = [d.submit(t(1)), d.submit(t(2))]
    queued = t(3)
    assert d.submit(queued) is None
    d.retire("w0")  # w1 still serves the model: the queued request waits for it
    assert d.drop_refused() == [] and d.refusal("demo:latest") is None
    running[0].release()
    assert d.workers["w0"].free == 0  # a retiring worker takes no new lease
    d.retire("w1")  # the model's last worker: refused now, while both still drain
    (gone, why), = d.drop_refused()
    assert gone is queued and isinstance(why, ModelRemoved)
    with pytest.raises(ModelRemoved):
        d.submit(t(4))
    running[1].release()  # the leases of retiring workers stay valid until released
    assert d.workers["w1"].busy == 0


def test_a_model_without_any_planned_worker_is_refused_503_without_retry_after():
    d, _ = mk(n_workers=1, slots=1)
    with pytest.raises(NoWorkers) as e:
        d.submit(t(1, model="gpu-only:latest"))
    assert e.value.status == 503 and e.value.headers(2) == {}
    assert str(e.value).startswith("model 'gpu-only:latest' has no worker on this machine")
    assert d.submit(t(2)) is not None  # other models are not affected


def test_a_model_whose_added_workers_did_not_start_is_refused_503_with_the_reason():
    """A reload added the model, its worker did not start and was removed again
    (gateway.reload ``_check_added`` sets ``not_started``): 503 naming the reason, not 404
    "removed by a reload"; a worker of it added later clears it."""
    d, _ = mk(n_workers=1, slots=1)
    d.add_worker("n0", "new:latest", 1)
    d.not_started["new:latest"] = "failed: crash loop"
    d.retire("n0")
    with pytest.raises(NotStarted) as e:  # already while it drains
        d.submit(t(1, model="new:latest"))
    d.remove_worker("n0")
    why = d.refusal("new:latest")
    assert isinstance(why, NotStarted) and why.status == 503 and why.headers(2) == {}
    assert str(why) == ("model 'new:latest' has no running worker: the config reload that added "
                        "it could not start its worker (failed: crash loop); fix the config "
                        "and reload") == str(e.value)
    d.add_worker("n1", "new:latest", 1)
    assert d.refusal("new:latest") is None and "new:latest" not in d.not_started


def test_refusals_are_unavailable():
    assert issubclass(AllDrained, Unavailable) and issubclass(AllFailed, Unavailable)
    assert issubclass(ModelRemoved, Unavailable) and issubclass(NotStarted, Unavailable)


def test_a_multi_slot_ticket_takes_its_slots_on_one_worker_with_that_many_free():
    """``/v1`` with ``n`` choices: ``n`` slots of one worker, held and released together."""
    d, _ = mk(n_workers=2, slots=2, max_pending=4)
    one = d.submit(t(1))  # w0 now has 1 free slot, w1 has 2
    big = d.submit(t(2, slots=2))
    assert big is not None and big.worker is not one.worker and big.slots == 2
    assert big.worker.busy == 2 and big.worker.free == 0
    small = d.submit(t(3))  # fits the last free slot (w0), not the full worker
    assert small.worker is one.worker
    waiting = t(4, slots=2)
    assert d.submit(waiting) is None  # 1 + 1 slot free on two workers is not 2 on one
    assert one.release() == []  # w0 has 1 free slot, still not enough
    (tk, lease), = big.release()  # w1: 2 free at once
    assert tk is waiting and lease.worker.busy == 2 and lease.slots == 2
    assert d.workers["w0"].busy == 1


def test_a_multi_slot_ticket_counts_its_kv_in_every_slot():
    clock = FakeClock()
    d = Dispatcher(clock, max_pending=4)
    d.add_worker("w0", "m", 4, n_ctx=1000, kv_capacity=2000)  # unified KV: 4 slots share 2000
    d.set_ready("w0", True)
    first = d.submit(Ticket("a", "m", est_tokens=600, slots=2))
    assert first is not None and d.workers["w0"].kv_reserved == 1200
    assert d.submit(Ticket("b", "m", est_tokens=600, slots=2)) is None  # 1200 more > 800 free
    assert d.submit(Ticket("c", "m", est_tokens=400)) is None  # waits behind b (same model)
    out = first.release()
    assert [tk.request_id for tk, _ in out] == ["b", "c"]  # 1200 + 400 of 2000, 3 of 4 slots
    assert d.workers["w0"].busy == 3 and d.workers["w0"].kv_reserved == 1600


def test_more_slots_than_any_worker_has_is_refused_up_front():
    d, _ = mk(n_workers=2, slots=2)
    d.add_worker("big", "demo:latest", 4)
    with pytest.raises(TooManySlots) as e:
        d.check_fits(t(1, slots=5))
    assert (e.value.slots, e.value.max_slots) == (5, 4) and "at most 4" in str(e.value)
    with pytest.raises(TooManySlots):
        d.submit(t(2, slots=5))
    d.check_fits(t(3, slots=4))  # the 4-slot worker can take it (once it is ready)
    assert len(d.queue) == 0
    many = t(4, slots=6, prompts=3)  # a /v1/completions with 3 prompts and n = 2
    d.check_fits(many)  # accepted (llama-server takes any number of prompts) ...
    assert many.slots == 6  # (checking changes nothing)
    d.cut_slots(many)
    assert many.slots == 4  # ... holding the whole of the largest worker
    with pytest.raises(TooManySlots) as e:  # 2 prompts, n = 5: n alone is too many
        d.check_fits(t(5, slots=10, prompts=2))
    assert (e.value.slots, e.value.max_slots) == (5, 4)
    too_many = t(6, slots=10, prompts=2)
    d.cut_slots(too_many)  # not cut: check_fits refuses it
    assert too_many.slots == 10


def test_several_prompts_beyond_a_worker_wait_for_a_whole_worker_and_hold_it():
    d, _ = mk(n_workers=2, slots=2)
    a = d.submit(t(1))  # one slot of one worker
    assert a is not None
    lease = d.submit(t(2, slots=5, prompts=5))  # five prompts: capped to 2, the free worker
    assert lease is not None and lease.slots == 2 and lease.worker.id != a.worker.id
    third = t(3, slots=3, prompts=3)
    assert d.submit(third) is None and third.slots == 2  # waits: no worker is wholly free
    (got, held), = a.release()  # a's worker is wholly free now
    assert got is third and held.worker is a.worker and held.slots == 2
    assert len(d.queue) == 0 and a.worker.busy == 2 and lease.worker.busy == 2


def test_queued_tickets_that_no_longer_fit_are_dropped_with_why():
    """A reload that gives the model fewer slots or a shorter context than a waiting ticket
    needs: waiting could only end in the queue timeout (a fresh tester's find: a queued
    ``n = 2`` waited the whole ``queue.timeout_s`` after its model went to 1 slot, then got
    "try again", which could only fail). ``drop_refused`` takes them out with the 400's why."""
    from gateway.scheduling import TooLarge
    d, _ = mk(n_workers=1, slots=2, max_pending=8)
    for w in d.workers.values():
        w.n_ctx = 1000
    held = [d.submit(t(i)) for i in range(2)]
    assert all(held)
    two, big, small = t(10, slots=2), t(11, prompt_tokens=800), t(12, prompt_tokens=100)
    assert [d.submit(x) for x in (two, big, small)] == [None] * 3
    assert d.drop_refused() == []
    d.set_slots("w0", 1)
    d.set_context("w0", 500)
    gone = dict(d.drop_refused())
    assert set(gone) == {two, big} and list(d.queue) == [small]
    assert isinstance(gone[two], TooManySlots) and gone[two].max_slots == 1
    assert isinstance(gone[big], TooLarge) and gone[big].n_ctx == 500
