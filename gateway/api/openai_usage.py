"""Sum llama-server's per-task ``usage`` into the usage OpenAI reports for a whole request.

llama-server runs a ``/v1`` request with ``n`` choices (``n_cmpl``) or a list of prompts as
several tasks and reports a usage per task (pinned llama.cpp ``0c1e570``,
``tools/server/server-task.cpp`` ``usage_json_oaicompat``: ``{"completion_tokens",
"prompt_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}``); streamed, each
task's usage comes with its own finish chunk, non-streamed, the answer carries task 0's only
(``handle_completions_impl``). Task indexes are prompt-major: the tasks of prompt ``p`` are the
choices ``p * n`` to ``p * n + n - 1`` (``server_response_reader::post_tasks``), and the
``n - 1`` child tasks of a prompt report the prompt and cached counts of their parent, whose
evaluated prompt they copy (``copy_state_to``; checked on the pinned build).

OpenAI reports usage for the whole request: ``completion_tokens`` summed over all choices,
``prompt_tokens`` (and ``prompt_tokens_details.cached_tokens``) counted once per prompt, so for
``n > 1`` once and for a list of prompts summed over the prompts, and ``total_tokens`` their
sum. :class:`UsageSum` computes that from the per-task usages.
"""

from __future__ import annotations


class UsageSum:
    """The request's usage from its tasks' usages.

    Args:
        per_prompt: tasks per prompt (the body's ``n_cmpl`` / ``n``; ``gateway.sizing.choices``).
    """

    def __init__(self, per_prompt: int):
        self.per_prompt = max(1, per_prompt)
        self._tasks: list[dict] = []
        self._prompts: dict[int, dict] = {}  # prompt number -> the first usage seen of its tasks

    def add(self, usage: dict, index: int | None) -> None:
        """Count one task's ``usage``. ``index`` is its choice index; None for a usage that
        names no choice (a chat stream's usage chunk, ``choices: []``), which counts for prompt
        0: a chat request has a single prompt."""
        if not isinstance(usage, dict):
            return
        self._tasks.append(usage)
        self._prompts.setdefault((index or 0) // self.per_prompt, usage)

    def total(self) -> dict | None:
        """The summed usage in llama-server's key order, None before any :meth:`add`. With a
        single task it is that task's usage object unchanged. ``prompt_tokens_details`` is
        present when a usage counted for a prompt has it. A count that is missing or not an
        integer counts as 0."""
        if len(self._tasks) <= 1:
            return self._tasks[0] if self._tasks else None
        completion = sum(_count(u.get("completion_tokens")) for u in self._tasks)
        prompt = sum(_count(u.get("prompt_tokens")) for u in self._prompts.values())
        out = {"completion_tokens": completion, "prompt_tokens": prompt,
               "total_tokens": completion + prompt}
        details = [u.get("prompt_tokens_details") for u in self._prompts.values()]
        if any(isinstance(d, dict) for d in details):
            out["prompt_tokens_details"] = {"cached_tokens": sum(
                _count(d.get("cached_tokens")) for d in details if isinstance(d, dict))}
        return out


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
