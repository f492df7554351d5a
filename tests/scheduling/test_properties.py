"""Property tests of the dispatcher (hypothesis): random interleavings of submit, release,
cancel, expire, polled load, readiness changes, operator drains and crash-loop failures keep
the invariants, with tickets of one slot and multi-slot tickets (a ``/v1`` request with ``n``
choices holds ``n`` slots of one worker), with and without the affinity wait (delay
scheduling: no ticket waits for its prefix's worker beyond ``WAIT_MAX_S``). First tokens,
second releases and first tokens after release, and per-slot contexts read back anew keep every
worker counter (``busy``, ``prefill_backlog``, ``kv_reserved``) equal to its sum over the
worker's leases."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.scheduling import (Dispatcher, QueueFull, Ticket, TooManySlots, Unavailable, WorkerLoad,
                                make_scorer)
from gateway.scheduling.scorer import POLICIES

# Slots a submitted ticket takes: mostly one, sometimes n = 2..4 choices (4 exceeds every worker).
ticket_slots = st.sampled_from([1, 1, 1, 2, 3, 4])
ops = st.lists(st.tuples(st.sampled_from(["submit", "release", "cancel", "tick", "load",
                                          "down", "up", "fail", "unfail", "hold", "unhold",
                                          "first", "again", "ctx", "check", "uncheck"]),
                         st.integers(0, 1000), st.integers(0, 3), ticket_slots), max_size=120)
# Fleet trouble often: every worker failed or held while tickets wait (refusals happen).
trouble_ops = st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "release", "tick",
                                                  "down", "up", "fail", "fail", "unfail",
                                                  "hold", "unhold", "first", "again",
                                                  "check", "uncheck"]),
                                 st.integers(0, 1000), st.integers(0, 1), ticket_slots),
                       max_size=120)

# Stall checks often: workers under check beside steady ones while tickets come and go.
check_ops = st.lists(st.tuples(st.sampled_from(["submit", "submit", "release", "check", "check",
                                                "uncheck", "tick", "down", "up", "hold"]),
                               st.integers(0, 1000), st.integers(0, 2), ticket_slots),
                     max_size=80)


WAIT_MAX_S = 1.5
waits = st.sampled_from([0.0, 0.0, 500.0, 5000.0])  # ms per 1,000 tokens held (0: off)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@settings(max_examples=150, deadline=None)
@given(ops=ops, policy=st.sampled_from(POLICIES), slots=st.lists(st.integers(1, 3), min_size=1,
       max_size=3), max_pending=st.integers(0, 6), unified=st.booleans(), wait=waits)
def test_invariants(ops, policy, slots, max_pending, unified, wait):
    run_invariants(ops, policy, slots, max_pending, unified, wait)


@settings(max_examples=150, deadline=None)
@given(ops=trouble_ops, policy=st.sampled_from(POLICIES),
       slots=st.lists(st.integers(1, 2), min_size=1, max_size=2), max_pending=st.integers(2, 6),
       wait=waits)
def test_invariants_with_failed_and_drained_fleets(ops, policy, slots, max_pending, wait):
    """Crash-loop failures and operator drains of the whole fleet while tickets wait: a ticket
    is refused only when no worker can take it, and then none is left waiting."""
    outcome = run_invariants(ops, policy, slots, max_pending, False, wait)
    assert set(outcome.values()) <= {"dispatched", "rejected", "cancelled", "expired", "refused",
                                     "too_many"}


@settings(max_examples=150, deadline=None)
@given(ops=check_ops, policy=st.sampled_from(POLICIES),
       slots=st.lists(st.integers(1, 3), min_size=2, max_size=3), wait=waits)
def test_invariants_with_stall_checks(ops, policy, slots, wait):
    """Workers under stall check (``Dispatcher.set_checking``): no ticket is leased to one
    while a worker of the model that is not under check is in rotation with the slots for it
    (``run_invariants`` checks each lease), and every ticket still ends."""
    run_invariants(ops, policy, slots, 6, False, wait)


def run_invariants(ops, policy, slots, max_pending, unified, wait=0.0) -> dict:
    """Apply ``ops`` to a dispatcher of ``slots`` workers, checking the invariants after every
    step; then end every ticket. ``wait``: the affinity wait in ms per 1,000 tokens held.
    Returns each ticket's outcome by sequence number."""
    clock = Clock()
    scorer = make_scorer(policy, seed=0, affinity_wait_ms_per_1k_tokens=wait,
                         affinity_wait_max_s=WAIT_MAX_S)
    d = Dispatcher(clock, max_pending=max_pending, scorer=scorer, aging_s=1.0)
    for i, s in enumerate(slots):
        d.add_worker(f"w{i}", "m", s, n_ctx=400, kv_capacity=400 if unified else 400 * s)
        d.set_ready(f"w{i}", True)
    live, queued, outcome = [], set(), {}
    gone = []  # released leases: released again, or given a first token, they count nothing
    seen_dispatch = set()

    def steady_passed_over(lease) -> bool:
        """A lease on a worker under stall check while a worker of the model not under check
        was in rotation with the slots for it (it should have waited for that one)."""
        return lease.worker.checking and any(
            w.in_rotation and not w.checking and w.slots >= lease.slots
            for w in d.workers.values())

    def took(dispatches):
        for tk, lease in dispatches:
            assert tk in queued, "dispatched a ticket that was not queued"
            assert not steady_passed_over(lease), "leased a worker under stall check"
            assert tk.seq not in seen_dispatch, "dispatched twice"
            assert not lease.worker.failed and not lease.worker.held, "leased a failed/held worker"
            assert lease.slots == tk.slots
            seen_dispatch.add(tk.seq)
            queued.discard(tk)
            outcome[tk.seq] = "dispatched"
            live.append(lease)

    n = 0
    for op, a, b, k in ops:
        if op == "submit":
            n += 1
            shared = a % 3 != 0  # most tickets share a prefix, so affinity and its index run
            tk = Ticket(request_id=str(n), model="m", priority=b, est_tokens=a % 450,
                        queue_timeout_s=5.0 if a % 2 else None,
                        prefix_key=a % 5 if shared else None,
                        prefix_chain=((a % 5, 100), (a % 11, 100 + a % 300)) if shared else (),
                        prefill_tokens=a % 7 * 50, slots=k)
            try:
                lease = d.submit(tk)
            except QueueFull:
                outcome[tk.seq] = "rejected"
            except TooManySlots:
                assert k > max(slots), "refused a ticket that some worker has the slots for"
                outcome[tk.seq] = "too_many"
            except Unavailable:
                assert d.refusal("m") is not None, "refused while a worker could take it"
                outcome[tk.seq] = "refused"
            else:
                if lease is None:
                    queued.add(tk)
                else:
                    assert not lease.worker.failed and not lease.worker.held
                    assert not steady_passed_over(lease), "leased a worker under stall check"
                    assert lease.slots == k
                    seen_dispatch.add(tk.seq)
                    outcome[tk.seq] = "dispatched"
                    live.append(lease)
        elif op == "release" and live:
            lease = live.pop(a % len(live))
            took(lease.release())
            gone.append(lease)
        elif op == "again" and gone:
            lease = gone[a % len(gone)]
            assert lease.release() == []  # the lease's guard: nothing given back twice
            if b % 2:
                lease.first_token()  # its prefill left the backlog on release already
        elif op == "first" and live:
            live[a % len(live)].first_token()  # sometimes a lease's second first token
        elif op == "ctx":  # the per-slot context read back anew (0: unknown, nothing capped)
            took(d.set_context(f"w{b % len(slots)}", (0, 150, 400)[a % 3]))
        elif op == "cancel" and queued:
            tk = sorted(queued, key=lambda x: x.seq)[a % len(queued)]
            assert d.cancel(tk)
            queued.discard(tk)
            outcome[tk.seq] = "cancelled"
        elif op == "tick":
            clock.t += b + 0.5
            for tk in d.expire():
                queued.discard(tk)
                outcome[tk.seq] = "expired"
            took(d.pump())
        elif op == "load":
            w = f"w{b % len(slots)}"
            took(d.update_load(w, WorkerLoad(at=clock.t, processing=a % 5, kv_tokens=a % 500,
                                             deferred=a % 2)))
        elif op in ("check", "uncheck"):  # a stall check of the worker starts or passes
            took(d.set_checking(f"w{b % len(slots)}", op == "check"))
        elif op in ("down", "up"):
            took(d.set_ready(f"w{b % len(slots)}", op == "up"))
        elif op in ("fail", "unfail", "hold", "unhold"):
            w = f"w{b % len(slots)}"
            if op in ("fail", "unfail"):  # the supervisor gave up restarting it, or tries again
                took(d.set_failed(w, op == "fail", retry_at=clock.t + a % 7 if a % 3 else None))
            else:  # the operator's drain (admin API)
                took(d.set_draining(w, op == "hold", held=True))
            for tk, why in d.drop_refused():  # what Admission does after each fleet change
                assert tk in queued and isinstance(why, Unavailable) and why.status == 503
                queued.discard(tk)
                outcome[tk.seq] = "refused"
        # invariants after every step
        for w in d.workers.values():
            assert 0 <= w.busy <= w.slots
            assert w.busy == sum(l.slots for l in live if l.worker is w)
            assert w.leases == {l for l in live if l.worker is w}
            # each counter matches its sum over the worker's leases
            assert w.busy == sum(l.slots for l in w.leases)
            assert w.prefill_backlog == sum(l.ticket.prefill_tokens for l in w.leases
                                            if l.prefilling) >= 0
            cap = w.n_ctx
            assert w.kv_reserved == sum((min(l.ticket.est_tokens, cap) if cap else
                                         l.ticket.est_tokens) * l.slots for l in w.leases) >= 0
            assert 0 <= w.free <= w.slots
            assert 0 <= w.phantom <= w.slots
            if w.failed:
                assert w.free == 0  # never leased, whatever readiness says
        assert len(d.queue) <= max_pending
        assert set(d.queue) == queued
        for tk in d.queue:  # an affinity wait never runs past its bound
            if tk.held_until is not None:
                assert tk.held_until <= tk.enqueued_at + WAIT_MAX_S + 1e-9
        if queued:  # nothing waits for a model that no worker can take
            assert d.refusal("m") is None
    # drain: bring everything up, release all, let time pass -> every admitted ticket ends
    for i in range(len(slots)):
        took(d.set_failed(f"w{i}", False))
        took(d.set_draining(f"w{i}", False))
        took(d.set_ready(f"w{i}", True))
        took(d.update_load(f"w{i}", WorkerLoad()))
    for _ in range(10_000):
        if not live and not queued:
            break
        if live:
            took(live.pop(0).release())
        else:
            clock.t += 1.0
            for tk in d.expire():
                queued.discard(tk)
                outcome[tk.seq] = "expired"
            took(d.pump())
    assert not queued, "a ticket was left in the queue with every slot free"
    assert all((w.busy, w.prefill_backlog, w.kv_reserved) == (0, 0, 0) for w in d.workers.values())
    assert len(outcome) == n
    return outcome


@settings(max_examples=60, deadline=None)
@given(prios=st.lists(st.integers(0, 5), min_size=5, max_size=40))
def test_aging_no_starvation(prios):
    """A priority-0 ticket under a steady stream of higher-priority arrivals is served within
    (max priority + 1) * aging_s of waiting."""
    clock = Clock()
    d = Dispatcher(clock, max_pending=1000, aging_s=1.0)
    d.add_worker("w0", "m", 1)
    d.set_ready("w0", True)
    lease = d.submit(Ticket("busy", "m"))
    low = Ticket("low", "m", priority=0)
    assert d.submit(low) is None
    served_at = None
    for i, p in enumerate(prios * 10):
        clock.t += 0.25
        d.submit(Ticket(f"h{i}", "m", priority=max(p, 1)))
        (tk, lease), = lease.release()
        if tk is low:
            served_at = clock.t
            break
    assert served_at is not None and served_at <= (max(prios + [1]) + 1) * 1.0 + 0.5


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(2, 4), data=st.data())
def test_multi_slot_ticket_not_starved(slots, data):
    """A ticket of ``k`` slots waiting on a worker whose slots are never all free at once (single
    slot tickets keep arriving and overlapping) is passed by them only until it has waited
    ``aging_s``; then the worker drains for it and it is served, and no lease ever oversubscribes
    the worker."""
    k = data.draw(st.integers(2, slots))
    clock = Clock()
    d = Dispatcher(clock, max_pending=1000, aging_s=1.0)
    d.add_worker("w0", "m", slots)
    d.set_ready("w0", True)
    live = [d.submit(Ticket(f"s{i}", "m")) for i in range(slots)]
    big = Ticket("big", "m", slots=k)
    assert d.submit(big) is None
    served_at = None
    for i in range(200):
        clock.t += 0.25
        d.submit(Ticket(f"n{i}", "m"))
        for tk, lease in live.pop(0).release():
            assert d.workers["w0"].busy <= slots
            if tk is big:
                served_at = clock.t
            else:
                live.append(lease)
        if served_at is not None:
            break
    assert served_at is not None and served_at <= 1.0 + 0.25 * (slots + 1)


@settings(max_examples=80, deadline=None)
@given(turns=st.integers(2, 12), wait=st.floats(1.0, 5000.0), max_s=st.floats(0.01, 3.0),
       arrivals=st.lists(st.floats(0.0, 0.5), max_size=20))
def test_affinity_wait_is_bounded(turns, wait, max_s, arrivals):
    """A chat turn whose worker stays busy waits for it at most its bound (held tokens × the
    wait per token, at most ``max_s``): pumped at ``next_wakeup``, as the live gateway's timer
    does, it goes to the free worker then, and requests without a prefix arriving meanwhile are
    never held behind it."""
    clock = Clock()
    d = Dispatcher(clock, max_pending=1000, aging_s=1.0,
                   scorer=make_scorer("least_loaded", affinity_wait_ms_per_1k_tokens=wait,
                                      affinity_wait_max_s=max_s))
    for i in range(2):
        d.add_worker(f"w{i}", "m", 1)
        d.set_ready(f"w{i}", True)
    chain = ((1, 500),) + tuple(((1, 7, i), 500 + 600 * i) for i in range(1, turns + 1))
    first = d.submit(Ticket("turn1", "m", prefix_key=1, prefix_chain=chain[:turns]))
    assert first.worker.id == "w0"
    nxt = Ticket("next", "m", prefix_key=1, prefix_chain=chain)
    bound = min(max_s, chain[turns - 1][1] * wait / 1e6)
    assert d.submit(nxt) is None
    for i, dt in enumerate(sorted(a for a in arrivals if a < bound)):
        clock.t = dt
        other = d.submit(Ticket(f"o{i}", "m"))
        assert other is not None and other.worker.id == "w1"  # no head-of-line blocking
        assert other.release() == []  # still in its wait: w1's free slot does not take it
    at = d.next_wakeup()
    assert at is not None and at <= bound + 1e-9
    clock.t = at
    got = next(lease for tk, lease in d.pump() if tk is nxt)
    assert got.worker.id == "w1" and clock.t <= bound + 1e-9
    assert first.worker.busy == 1
