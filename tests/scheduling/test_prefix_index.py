"""PrefixIndex: which prompt prefixes each worker probably still caches (pure, no clock)."""

from gateway.scheduling.prefix_index import PrefixIndex

SYS = (101, 500)               # (key, tokens) after the system prompt
TURN1 = (SYS, (102, 900))      # conversation, turn 1
TURN2 = TURN1 + ((103, 1200), (104, 1300))  # turn 2 repeats turn 1 (+ answer + next message)


def test_longest_recorded_boundary_wins():
    ix = PrefixIndex()
    ix.record("w0", TURN1, tokens=1000, capacity=10_000)
    assert ix.cached_tokens("w0", TURN2, 10_000) == 900   # turn 1's prompt is held
    assert ix.cached_tokens("w0", (SYS, (999, 700)), 10_000) == 500  # other chat, same system prompt
    assert ix.cached_tokens("w1", TURN2, 10_000) == 0
    assert ix.cached_tokens("w0", ((7, 50),), 10_000) == 0


def test_forgotten_after_capacity_tokens_came_in():
    ix = PrefixIndex()
    ix.record("w0", TURN1, tokens=1000, capacity=3000)
    ix.record("w0", ((1, 10), (2, 1000)), tokens=1000, capacity=3000)
    assert ix.cached_tokens("w0", TURN2, 3000) == 900     # 1,000 tokens came in after it
    ix.record("w0", ((3, 10), (4, 2000)), tokens=2000, capacity=3000)
    assert ix.cached_tokens("w0", TURN2, 3000) == 0       # 3,000 came in: evicted (LRU)
    ix.record("w0", TURN1, tokens=1000, capacity=3000)    # used again: fresh
    assert ix.cached_tokens("w0", TURN2, 3000) == 900


def test_next_turn_replaces_the_previous_entry():
    """A turn that extends a whole earlier prompt takes in only its new tokens (llama-server
    drops cache entries contained in the new one); a shared system prompt does not."""
    ix = PrefixIndex()
    ix.record("w0", TURN1, tokens=1000, capacity=2500)
    ix.record("w0", TURN2, tokens=1400, capacity=2500)    # takes in 1,400 - 900 = 500
    ix.record("w0", ((9, 10), (8, 1400)), tokens=1400, capacity=2500)
    assert ix.cached_tokens("w0", TURN2 + ((105, 1500),), 2500) == 1300  # 1,900 < 2,500
    ix.record("w0", (SYS, (200, 1200)), tokens=1200, capacity=2500)  # matches SYS: takes in 1,200
    assert ix.cached_tokens("w0", TURN2 + ((105, 1500),), 2500) == 500  # 2,600 later: only SYS


def test_prune_and_forget():
    ix = PrefixIndex()
    for i in range(3000):
        ix.record("w0", ((i, 10),), tokens=10, capacity=100)
    assert len(ix._keys["w0"]) < 1100  # stale keys pruned
    assert ix.cached_tokens("w0", ((2999, 10),), 100) == 10
    ix.forget("w0")
    assert ix.cached_tokens("w0", ((2999, 10),), 100) == 0
    ix.record("w0", (), tokens=10, capacity=100)  # nothing to record
    assert "w0" not in ix._keys
