"""The modelled llama-server worker's slots and prompt cache (gateway.simulator.worker)."""

import pytest

from gateway.simulator.worker import PROFILES, GpuProfile, SimWorker, Task
from gateway.simulator.workload import Request

P = GpuProfile("test", prefill_tps=10_000.0, decode_s1=0.01, kv_bytes_per_token=1000,
               host_copy_bytes_per_s=1e6)  # a copy of 1,000 tokens takes 1 s
SYS = ("sys", 0)


def req(i, segs, out=10):
    return Request(i, 0.0, sum(n for _, n in segs), out, segments=segs)


def run(w, r):
    """Admit ``r`` and step the worker until it is done; returns (task, seconds)."""
    t = Task(r, None, r.prompt_tokens, r.output_tokens)
    w.admit(t, 0.0)
    total = 0.0
    while t in w.running:
        dt, _, _, _ = w.step()
        total += dt
    return t, total


def worker(slots=1, **kw):
    return SimWorker("w", P, slots, 4096, **kw)


def test_similar_idle_slot_is_reused_without_copies():
    w = worker(slots=2)
    run(w, req(1, ((SYS, 500), (("u", 1), 100))))
    t, _ = run(w, req(2, ((SYS, 500), (("u", 2), 100))))
    assert t.cached == 500 and t.restored == 0
    assert w.slot_seq[t.slot] == ((SYS, 500), (("u", 2), 100), (("o", 2), 10))  # prompt + answer


def test_evicted_turn_is_restored_from_the_host_cache_at_a_copy_cost():
    w = worker(slots=1, cache_idle_slots=False)
    turn1 = req(1, ((SYS, 200), (("c", 1), 800)), out=100)
    run(w, turn1)
    run(w, req(2, ((("other", 1), 1000),)))  # LRU slot: turn 1 is saved (1,100 tokens copied)
    assert w.copy_s_total == pytest.approx(1.1)
    turn2 = req(3, turn1.segments + ((turn1.out_id, 100), (("c", 2), 50)))
    t, secs = run(w, turn2)
    assert t.cached == 1100 and t.restored == 1100  # counted as cached, as llama-server does
    assert w.copy_s_total == pytest.approx(1.1 + 1.01 + 1.1)  # 'other' saved, turn 1 restored
    assert secs > 2.1  # the copies stall the step


def test_a_similar_slot_kept_mostly_skips_the_host_cache():
    """llama-server looks in the host cache only when it takes the LRU slot or keeps less than
    half of the similar slot (server-context.cpp get_available_slot, f_keep < 0.5)."""
    w = worker(slots=1, cache_idle_slots=False)
    conv = req(1, ((SYS, 600), (("c", 1), 600)))
    run(w, conv)
    run(w, req(2, ((SYS, 600), (("d", 1), 50))))  # keeps 600/1,210 < half: conv saved
    nxt = req(3, conv.segments + ((conv.out_id, 10), (("c", 2), 50)))
    t, _ = run(w, nxt)  # the slot (600/660 kept) wins by similarity: no host lookup
    assert t.cached == 600 and t.restored == 0


def test_idle_slots_are_saved_on_each_new_task_and_cleared_with_unified_kv():
    w = worker(slots=2)
    run(w, req(1, ((("a", 1), 300),)))
    run(w, req(2, ((("b", 1), 300),)))  # idle slot with 'a' saved when 'b' starts
    assert [n for _, n in w.host.entries] == [310]
    u = worker(slots=2, unified_kv=True)
    run(u, req(1, ((("a", 1), 300),)))
    t, _ = run(u, req(2, ((("b", 1), 300),)))
    assert u.slot_seq[1 - t.slot] == ()  # saved, then cleared


def test_no_host_cache_without_cache_ram_or_kv_size():
    w = worker(slots=1, cache_ram_mib=0)
    run(w, req(1, ((("a", 1), 300),)))
    run(w, req(2, ((("b", 1), 300),)))
    assert w.host.entries == [] and w.copy_s_total == 0
    assert PROFILES["rtx6000ada-llama8b-q4"].kv_bytes_per_token == 131_072
