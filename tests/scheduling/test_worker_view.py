"""WorkerView's slot counter: ``busy`` is kept by ``hold`` / ``drop`` and always equals the
slots of its live leases."""

from gateway.scheduling import Dispatcher, Ticket


def test_busy_counter_follows_leases_and_double_release():
    d = Dispatcher(lambda: 0.0, max_pending=4)
    d.add_worker("w0", "m", 4)
    d.set_ready("w0", True)
    w = d.workers["w0"]
    one, three = d.submit(Ticket("a", "m")), d.submit(Ticket("b", "m", slots=3))
    assert w.busy == 4 == sum(l.slots for l in w.leases) and w.free == 0
    w.hold(three)  # holding a lease it already has counts nothing twice
    assert w.busy == 4
    three.release()
    three.release()  # idempotent: the slots come back once
    w.drop(three)
    assert w.busy == 1 == sum(l.slots for l in w.leases) and w.free == 3
    one.release()
    assert w.busy == 0 and not w.leases
