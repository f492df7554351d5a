"""WorkerView's counters: ``busy``, ``prefill_backlog`` and ``kv_reserved`` are kept by
``hold`` / ``drop`` / ``prefilled`` and always equal the sums over its live leases; the lease
(``SlotLease``) is what makes a second release or first token count nothing."""

from gateway.scheduling import Dispatcher, Ticket, WorkerLoad


def test_counters_follow_leases_through_double_release_and_first_token():
    d = Dispatcher(lambda: 0.0, max_pending=4)
    d.add_worker("w0", "m", 4, n_ctx=500)
    d.set_ready("w0", True)
    w = d.workers["w0"]
    one = d.submit(Ticket("a", "m", prefill_tokens=100, est_tokens=300))
    three = d.submit(Ticket("b", "m", slots=3, prefill_tokens=40, est_tokens=900))
    assert w.busy == 4 == sum(l.slots for l in w.leases) and w.free == 0
    assert w.prefill_backlog == 140 and w.kv_reserved == 300 + 500 * 3  # capped at n_ctx
    three.first_token()
    three.first_token()  # the lease counts its first token once
    assert w.prefill_backlog == 100
    waiting = Ticket("c", "m", slots=2, prefill_tokens=7, est_tokens=10)
    assert d.submit(waiting) is None
    (got, two), = three.release()  # its 3 slots back: the waiting ticket gets 2 of them
    assert got is waiting
    assert three.release() == []  # idempotent: the lease gives its slots back once
    assert w.busy == 3 == sum(l.slots for l in w.leases) and w.free == 1
    assert w.prefill_backlog == 107 and w.kv_reserved == 300 + 10 * 2
    one.release()
    one.first_token()  # after release: already out of the backlog, counts nothing
    two.release()
    assert (w.busy, w.prefill_backlog, w.kv_reserved) == (0, 0, 0) and not w.leases


def test_kv_reserved_is_recounted_when_the_context_is_read_back():
    d = Dispatcher(lambda: 0.0, max_pending=4)
    d.add_worker("w0", "m", 2)  # per-slot context unknown: nothing capped
    d.set_ready("w0", True)
    w = d.workers["w0"]
    big = d.submit(Ticket("a", "m", est_tokens=900, slots=2))
    assert w.kv_reserved == 1800
    d.set_context("w0", 600)  # read back from /slots: each slot's share capped at 600
    assert w.kv_reserved == 1200
    big.release()  # gives back what it holds under the cap in force now
    assert w.kv_reserved == 0


def test_polled_kv_fill_of_released_requests_does_not_block_new_ones():
    """Found by a fresh tester: right after 4 long requests ended, the last poll (taken while
    they ran) still showed their KV fill, so a new burst found no headroom and was refused or
    queued with every slot free. The polled fill counts again from the next poll on."""
    now = [0.0]
    d = Dispatcher(lambda: now[0], max_pending=0)
    d.add_worker("w0", "m", 4, n_ctx=2048, kv_capacity=8192)
    d.set_ready("w0", True)
    leases = [d.submit(Ticket(f"r{i}", "m", est_tokens=1950)) for i in range(4)]
    now[0] = 1.0
    d.update_load("w0", WorkerLoad(at=1.0, processing=4, kv_tokens=7800))
    now[0] = 1.1
    for lease in leases:
        lease.release()
    w = d.workers["w0"]
    assert w.kv_used == 0 and w.free == 4
    again = [d.submit(Ticket(f"s{i}", "m", est_tokens=1950)) for i in range(4)]
    assert all(lease is not None for lease in again)  # max_pending 0: queued would be refused
    now[0] = 1.3  # a later poll counts again (e.g. requests the gateway did not send)
    d.update_load("w0", WorkerLoad(at=1.3, processing=4, kv_tokens=8000))
    assert w.kv_used == 8000


def test_all_slots_taken_counts_leases_and_slots_busy_beyond_them():
    """What the gateway asks when a request on a worker stalls, while it still holds its lease
    (``Fleet.note_stall``): True when that request held the worker's last free slot."""
    now = [0.0]
    d = Dispatcher(lambda: now[0], max_pending=4)
    d.add_worker("one", "m1", 1)
    d.add_worker("two", "m2", 2)
    for w in ("one", "two"):
        d.set_ready(w, True)
    one, two = d.workers["one"], d.workers["two"]
    assert not one.all_slots_taken and not two.all_slots_taken
    d.submit(Ticket("a", "m1"))
    assert one.all_slots_taken  # a single slot: a request on it holds the last one
    d.set_draining("one", True)
    assert one.all_slots_taken and one.free == 0  # rotation does not matter
    stalled = d.submit(Ticket("b", "m2"))
    assert stalled.worker is two and not two.all_slots_taken  # its other slot is free
    now[0] = 1.0  # a poll sees both slots of "two" busy: one of them leaked by an earlier stall
    d.update_load("two", WorkerLoad(at=1.0, processing=2))
    assert two.phantom == 1 and two.all_slots_taken
    now[0] = 1.1
    stalled.release()  # released after that poll: its slot is not counted as leaked
    assert two.phantom == 1 and not two.all_slots_taken
