"""Scorer and KV-headroom unit tests (pure scheduling objects, injected clock)."""

import pytest

from gateway.scheduling import Dispatcher, Ticket, TooLarge, WorkerLoad, make_scorer
from gateway.scheduling.scorer import LeastLoaded, keep_prefix_index, rendezvous_rank


def mk(policy="least_loaded", n=2, slots=4, n_ctx=0, kv=0, **kw):
    clock = lambda: 0.0  # noqa: E731
    d = Dispatcher(clock, max_pending=100, scorer=make_scorer(policy, **kw))
    for i in range(n):
        d.add_worker(f"w{i}", "m", slots, n_ctx=n_ctx, kv_capacity=kv)
        d.set_ready(f"w{i}", True)
    return d


def t(i=0, **kw):
    return Ticket(request_id=f"r{i}", model="m", **kw)


def test_least_loaded_prefers_free_slots_then_order():
    d = mk(affinity=False)
    ws = [d.submit(t(i)).worker.id for i in range(4)]
    assert ws == ["w0", "w1", "w0", "w1"]


def test_phantom_and_deferred_steer_away():
    d = mk(affinity=False)
    d.update_load("w0", WorkerLoad(processing=2, deferred=1))  # busy slots the gateway doesn't hold
    assert d.workers["w0"].phantom == 2 and d.workers["w0"].free == 4  # free is lease-based
    assert d.submit(t()).worker.id == "w1"


def test_speed_weights_choice():
    d = mk(affinity=False)
    d.set_speed("w1", 3.0)
    ws = [d.submit(t(i)).worker.id for i in range(4)]
    assert ws.count("w1") == 3  # a 3x faster worker takes 3 of 4


def test_prefill_backlog_steers_to_the_worker_already_decoding():
    """Equal occupancy: the new request goes to the worker whose request already has its first
    token, not to the one still computing a long prompt; after that first token the tie is
    broken by fleet order again."""
    d = mk(affinity=False, n_ctx=4096)
    long_prompt = d.submit(t(0, prefill_tokens=3000))
    short = d.submit(t(1, prefill_tokens=20))
    assert (long_prompt.worker.id, short.worker.id) == ("w0", "w1")
    short.first_token()
    assert d.workers["w0"].prefill_backlog == 3000 and d.workers["w1"].prefill_backlog == 0
    assert d.submit(t(2, prefill_tokens=20)).worker.id == "w1"
    long_prompt.first_token()
    assert d.workers["w0"].prefill_backlog == 0
    assert d.submit(t(3, prefill_tokens=20)).worker.id == "w0"  # 2-2 now: order decides


def test_prefill_backlog_ignored_without_context_or_weight():
    for kw in ({"n_ctx": 0}, {"n_ctx": 4096, "prefill_weight": 0.0}):
        d = mk(affinity=False, **kw)
        d.submit(t(0, prefill_tokens=3000))
        d.submit(t(1, prefill_tokens=20)).first_token()
        assert d.submit(t(2, prefill_tokens=20)).worker.id == "w0", kw  # fleet order


def test_kv_headroom_excludes_full_worker_and_queue_waits():
    # unified KV: 2 slots share 1000 tokens; a 600-token request fits only one at a time
    d = mk(n=2, slots=2, n_ctx=1000, kv=1000, affinity=False)
    a = d.submit(t(1, est_tokens=600))
    b = d.submit(t(2, est_tokens=600))
    assert a.worker is not b.worker
    c = d.submit(t(3, est_tokens=600))
    assert c is None and len(d.queue) == 1  # free slots exist, but no KV headroom
    small = d.submit(t(4, est_tokens=100))  # a small one still fits (queue holds only big)
    assert small is None  # FIFO per model: it waits behind
    out = a.release()
    assert [tk.request_id for tk, _ in out][0] == "r3"


def test_polled_kv_fill_counts():
    d = mk(n=2, slots=2, n_ctx=1000, kv=1000, affinity=False)
    d.update_load("w0", WorkerLoad(processing=0, kv_tokens=900))
    assert not d.workers["w0"].fits(t(est_tokens=200))
    assert d.submit(t(est_tokens=200)).worker.id == "w1"


def test_too_large_prompt_refused_up_front():
    d = mk(n=2, slots=2, n_ctx=512)
    with pytest.raises(TooLarge) as e:
        d.submit(t(prompt_tokens=600))
    assert e.value.n_ctx == 512
    assert d.submit(t(prompt_tokens=100)) is not None


def conv(n_turns, sys_key=1, conv_id=7):
    """Prefix chain of a chat: system prompt (500 tokens), then 600 tokens per later message."""
    return ((sys_key, 500),) + tuple(((sys_key, conv_id, i), 500 + 600 * i) for i in range(1, n_turns))


def test_cold_prefix_goes_by_load_with_rendezvous_ties():
    d = mk(n=4, slots=4)
    ws = list(d.workers.values())
    home = rendezvous_rank(12345, ws)[0]
    assert d.submit(t(1, prefix_key=12345)).worker is home  # idle fleet: the tie goes home
    d2 = mk(n=4, slots=4)
    busy = d2.submit(t(0)).worker  # w0 busy
    assert d2.submit(t(1, prefix_key=999)).worker is not busy  # a cold key costs no load


def test_next_turn_follows_the_previous_turn_even_to_a_non_home_worker():
    d = mk(n=4, slots=8)
    hold = [d.submit(t(90 + i)) for i in range(2)]  # one busy slot on w0 and on w1
    first = d.submit(t(1, prefix_key=1, prefix_chain=conv(2), est_tokens=1200))
    assert first.worker.busy == 1  # placed by load
    first.release()
    # load the other workers a little: the turn still goes where turn 1 ran
    extra = [d.submit(t(100 + i)) for i in range(4)]
    nxt = d.submit(t(2, prefix_key=1, prefix_chain=conv(3), est_tokens=1800))
    assert nxt.worker is first.worker
    assert first.worker.id in ("w2", "w3") and hold and extra


def test_load_allowance_grows_with_the_tokens_held():
    d = mk(n=2, slots=8)
    w0, w1 = d.workers["w0"], d.workers["w1"]
    sc = d.scorer
    sc.index.record("w0", conv(4), tokens=2500, capacity=100_000)  # w0 holds 2,300 tokens
    leases = [d.submit(t(50 + i)) for i in range(6)]  # 3 + 3
    for lease in [x for x in leases if x.worker is w1]:
        lease.release()  # w0: 3 busy, w1: 0 busy
    assert d.submit(t(1, prefix_key=1, prefix_chain=conv(5))).worker is w0  # 2,300 // 512 >= 3
    # a head-key-only match (1 token) does not outweigh one busy slot
    sc.index.record("w0", ((77, 1),), tokens=10, capacity=100_000)
    assert d.submit(t(2, prefix_key=77)).worker is w1


def test_two_slot_workers_affinity_only_breaks_ties():
    """Field case 9: with 2 slots no worker idles while another runs two of the same prefix."""
    d = mk(n=2, slots=2)
    a = d.submit(t(1, prefix_key=5, prefix_chain=conv(3)))
    b = d.submit(t(2, prefix_key=5, prefix_chain=conv(3)))
    assert a.worker is not b.worker


def test_a_worker_that_goes_down_is_forgotten():
    d = mk(n=2, slots=8)
    a = d.submit(t(1, prefix_key=1, prefix_chain=conv(2)))
    a.release()
    assert d.scorer.index.cached_tokens(a.worker.id, conv(3), 10**6) == 1100
    d.set_ready(a.worker.id, False)
    d.set_ready(a.worker.id, True)
    assert d.scorer.index.cached_tokens(a.worker.id, conv(3), 10**6) == 0
    d.remove_worker(a.worker.id)  # no error for a forgotten worker


def test_affinity_disabled_is_pure_least_loaded():
    d = mk(n=2, slots=2, affinity=False)
    assert {d.submit(t(i, prefix_key=7)).worker.id for i in range(2)} == {"w0", "w1"}


def test_rendezvous_rank_stable_and_spread():
    d = mk(n=4)
    ws = list(d.workers.values())
    homes = [rendezvous_rank(k, ws)[0].id for k in range(400)]
    assert homes == [rendezvous_rank(k, list(reversed(ws)))[0].id for k in range(400)]
    counts = {w.id: homes.count(w.id) for w in ws}
    assert min(counts.values()) > 60, counts


def test_baseline_policies():
    d = mk("round_robin", n=3, slots=2)
    assert [d.submit(t(i)).worker.id for i in range(4)] == ["w0", "w1", "w2", "w0"]
    d = mk("pack", n=3, slots=2)
    assert [d.submit(t(i)).worker.id for i in range(4)] == ["w0", "w0", "w1", "w1"]
    d = mk("least_connections", n=2, slots=2)
    assert [d.submit(t(i)).worker.id for i in range(2)] == ["w0", "w1"]
    d = mk("random", n=3, slots=50, seed=1)
    assert len({d.submit(t(i)).worker.id for i in range(30)}) == 3
    with pytest.raises(ValueError):
        make_scorer("fastest")
    with pytest.raises(ValueError):
        LeastLoaded(affinity_bound=0.5)


def test_a_reload_keeps_the_prefix_index():
    """A reload builds a new scorer (Fleet.apply_scheduler); the index of what each worker
    was sent stays, so the next turn of a conversation still finds its worker although that
    worker is now busier. A policy without an index neither takes nor gives one."""
    def next_turn_after_reload(keep: bool) -> bool:
        d = mk(n=2, slots=4)
        first = d.submit(t(1, prefix_key=1, prefix_chain=conv(2), est_tokens=1200))
        first.release()
        busy = d.submit(t(2))  # by load alone the next turn would go to the other worker
        assert busy.worker is first.worker
        new = make_scorer("least_loaded")
        d.scorer = keep_prefix_index(d.scorer, new) if keep else new
        nxt = d.submit(t(3, prefix_key=1, prefix_chain=conv(3), est_tokens=1800))
        return nxt.worker is first.worker

    assert next_turn_after_reload(keep=True) and not next_turn_after_reload(keep=False)
    ll = make_scorer("least_loaded")
    rr = keep_prefix_index(ll, make_scorer("round_robin"))
    assert not hasattr(rr, "index")
    assert keep_prefix_index(rr, make_scorer("least_loaded")).index is not ll.index


class StepClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def delay_fleet(max_pending=100, **kw):
    """Two workers of one slot with the affinity wait at 100 ms per 1,000 tokens held, and a
    chat turn running on w0 (it holds the chat's prefix): (dispatcher, clock, that lease)."""
    clock = StepClock()
    d = Dispatcher(clock, max_pending=max_pending,
                   scorer=make_scorer("least_loaded", affinity_wait_ms_per_1k_tokens=100.0, **kw))
    for i in range(2):
        d.add_worker(f"w{i}", "m", 1)
        d.set_ready(f"w{i}", True)
    turn1 = d.submit(t(1, prefix_key=1, prefix_chain=conv(3)))
    assert turn1.worker.id == "w0"
    return d, clock, turn1


def test_affinity_wait_holds_the_next_turn_while_others_take_the_free_slot():
    """Delay scheduling (Zaharia et al.): the next turn waits for w0, which holds 1,700 tokens
    of it, while a request without a prefix takes free w1 at once; w0's release hands it the
    turn."""
    d, clock, turn1 = delay_fleet()
    nxt = t(2, prefix_key=1, prefix_chain=conv(4))
    assert d.submit(nxt) is None
    assert nxt.held_until == pytest.approx(0.17)  # 1,700 tokens × 0.1 ms
    assert d.next_wakeup() == pytest.approx(0.17)
    clock.t = 0.05
    other = d.submit(t(3))
    assert other is not None and other.worker.id == "w1"  # not blocked behind the waiting turn
    ((tk, lease),) = turn1.release()
    assert tk is nxt and lease.worker.id == "w0" and nxt.held_until is None


def test_affinity_wait_ends_at_its_bound_and_any_worker_takes_the_ticket():
    d, clock, turn1 = delay_fleet()
    nxt = t(2, prefix_key=1, prefix_chain=conv(4))
    assert d.submit(nxt) is None
    clock.t = 0.1
    assert d.pump() == []  # still within its wait, w1 idle
    clock.t = d.next_wakeup()
    ((tk, lease),) = d.pump()
    assert tk is nxt and lease.worker.id == "w1"
    assert d.next_wakeup() is None and turn1.worker.busy == 1


def test_affinity_wait_capped_and_off_by_default():
    d, _, _ = delay_fleet(affinity_wait_max_s=0.05)
    nxt = t(2, prefix_key=1, prefix_chain=conv(8))  # 4,700 tokens held: 0.47 s uncapped
    assert d.submit(nxt) is None and nxt.held_until == pytest.approx(0.05)
    d2 = mk(n=2, slots=1)  # default: no wait, the free worker takes it
    d2.submit(t(1, prefix_key=1, prefix_chain=conv(3)))
    assert d2.submit(t(2, prefix_key=1, prefix_chain=conv(4))).worker.id == "w1"


def test_affinity_wait_ends_by_half_the_queue_timeout():
    """A wait set longer than the queue timeout ends at half of it (a fresh tester saw a 503
    "timed out waiting for a free slot" while the other worker idled)."""
    d, clock, _ = delay_fleet(affinity_wait_max_s=30.0)
    nxt = t(2, prefix_key=1, prefix_chain=conv(8), queue_timeout_s=0.2)  # 0.47 s uncapped
    assert d.submit(nxt) is None and nxt.held_until == pytest.approx(0.1)
    clock.t = d.next_wakeup()
    ((tk, lease),) = d.pump()
    assert tk is nxt and lease.worker.id == "w1" and d.expire() == []


def test_affinity_wait_never_for_a_head_key_or_when_the_queue_is_full():
    d, _, _ = delay_fleet()
    assert d.submit(t(2, prefix_key=1)).worker.id == "w1"  # head key only: a tie-breaker
    d, _, _ = delay_fleet(max_pending=0)  # it could not queue: a free worker takes it now
    assert d.submit(t(2, prefix_key=1, prefix_chain=conv(4))).worker.id == "w1"


def test_waiting_ticket_does_not_wait_for_a_worker_it_avoids():
    d, _, _ = delay_fleet()
    retry = t(2, prefix_key=1, prefix_chain=conv(4), avoid=frozenset({"w0"}))
    assert d.submit(retry).worker.id == "w1"


def test_a_lone_candidate_is_taken_and_its_prefix_still_recorded():
    """With one worker able to take the ticket the scorer makes no comparison (the fast path of
    ``LeastLoaded.pick``), yet the placement is recorded for prefix affinity as before: once a
    second worker can take the next turn, that turn follows the first to its worker."""
    d = mk(n=2, slots=1)
    busy = d.submit(t(0))  # w0's only slot: w1 is the lone candidate
    first = d.submit(t(1, prefix_key=1, prefix_chain=conv(2), est_tokens=1200))
    assert (busy.worker.id, first.worker.id) == ("w0", "w1")
    first.release()
    busy.release()
    assert d.submit(t(2, prefix_key=1, prefix_chain=conv(3))).worker.id == "w1"
