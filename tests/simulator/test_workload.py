"""Simulator workloads (gateway.simulator.workload)."""

import pytest

from gateway.simulator.workload import (ChatClients, Conversations, Request,
                                        distinct_prefix_tokens, shared_prefix)


def test_request_defaults_to_one_segment_of_its_own():
    r = Request(3, 0.0, 120, 10)
    assert r.segments == ((("u", 3), 120),) and r.out_id == ("o", 3)


def test_shared_prefix_segments_and_working_set():
    rs = shared_prefix(5.0, 60, n_prefixes=4, zipf_s=0.0)
    assert all(r.prompt_tokens == sum(n for _, n in r.segments) for r in rs)
    assert {r.segments[0][0] for r in rs} == {("sys", k) for k in range(4)}
    assert 4 * 1000 <= distinct_prefix_tokens(rs) <= 4 * 2000
    assert distinct_prefix_tokens([Request(1, 0, 5, 5), Request(2, 0, 5, 5)]) == 0


def test_conversation_turns_repeat_the_conversation_so_far():
    c = Conversations(1.0, 60, think_s=5.0, mean_turns=1e9)  # every conversation goes on
    first = c.initial()[0]
    assert first.segments[0][0][0] == "sys" and first.prompt_tokens >= 20
    nxt = c.next(first.client, 10.0)
    assert nxt.segments[:2] == first.segments
    assert nxt.segments[2] == (first.out_id, first.output_tokens)
    assert nxt.arrival > 10.0 and nxt.client == first.client
    third = c.next(nxt.client, 20.0)
    assert third.segments[:5] == nxt.segments + ((nxt.out_id, nxt.output_tokens),)
    assert c.working_set_tokens() > 0
    assert c.next(first.client, 60.0) is None  # past the end


def test_conversations_stop_before_the_context_is_full():
    c = Conversations(1.0, 600, mean_turns=1e9, max_context=1500, user_len=(400, 400))
    r = c.initial()[0]
    turns = 1
    while (r := c.next(r.client, 1.0 * turns)) is not None:
        assert r.prompt_tokens + r.output_tokens <= 1500
        turns += 1
    assert turns < 10


def test_chat_clients_carry_many_chats_turn_by_turn():
    w = ChatClients(clients=2, duration_s=10.0, conversations=3, turns=2)
    first = w.initial()
    assert len(first) == 2 and first[0].segments[0] == (("sys", 0), 400)
    chats = {w.of_client[0], w.of_client[1]}
    sent = [w.next(0, 1.0) for _ in range(5)]  # client 0 goes on with whatever chat is idle
    assert all(r is not None and r.client == 0 for r in sent)
    later = [r for r in sent if len(r.segments) == 4]  # a second turn: the first one + answer
    assert later and all(r.segments[:2] in [f.segments for f in first + sent] for r in later)
    assert w.chats > 3  # chats that had their 2 turns were replaced by new ones
    assert len(chats) == 2 and w.next(1, 10.0) is None  # no new turn after duration_s
    with pytest.raises(ValueError):
        ChatClients(clients=4, duration_s=1.0, conversations=3)
