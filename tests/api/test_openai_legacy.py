"""OpenAI's legacy ``/v1/completions`` logprobs from llama-server's recorded events
(gateway/api/openai_legacy.py; events recorded from the pinned llama-server,
``record_openai_sse.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from gateway.api.errors import ApiError
from gateway.api.openai_fold import OpenAIFold
from gateway.api.openai_legacy import LegacyCompletions, check_logprobs, cmpl_id

RECORDED = json.loads((Path(__file__).with_name("openai_sse_recorded.json")).read_text())


def test_streamed_events_get_the_legacy_shape_per_choice():
    case = RECORDED["completion_n2_logprobs"]  # n=2, logprobs=2, 3 tokens each
    conv = LegacyCompletions(2)
    out = [orjson.loads(d) for d in conv.events([orjson.dumps(e) for e in case["events"]])]
    offsets: dict[int, int] = {}
    n = 0
    for src, ev in zip(case["events"], out):
        assert ev["id"] == "cmpl-" + src["id"].removeprefix("chatcmpl-")
        for s, c in zip(src.get("choices") or (), ev.get("choices") or ()):
            if s["logprobs"] is None:
                assert c["logprobs"] is None
                continue
            (e,) = s["logprobs"]["content"]  # one token per streamed event
            lp = c["logprobs"]
            assert lp["tokens"] == [e["token"]] and lp["token_logprobs"] == [e["logprob"]]
            assert lp["top_logprobs"] == [{t["token"]: t["logprob"] for t in e["top_logprobs"]}]
            assert lp["text_offset"] == [offsets.get(c["index"], 0)]
            offsets[c["index"]] = offsets.get(c["index"], 0) + len(e["token"])
            n += 1
    assert n == 6 and offsets == {0: 3, 1: 3}


def test_a_folded_answer_gets_the_legacy_shape_and_top_is_cut_to_the_ask():
    case = RECORDED["completion_n2_logprobs"]
    fold = OpenAIFold(chat=False, per_prompt=2)
    for e in case["events"]:
        fold.add(e)
    answer = LegacyCompletions(1).answer(fold.result())
    assert answer["id"].startswith("cmpl-")
    for c in answer["choices"]:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"] == [0, 1, 2]
        for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            # the likeliest alternative, plus the sampled token where it was not that one
            assert 1 <= len(top) <= 2 and top[tok] == logprob


def test_events_without_logprobs_only_change_the_id():
    data = orjson.dumps(RECORDED["completion"]["events"][0])
    (got,) = LegacyCompletions(None).events([data])
    assert got == data.replace(b'"id":"chatcmpl-', b'"id":"cmpl-')
    assert LegacyCompletions(None).events([b"null"]) == [b"null"]
    assert cmpl_id("chatcmpl-abc") == "cmpl-abc" and cmpl_id("x-1") == "x-1"


@pytest.mark.parametrize("value,n_probs", [(None, None), (0, 1), (1, 1), (5, 5), (20, 20)])
def test_check_logprobs_asks_llama_server_for_at_least_one(value, n_probs):
    body = {"prompt": "hi"} if value is None else {"prompt": "hi", "logprobs": value}
    assert check_logprobs(body) == value
    assert body.get("n_probs") == n_probs


def test_check_logprobs_keeps_a_clients_own_n_probs():
    body = {"logprobs": 2, "n_probs": 7}
    check_logprobs(body)
    assert body["n_probs"] == 7


@pytest.mark.parametrize("value", [True, False, -1, 21, 1.5, "2", [1]])
def test_check_logprobs_refuses_what_is_not_an_integer_in_range(value):
    with pytest.raises(ApiError) as e:
        check_logprobs({"logprobs": value})
    assert e.value.status == 400 and "between 0 and 20" in e.value.message


def test_echo_true_is_refused_not_dropped():
    """llama-server ignored ``echo`` without a word: the answer lacked the prompt."""
    check_logprobs({"echo": False, "logprobs": 1})
    for value, msg in ((True, "echo is not supported"), ("yes", "echo must be a boolean")):
        with pytest.raises(ApiError) as e:
            check_logprobs({"echo": value})
        assert e.value.status == 400 and e.value.message.startswith(msg)
