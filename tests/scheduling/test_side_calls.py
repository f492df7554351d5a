"""Unit tests of the pure side-call routing: which workers are fit, in which order they are
tried, and the cheap early refusal (``Dispatcher.would_refuse``)."""

import pytest

from gateway.scheduling import AllDrained, Dispatcher, ModelRemoved, QueueFull, Ticket
from gateway.scheduling.side_calls import SideCallRouter

M = "demo:latest"


def mk(n=3, slots=1, max_pending=2):
    d = Dispatcher(lambda: 0.0, max_pending=max_pending)
    for i in range(n):
        d.add_worker(f"w{i}", M, slots)
        d.set_ready(f"w{i}", True)
    return d


def ids(ws):
    return [w.id for w in ws]


def test_in_rotation_excludes_unready_draining_failed_retiring_and_other_models():
    d = mk(n=5)
    d.add_worker("x0", "other:latest", 1)
    d.set_ready("x0", True)
    d.set_ready("w0", False)
    d.set_draining("w1", True)  # a restart's drain (not held)
    d.set_failed("w2", True, retry_at=5.0)
    d.retire("w3")
    assert ids(d.in_rotation(M)) == ["w4"]
    d.set_draining("w1", False)
    assert ids(d.in_rotation(M)) == ["w1", "w4"]


def test_busy_worker_stays_in_rotation_for_side_calls():
    d = mk(n=1)
    assert d.submit(Ticket(request_id="r", model=M)) is not None
    assert d.workers["w0"].free == 0
    assert ids(d.in_rotation(M)) == ["w0"]


def test_order_rotates_and_prefers_the_requests_worker():
    d = mk()
    r = SideCallRouter()
    fit = d.in_rotation(M)
    firsts = [r.order(fit, 0.0)[0].id for _ in range(6)]
    assert firsts == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert [r.order(fit, 0.0, prefer="w2")[0].id for _ in range(3)] == ["w2"] * 3
    # a preferred worker that is out of rotation is simply not among the candidates
    d.set_draining("w2", True)
    assert "w2" not in ids(r.order(d.in_rotation(M), 0.0, prefer="w2"))


def test_order_tries_untried_then_puts_suspects_last():
    d = mk()
    r = SideCallRouter(suspect_s=10.0)
    fit = d.in_rotation(M)
    got = r.order(fit, 0.0, prefer="w0", tried={"w0": 1})
    assert got[0].id != "w0" and got[-1].id == "w0"
    r.failed("w1", now=100.0)
    for _ in range(3):  # whatever the rotation, the suspect comes last
        assert r.order(fit, 105.0)[-1].id == "w1"
    assert r.order(fit, 105.0, prefer="w1")[-1].id == "w1"  # even when preferred
    assert r.suspect("w1", 109.9) and not r.suspect("w1", 110.0)
    r.failed("w1", now=100.0)
    r.answered("w1")
    assert not r.suspect("w1", 101.0)
    # everything tried: fewest tries first
    assert r.order(fit, 0.0, tried={"w0": 2, "w1": 1, "w2": 3})[0].id == "w1"
    assert r.order([], 0.0) == []


def test_would_refuse_matches_submit_and_changes_nothing():
    d = mk(n=1, slots=1, max_pending=2)
    assert d.would_refuse(M) is None
    assert d.submit(Ticket(request_id="a", model=M)) is not None
    assert d.would_refuse(M) is None  # the queue has room
    d.submit(Ticket(request_id="b", model=M))
    d.submit(Ticket(request_id="c", model=M))
    assert len(d.queue) == 2
    assert isinstance(d.would_refuse(M), QueueFull)
    assert len(d.queue) == 2  # asking changed nothing
    with pytest.raises(QueueFull):
        d.submit(Ticket(request_id="d", model=M))


def test_would_refuse_lets_through_what_a_free_slot_takes():
    d = mk(n=2, slots=1, max_pending=1)
    d.add_worker("x0", "other:latest", 1)
    d.set_ready("x0", True)
    d.submit(Ticket(request_id="x", model="other:latest"))
    d.submit(Ticket(request_id="y", model="other:latest"))  # queue (1) now full
    assert isinstance(d.would_refuse("other:latest"), QueueFull)
    assert d.would_refuse(M) is None  # a free worker of M takes it at once
    assert d.submit(Ticket(request_id="z", model=M)) is not None


def test_would_refuse_gives_the_refusal_first():
    d = mk(n=1)
    d.set_draining("w0", True, held=True)
    assert isinstance(d.would_refuse(M), AllDrained)
    d.retire("w0")
    assert isinstance(d.would_refuse(M), ModelRemoved)
