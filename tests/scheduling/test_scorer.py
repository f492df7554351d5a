"""Scorer and KV-headroom unit tests (pure scheduling objects, injected clock)."""

import pytest

from gateway.scheduling import Dispatcher, Ticket, TooLarge, WorkerLoad, make_scorer
from gateway.scheduling.scorer import LeastLoaded, rendezvous_rank


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


def test_affinity_home_when_idle_spread_when_above_average():
    d = mk(n=4, slots=4, affinity_bound=1.25)
    key = 12345
    ws = list(d.workers.values())
    home, second = rendezvous_rank(key, ws)[:2]
    a = d.submit(t(1, prefix_key=key))
    assert a.worker is home  # idle fleet: home
    b = d.submit(t(2, prefix_key=key))
    assert b.worker is second  # home above average: the stable second choice
    a.release()
    b.release()
    # moderate load: home at the fleet average keeps affinity
    fill = [d.submit(t(10 + i)) for i in range(8)]  # 2 per worker
    assert home.busy == 2
    assert d.submit(t(3, prefix_key=key)).worker is home  # 0.5 <= 1.25 * 0.5
    assert d.submit(t(4, prefix_key=key)).worker is not home  # 0.75 > 1.25 * 9/16
    assert fill


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
