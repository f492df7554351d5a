"""Request size estimates and prefix keys (gateway.sizing)."""

from gateway.sizing import REFUSE_SAFETY, choices, estimate, prompts_of


def est(body, **kw):
    return estimate(body, **{"bytes_per_token": 2.0, "prefix_bytes": 64,
                             "unknown_num_predict": 100, **kw})


def test_completion_prompt_and_budget():
    e = est({"prompt": "x" * 200, "n_predict": 50})
    assert e.est_tokens == 100 + 50
    assert e.prompt_tokens == int(200 / (2.0 * REFUSE_SAFETY))
    assert e.prefill_tokens == 100  # what the worker computes: 200 bytes / 2 bytes per token
    assert est({"prompt": "x" * 200}).est_tokens == 100 + 100  # unknown budget
    assert est({"prompt": "x" * 200, "n_predict": -1}, n_ctx=120).est_tokens == 120


def test_non_ascii_bytes_have_their_own_ratio():
    """CJK text costs a tokenizer far more tokens per byte than English: its bytes are
    estimated with the ratio measured on such text (tester S: English's ratio let two CJK
    requests share a KV cache that held one)."""
    cjk = "问题" * 50  # 300 bytes
    e = est({"prompt": cjk, "n_predict": 0}, wide_bytes_per_token=1.0)
    assert (e.prefill_tokens, e.est_tokens) == (300, 300)
    assert e.prompt_tokens == int(300 / REFUSE_SAFETY)
    e = est({"prompt": "ab" * 50 + cjk, "n_predict": 0}, wide_bytes_per_token=1.0)
    assert e.prefill_tokens == 50 + 300  # 100 ASCII bytes at 2 a token, 300 at 1
    # without a measured ratio for it, non-ASCII text counts as the ASCII ratio says
    assert est({"prompt": cjk, "n_predict": 0}).prefill_tokens == 150
    # chat messages and the prefix chain count the same way
    e = est({"messages": [{"role": "user", "content": cjk}], "max_tokens": 0},
            wide_bytes_per_token=1.0)
    # "user", a separator and 8 bytes of template: 13 ASCII bytes at 2 a token
    assert e.prefill_tokens == 307 and e.prefix_chain[-1][1] == e.prefill_tokens


def test_digits_and_punctuation_have_their_own_ratio():
    """Numbers and code symbols tokenize at about a byte a token, half the prose ratio or less:
    their bytes are estimated with the ratio measured on such text (tester U: at the prose
    ratio several such prompts overflowed a ``--kv-unified`` worker's shared cache)."""
    digits = "3.14159265;" * 30  # 330 bytes, all digits and punctuation
    e = est({"prompt": digits, "n_predict": 0}, dense_bytes_per_token=1.0)
    assert (e.prefill_tokens, e.est_tokens, e.prompt_tokens) == (330, 330, int(330 / REFUSE_SAFETY))
    assert est({"prompt": digits, "n_predict": 0}).prefill_tokens == 165  # unmeasured: prose's
    # letters and spaces keep the prose ratio, non-ASCII text its own
    e = est({"prompt": "ab " * 20 + digits + "问题", "n_predict": 0}, dense_bytes_per_token=1.0,
            wide_bytes_per_token=0.5)
    assert e.prefill_tokens == 30 + 330 + 12
    e = est({"messages": [{"role": "user", "content": digits}], "max_tokens": 0},
            dense_bytes_per_token=1.0)
    # "user", a separator and 8 bytes of template: 13 bytes at 2 a token
    assert e.prefill_tokens == 337 and e.prefix_chain[-1][1] == e.prefill_tokens


def test_token_list_prompt_is_exact():
    e = est({"prompt": list(range(300)), "max_tokens": 10})
    assert e.prompt_tokens == 300 and e.est_tokens == 310 and e.prefill_tokens == 300


def test_a_counted_prompt_replaces_the_bytes_estimate():
    """A worker's count of the single prompt (the prompt length check) is the refusal size and
    the prefill; the prefix key stays the text's."""
    text = {"prompt": "on " * 1000, "n_predict": 10}
    e = est(text, counted_tokens=1001, n_ctx=1200)
    assert (e.prompt_tokens, e.prefill_tokens, e.est_tokens) == (1001, 1001, 1011)
    assert e.prefix_key == est(text).prefix_key
    assert est(text, counted_tokens=1001, n_ctx=1005).est_tokens == 1005
    assert est(text).prompt_tokens == int(3000 / (2.0 * REFUSE_SAFETY))  # 1200: would not fit


def test_chat_prefix_key_shared_head():
    sys_msg = {"role": "system", "content": "You are a pirate. " * 10}
    a = est({"messages": [sys_msg, {"role": "user", "content": "hi"}], "max_tokens": 5})
    b = est({"messages": [sys_msg, {"role": "user", "content": "bye"}], "max_tokens": 5})
    c = est({"messages": [{"role": "system", "content": "Other. " * 30},
                          {"role": "user", "content": "hi"}]})
    assert a.prefix_key == b.prefix_key != c.prefix_key
    assert a.est_tokens > 5 and est({}).prefix_key is None
    parts = est({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab" * 50}]}]})
    assert parts.prompt_tokens > 0


def test_chat_prefix_chain_finds_the_previous_turn():
    sys_msg = {"role": "system", "content": "You are a pirate. " * 10}
    turn1 = [sys_msg, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Arr."}, {"role": "user", "content": "more"}]
    c1, c2 = est({"messages": turn1}).prefix_chain, est({"messages": turn2}).prefix_chain
    assert len(c1) == 2 and len(c2) == 4
    assert c2[:2] == c1  # turn 2's chain holds turn 1's last key, with the same tokens
    assert [n for _, n in c2] == sorted(n for _, n in c2)
    other = est({"messages": [sys_msg, {"role": "user", "content": "bye"}]}).prefix_chain
    assert other[0] == c1[0] and other[1] != c1[1]  # same system prompt, other chat


def test_long_chats_keep_head_and_tail_of_the_chain():
    from gateway.sizing import CHAIN_HEAD, CHAIN_TAIL
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(100)]
    full = est({"messages": msgs}).prefix_chain
    assert len(full) == CHAIN_HEAD + CHAIN_TAIL
    prev = est({"messages": msgs[:-2]}).prefix_chain
    assert prev[-1] in full and prev[0] == full[0]


def test_plain_prompt_chain_at_doubling_boundaries():
    chain = est({"prompt": "y" * 1000}).prefix_chain  # prefix_bytes 64, 2 bytes per token
    assert [n for _, n in chain] == [32, 64, 128, 256, 500]
    longer = est({"prompt": "y" * 1000 + "z" * 100}).prefix_chain
    assert longer[:4] == chain[:4] and longer[4] != chain[4]
    tokens = est({"prompt": list(range(100))}).prefix_chain
    assert [n for _, n in tokens] == [32, 64, 100]
    assert est({"prompt": 5}).prefix_chain == ()


def test_choices_is_the_slot_count_llama_server_runs_side_by_side():
    """``n_cmpl`` first, then its alias ``n`` (llama-server's order); anything it would refuse
    or that is absent counts as one slot."""
    assert choices({}) == 1
    assert choices({"n": 3}) == 3 and choices({"n": 2.9}) == 2
    assert choices({"n_cmpl": 2, "n": 4}) == 2 and choices({"n_cmpl": None, "n": 4}) == 4
    for bad in (0, -2, "3", True, None, float("nan"), [2]):
        assert choices({"n": bad}) == 1
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 5}
    est = estimate(body, bytes_per_token=4.0, prefix_bytes=512, unknown_num_predict=100)
    assert est.slots == 3 and est.est_tokens < 100  # the estimate is per choice (each slot)


def test_several_prompts_take_a_slot_each_times_n():
    """llama-server runs one task per prompt of a list with no integer at its top level
    (strings, token lists), times ``n``; a list with an integer is one prompt
    (tools/server/server-common.cpp ``tokenize_input_prompts``). The estimate covers every
    prompt: the largest must fit a slot, each is computed once, and ``est_tokens`` × ``slots``
    is the KV of all the tasks."""
    assert len(prompts_of({"prompt": ["a", "b", "c"]})) == 3
    assert len(prompts_of({"prompt": [[1, 2], [3]]})) == 2
    for one in ([1, 2, 3], ["a", 1], "abc", [], None):  # one prompt (or none): not several
        assert prompts_of({"prompt": one}) is None
    assert prompts_of({"messages": [{"role": "user", "content": "hi"}], "prompt": ["a", "b"]}) is None
    e = est({"prompt": ["x" * 200, "x" * 40, list(range(30))], "n": 2, "max_tokens": 10})
    assert (e.slots, e.prompts) == (6, 3)
    assert e.prompt_tokens == int(200 / (2.0 * REFUSE_SAFETY))  # the largest one
    assert e.prefill_tokens == 100 + 20 + 30
    assert e.est_tokens * e.slots == 2 * ((100 + 10) + (20 + 10) + (30 + 10))
    capped = est({"prompt": ["x" * 200, "x" * 40], "max_tokens": 10}, n_ctx=50)
    assert capped.est_tokens == (50 + 30) // 2  # each task's KV is capped at the slot context
    # one prompt in a list is that prompt
    assert est({"prompt": ["x" * 200], "max_tokens": 10}) == est({"prompt": "x" * 200,
                                                                   "max_tokens": 10})
