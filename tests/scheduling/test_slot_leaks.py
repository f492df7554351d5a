"""Leaked-slot evidence (gateway/scheduling/slot_leaks.py): pure, clock injected."""

from gateway.scheduling.slot_leaks import SlotLeak, SlotLeakWatch
from workers.telemetry import SlotState, parse_slots

BOUND = 60.0


def slot(i: int, task: int | None, busy: bool = True) -> SlotState:
    return SlotState(id=i, n_ctx=2048, busy=busy, kv_tokens=0, n_decoded=0, n_cached=0,
                     id_task=task)


class Polls:
    """A watch fed a worker's slots as the fleet feeds it, every ``step`` s of an injected
    clock; ``slots`` is what the next polls read."""

    def __init__(self, slots: list[SlotState], t: float = 1000.0):
        self.t = t
        self.slots = slots
        self.watch = SlotLeakWatch(lambda: self.t)

    def run(self, polls: int, step: float = 0.25, lease: float | None = None,
            bound: float = BOUND) -> list[tuple[float, SlotLeak]]:
        """``polls`` polls; the leaks reported, with the clock of their poll. ``lease``: the
        oldest live lease's ``granted_at`` (None: no lease)."""
        out = []
        for _ in range(polls):
            self.t += step
            out += [(self.t, leak) for leak in self.watch.observe(self.slots, lease, bound)]
        return out


def test_same_task_busy_past_the_bound_with_no_lease_is_a_leak_reported_once():
    w = Polls([slot(0, 7), slot(1, None, busy=False)])
    first = w.t + 0.25
    leaks = w.run(polls=int(BOUND / 0.25) + 40)
    assert len(leaks) == 1
    at, leak = leaks[0]
    assert (leak.slot, leak.id_task) == (0, 7)
    assert at - first > BOUND and at - first <= BOUND + 0.25  # the first poll past the bound
    assert leak.busy_s == leak.unclaimed_s == at - first


def test_not_before_the_bound():
    w = Polls([slot(0, 7)])
    assert w.run(polls=int(BOUND / 0.25)) == []  # exactly the bound: not yet


def test_a_new_task_on_the_slot_starts_over():
    w = Polls([slot(0, 7)])
    assert w.run(polls=200) == []  # 50 s
    w.slots = [slot(0, 8)]  # the slot moved on to another task: work, not a leak
    assert w.run(polls=200) == []  # 100 s busy in all, 50 s with task 8
    leaks = w.run(polls=60)
    assert [(lk.slot, lk.id_task) for _, lk in leaks] == [(0, 8)]


def test_idle_between_two_sightings_of_one_task_id_starts_over():
    w = Polls([slot(0, 7)])
    assert w.run(polls=200) == []
    w.slots = [slot(0, 7, busy=False)]  # idle slots keep their previous task's id
    assert w.run(polls=1) == []
    w.slots = [slot(0, 7)]
    assert w.run(polls=200) == []


def test_a_lease_older_than_the_busy_span_claims_the_slot():
    """A request of any length holds a lease granted before its task was first seen."""
    w = Polls([slot(0, 7)])
    granted = w.t  # before the first poll saw the task
    assert w.run(polls=4 * 3600, lease=granted) == []  # an hour of generation
    # its request ended (lease released): the slot may stay busy a little (llama-server frees
    # a cancelled slot within about 2 s); only bound_s after the lease's end is it a leak
    ended = w.t
    assert w.run(polls=int(BOUND / 0.25)) == []
    leaks = w.run(polls=1)
    assert len(leaks) == 1 and leaks[0][1].unclaimed_s == w.t - ended > BOUND
    assert leaks[0][1].busy_s > 3600


def test_a_lease_granted_after_the_first_sighting_does_not_claim_the_slot():
    """The other slots' requests (leases granted after the slot was first seen busy with its
    task) cannot be that task."""
    w = Polls([slot(0, 7), slot(1, 3)])
    w.run(polls=1)
    later = w.t + 0.01
    leaks = w.run(polls=int(BOUND / 0.25) + 4, lease=later)
    assert sorted((lk.slot, lk.id_task) for _, lk in leaks) == [(0, 7), (1, 3)]


def test_a_lease_granted_while_the_first_poll_was_answered_claims_the_slot():
    """The poll that first sees a task may have been sent before the lease of the request that
    started it was granted; its sighting is stamped when handled, after that lease."""
    w = Polls([slot(0, 7)])
    granted = w.t + 0.1  # granted after the poll was sent, before its answer was handled
    assert w.run(polls=1000, lease=granted) == []


def test_missing_id_task_is_never_judged():
    w = Polls(parse_slots([{"id": 0, "n_ctx": 2048, "state": 1}]))  # an older build
    assert w.slots[0].busy and w.slots[0].id_task is None
    assert w.run(polls=1000) == []


def test_bound_zero_reports_nothing_but_keeps_the_busy_span():
    w = Polls([slot(0, 7)])
    assert w.run(polls=400, bound=0) == []  # off (or the worker is draining)
    leaks = w.run(polls=1)  # back on: the 100 s already seen count (from the first poll)
    assert len(leaks) == 1 and leaks[0][1].busy_s == 100.0


def test_reset_forgets_the_slots():
    w = Polls([slot(0, 7)])
    w.run(polls=200)
    w.watch.reset()  # a new worker process: task ids start again
    assert w.run(polls=200) == []
