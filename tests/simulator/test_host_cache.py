"""The modelled llama-server host prompt cache (gateway.simulator.host_cache)."""

from gateway.simulator.host_cache import HostPromptCache, common_prefix, seq_len

SYS = ("sys", 0)


def test_common_prefix_by_segments():
    a = ((SYS, 500), (("u", 1), 100))
    b = ((SYS, 500), (("u", 2), 100))
    assert common_prefix(a, b) == 500 and common_prefix(a, a) == 600
    assert common_prefix(((SYS, 500),), ((SYS, 300),)) == 300  # same content, cut shorter
    assert common_prefix((), a) == 0 and seq_len(a) == 600


def cache(tokens, kvb=1000):
    return HostPromptCache(tokens * kvb, kvb)


def test_save_skips_contained_drops_superseded_and_evicts_oldest():
    c = cache(3000)
    t1 = ((SYS, 500), (("c", 1), 500))
    t2 = t1 + ((("a", 1), 200), (("c", 2), 300))
    assert c.save(t1) == 1000
    assert c.save(((SYS, 500),)) == 0            # contained in an entry: not saved again
    assert c.save(t2) == 1500 and [n for _, n in c.entries] == [1500]  # t1 superseded
    other = ((SYS, 500), (("c", 9), 1000))
    assert c.save(other) == 1500 and c.tokens() == 3000
    assert c.save(((("x", 1), 100),)) == 100 and [e for e, _ in c.entries][0] == other  # oldest out
    assert c.save(((("big", 1), 4000),)) == 0    # larger than the whole cache
    assert not HostPromptCache(0, 1000).enabled and HostPromptCache(0, 1000).save(t1) == 0


def test_load_takes_the_entry_that_beats_the_slot_and_removes_it():
    c = cache(10_000)
    conv = ((SYS, 500), (("c", 1), 1500), (("a", 1), 200))
    c.save(conv)
    c.save(((SYS, 500), (("c", 2), 100)))
    new = conv + ((("c", 1, 2), 100),)
    slot = ((SYS, 500), (("c", 3), 300))         # another chat with the same system prompt
    assert c.load(slot, new) == conv and len(c.entries) == 1
    assert c.load(conv, new) is None             # nothing beats the slot's own content
    c.save(((("doc", 1), 4000), (("q", 1), 100)))
    # shares 400 of 4,100 tokens (f_keep < 0.25): not worth trashing, never restored
    assert c.load((), ((("doc", 1), 400), (("q", 2), 50))) is None
    assert c.load((), ((("doc", 1), 4000), (("q", 2), 50)))[0] == (("doc", 1), 4000)
