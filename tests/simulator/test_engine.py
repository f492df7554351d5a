"""The simulator's event loop and its tickets (gateway.simulator.engine)."""

from gateway.simulator.engine import HEAD_TOKENS, simulate, ticket_keys
from gateway.simulator.worker import PROFILES
from gateway.simulator.workload import ChatClients, Conversations


def test_ticket_keys_like_the_live_gateway():
    sys_a = ((("sys", 1), 500), (("u", 1), 50))
    sys_b = ((("sys", 1), 500), (("u", 2), 80))
    (ka, ca), (kb, cb) = ticket_keys(sys_a), ticket_keys(sys_b)
    assert ka == kb and ca[0] == cb[0] and ca[1] != cb[1]  # same head, other question
    assert [n for _, n in ca] == [500, 550]
    short = ((("u", 1), HEAD_TOKENS // 2), (("u", 2), HEAD_TOKENS))
    other = ((("u", 1), HEAD_TOKENS // 2), (("u", 3), HEAD_TOKENS))
    assert ticket_keys(short)[0] != ticket_keys(other)[0]  # the head spans both segments
    turn2 = sys_a + ((("o", 1), 30), (("u", 3), 20))
    assert ticket_keys(turn2)[1][:2] == ca  # the next turn's chain holds the previous prompt


def test_affinity_caches_more_of_a_conversation_trace_than_round_robin():
    prof = PROFILES["rtx6000ada-llama8b-q4"]
    kw = dict(n_workers=2, profile=prof, slots=4, warmup_s=20.0)
    gw = simulate(Conversations(0.5, 120), **kw)
    rr = simulate(Conversations(0.5, 120), policy="round_robin", **kw)
    assert gw.cached_tokens > 1.2 * rr.cached_tokens
    assert 0 < gw.restored_tokens < gw.cached_tokens and gw.copy_s > 0 and gw.working_set > 0


def test_affinity_wait_caches_more_when_clients_fill_every_slot():
    """Closed-loop chat clients, as many as slots: the only free slot decides placement, so
    affinity alone caches no more than without it; the affinity wait (delay scheduling) lets a
    turn wait for the worker that holds its chat, and every turn still completes."""
    prof = PROFILES["rtx6000ada-llama8b-q4"]
    kw = dict(n_workers=2, profile=prof, slots=8, warmup_s=10.0)
    plain = simulate(ChatClients(16, 60.0), **kw)
    off = simulate(ChatClients(16, 60.0), affinity=False, **kw)
    wait = simulate(ChatClients(16, 60.0), affinity_wait_ms_per_1k_tokens=1000.0, **kw)
    assert plain.cached_tokens < 1.05 * off.cached_tokens
    assert wait.cached_tokens > 1.15 * plain.cached_tokens
    assert wait.completed >= 0.95 * plain.completed and wait.rejected == 0
