"""Unit tests of the request usage sum (gateway/api/openai_usage.py), no workers needed.

Usages are in llama-server's shape (``usage_json_oaicompat``); the counts are the ones a
pinned worker gave for ``prompt: ["a b c d", "hello world foo"], n: 2`` (its tasks 0-1 and 2-3
report their prompt's counts each), plus hand-made ones for the edge cases.
"""

from __future__ import annotations

from gateway.api.openai_usage import UsageSum


def _u(completion: int, prompt: int, cached: int | None = None) -> dict:
    u = {"completion_tokens": completion, "prompt_tokens": prompt,
         "total_tokens": completion + prompt}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def test_two_prompts_times_n2_count_each_prompt_once_and_every_completion():
    s = UsageSum(per_prompt=2)
    # the order the worker finished them in: tasks 1, 2, 0, 3
    for index, usage in ((1, _u(4, 4, 1)), (2, _u(3, 7, 6)), (0, _u(4, 4, 1)), (3, _u(2, 7, 6))):
        s.add(usage, index)
    assert s.total() == {"completion_tokens": 13, "prompt_tokens": 11, "total_tokens": 24,
                         "prompt_tokens_details": {"cached_tokens": 7}}


def test_a_chat_usage_chunk_names_no_choice_and_counts_for_the_one_prompt():
    s = UsageSum(per_prompt=3)
    for _ in range(3):
        s.add(_u(50, 19, 0), None)
    assert s.total() == {"completion_tokens": 150, "prompt_tokens": 19, "total_tokens": 169,
                         "prompt_tokens_details": {"cached_tokens": 0}}


def test_several_prompts_with_n1_sum_every_prompt():
    s = UsageSum(per_prompt=1)
    for i, (c, p) in enumerate(((4, 1), (4, 2), (1, 9))):
        s.add(_u(c, p), i)
    assert s.total() == {"completion_tokens": 9, "prompt_tokens": 12, "total_tokens": 21}


def test_one_task_keeps_the_workers_object_and_none_before_any():
    s = UsageSum(per_prompt=1)
    assert s.total() is None
    one = {**_u(8, 3, 0), "extra": 1}
    s.add(one, 0)
    assert s.total() is one


def test_missing_or_odd_counts_count_as_zero():
    s = UsageSum(per_prompt=1)
    s.add({"completion_tokens": 2, "prompt_tokens": True}, 0)
    s.add({"completion_tokens": None, "prompt_tokens": 5,
           "prompt_tokens_details": {"cached_tokens": "x"}}, 1)
    s.add("not a usage", 2)  # type: ignore[arg-type]
    assert s.total() == {"completion_tokens": 2, "prompt_tokens": 5, "total_tokens": 7,
                         "prompt_tokens_details": {"cached_tokens": 0}}
