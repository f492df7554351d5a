"""Request size estimates and prefix keys (gateway.sizing)."""

from gateway.sizing import REFUSE_SAFETY, estimate


def est(body, **kw):
    return estimate(body, **{"bytes_per_token": 2.0, "prefix_bytes": 64,
                             "unknown_num_predict": 100, **kw})


def test_completion_prompt_and_budget():
    e = est({"prompt": "x" * 200, "n_predict": 50})
    assert e.est_tokens == 100 + 50
    assert e.prompt_tokens == int(200 / (2.0 * REFUSE_SAFETY))
    assert est({"prompt": "x" * 200}).est_tokens == 100 + 100  # unknown budget
    assert est({"prompt": "x" * 200, "n_predict": -1}, n_ctx=120).est_tokens == 120


def test_token_list_prompt_is_exact():
    e = est({"prompt": list(range(300)), "max_tokens": 10})
    assert e.prompt_tokens == 300 and e.est_tokens == 310


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
