"""``/v1`` usage of a several-task request is the whole request's, as OpenAI reports it
(gateway/api/openai_usage.py), with the real ``openai`` client against a real worker.

llama-server reports a usage per task (``n > 1``, a list of prompts): non-streamed its answer
carries task 0's, streamed every task's finish chunk carries its own. The expected sums come
from what can be seen apart from the answer under test: each prompt's ``prompt_tokens`` from a
single-task request of the same prompt; the completion tokens and the cached prompt tokens
from the worker's own ``/metrics`` counters (``tokens_predicted_total`` counts every task's
generated tokens, ``prompt_tokens_cached_total`` each prompt's cached tokens once: the ``n - 1``
child tasks copy their parent's evaluated prompt). ``ignore_eos`` makes every task run to
``max_tokens``, so the counts do not depend on the random model's text.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import model, worker_metrics
from tests.e2e.test_watchdog import wait_for

pytestmark = pytest.mark.slow

MAX = 5
EXTRA = {"ignore_eos": True}  # every task generates exactly MAX tokens (finish_reason "length")
PROMPTS = ["one two three", "a second prompt, longer than the first one by some words"]
MSG = [{"role": "user", "content": "hello there, how are you"}]


@pytest.fixture(scope="module")
def gw(module_gateway_factory):
    # one worker with 4 slots: 2 prompts x n=2 run side by side on it
    return module_gateway_factory(base_config(free_port(), models=[model("demo", slots=4)]))


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def _generated_total(gw) -> float:
    """The gateway's own ``llama_gateway_generated_tokens_total`` of the model."""
    for fam in text_string_to_metric_families(httpx.get(gw.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "llama_gateway_generated_tokens_total" and s.labels == {"model": "demo:latest"}:
                return s.value
    return 0.0


class Counts:
    """Deltas of the worker's and the gateway's token counters over a ``with`` block."""

    def __init__(self, gw):
        self.gw, self.worker = gw, gw.workers()[0]

    def __enter__(self):
        self.before, self.gw_before = worker_metrics(self.worker), _generated_total(self.gw)
        return self

    def __exit__(self, *exc):
        after = worker_metrics(self.worker)
        self.generated = after["llamacpp:tokens_predicted_total"] - self.before["llamacpp:tokens_predicted_total"]
        self.cached = after["llamacpp:prompt_tokens_cached_total"] - self.before["llamacpp:prompt_tokens_cached_total"]

    def gateway_generated(self) -> float:
        return _generated_total(self.gw) - self.gw_before


def _check(usage, counts: Counts, prompt_tokens: int, tasks: int) -> None:
    assert usage.completion_tokens == tasks * MAX == counts.generated
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == prompt_tokens + tasks * MAX
    assert usage.prompt_tokens_details.cached_tokens == counts.cached
    # the gateway's token counter counts the whole request too
    wait_for(lambda: counts.gateway_generated() == tasks * MAX, 10, "gateway generated_tokens")


def _stream(create, **kw) -> tuple[list, object]:
    """A streamed request with ``include_usage``: (finish reasons by choice index, usage)."""
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []  # one, last
    finish = {c.choices[0].index: c.choices[0].finish_reason
              for c in chunks[:-1] if c.choices[0].finish_reason}
    return [finish[i] for i in sorted(finish)], chunks[-1].usage


def _run(gw, create, stream: bool, **kw) -> tuple[list, object, Counts]:
    """One several-task request, streamed (with ``include_usage``) or not: (finish reasons
    by choice index, usage, the counters' deltas over it)."""
    with Counts(gw) as counts:
        if stream:
            finish, usage = _stream(create, **kw)
        else:
            r = create(**kw)
            finish, usage = [c.finish_reason for c in r.choices], r.usage
    return finish, usage, counts


def _prompt_tokens(create, **kw) -> int:
    """``prompt_tokens`` of a single-task request (which also runs to ``max_tokens``)."""
    r = create(model="demo", max_tokens=MAX, extra_body=EXTRA, **kw)
    assert r.usage.completion_tokens == MAX
    return r.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_several_prompts_times_n_sum_completions_and_count_each_prompt_once(gw, client, stream):
    create = client.completions.create
    per_prompt = [_prompt_tokens(create, prompt=p) for p in PROMPTS]
    assert per_prompt[0] != per_prompt[1]  # so counting one prompt for both would show
    want_prompt = sum(per_prompt)
    finish, usage, counts = _run(gw, create, stream, model="demo", prompt=PROMPTS, n=2,
                                 max_tokens=MAX, extra_body=EXTRA)
    assert finish == ["length"] * 4
    assert counts.cached > 0  # the single-task requests left both prompts cached
    _check(usage, counts, want_prompt, tasks=4)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_chat_n3_sums_completions_and_counts_the_prompt_once(gw, client, stream):
    create = client.chat.completions.create
    want_prompt = _prompt_tokens(create, messages=MSG)
    finish, usage, counts = _run(gw, create, stream, model="demo", messages=MSG, n=3,
                                 max_tokens=MAX, extra_body=EXTRA)
    assert finish == ["length"] * 3
    _check(usage, counts, want_prompt, tasks=3)


def test_one_task_keeps_the_workers_usage(gw, client):
    """A single task's usage is relayed as the worker counted it (nothing summed)."""
    with Counts(gw) as counts:
        r = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=MAX,
                                      extra_body=EXTRA)
    _check(r.usage, counts, r.usage.prompt_tokens, tasks=1)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
@pytest.mark.parametrize("prompt", [
    "", ["", "one two three"],
    # llama-server's object form of a prompt (server-common.cpp tokenize_input_subprompt)
    {"prompt_string": ""}, [{"prompt_string": ""}, {"prompt_string": "one two three"}],
], ids=["empty", "empty-in-list", "empty-object", "empty-object-in-list"])
def test_empty_prompt_with_n_is_answered_and_leaves_the_worker_alone(gw, stream, prompt):
    """Tester's find: the pinned llama-server never answers ``n`` ≥ 2 for a prompt with no
    tokens (choice 0, then nothing), and the gateway's watchdog then restarted the worker as
    wedged. The gateway sends such a body as each prompt repeated ``n`` times
    (``openai.spread_empty_prompts``): every choice comes, in order, and the worker stays up.
    A later tester's find: the same for ``{"prompt_string": ""}`` (alone or in a list)."""
    short = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    worker = gw.workers()[0]
    prompts = prompt if isinstance(prompt, list) else [prompt]
    finish, usage, counts = _run(gw, short.completions.create, stream, model="demo",
                                 prompt=prompt, n=2, max_tokens=MAX, extra_body=EXTRA)
    assert finish == ["length"] * (2 * len(prompts))
    # an empty prompt generates nothing, as with n = 1 (llama-server: "" and finish "length")
    non_empty = sum(1 for p in prompts if (p.get("prompt_string") if isinstance(p, dict) else p))
    assert usage.completion_tokens == 2 * non_empty * MAX == counts.generated
    after = gw.workers()[0]
    assert (after["pid"], after["state"], after.get("restarts", 0)) == \
        (worker["pid"], "ready", worker.get("restarts", 0))


def test_include_usage_must_be_a_boolean(gw, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="hi", max_tokens=2, stream=True,
                                  stream_options={"include_usage": "yes"})
    assert "stream_options.include_usage must be a boolean" in str(e.value)
