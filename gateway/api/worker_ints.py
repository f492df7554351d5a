"""Integer fields of a generation body kept to what llama-server can take.

* **32-bit fields.** llama-server reads its integer parameters into 32-bit ints (server-schema.cpp
  ``field_num`` over ``int32_t`` members), so a larger JSON value wraps: ``n_predict:
  4294967296`` generated 1 token and ``top_k: 4294967297`` became greedy sampling (a fresh
  tester's find). Ollama's ``options`` and OpenAI's fields are 64-bit, so the gateway clamps
  them to the 32-bit range first (a budget far past 2**31 means "no limit" either way; a
  negative budget past it becomes -1, llama-server's "no limit").
* **Penalty windows.** ``repeat_last_n`` and ``dry_penalty_last_n`` size a ring buffer of that
  many tokens in the worker's sampler (llama-sampler.cpp ``llama_sampler_init_penalties`` /
  ``llama_sampler_init_dry``, whenever the penalty is on): ``repeat_last_n: 1000000000`` with
  ``repeat_penalty: 1.1`` made the worker allocate 4 GB inside its main loop, which stalled it
  past the liveness probe, so the gateway restarted it (seen here; a client could do that to
  every worker). A window longer than the slot's context sees nothing more, so both are capped
  at the per-slot context (tokens); -1 ("the whole context": Ollama's docs/modelfile.md for
  ``repeat_last_n``, llama-server's own help for ``dry_penalty_last_n``) becomes that context,
  where the pinned llama-server refused -1 with 400.
* **No endless generation.** A budget left unbounded (-1, absent) or above 10 times the slot's
  context is 10 times that context, as Ollama's runner caps ``num_predict`` "to avoid the
  model running on forever" (llm/server.go ``Completion``). Without llama-server's
  ``--context-shift`` the context's end stops a generation first; with it (in a model's
  ``args``) a request without ``num_predict`` never ended (a fresh tester's find: 23,235
  tokens in 15 s on a 256-token slot, still going).
"""

from __future__ import annotations

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1

#: Token budgets: a negative value past the 32-bit range becomes -1 (no limit).
BUDGETS = ("n_predict", "max_tokens", "max_completion_tokens")
#: Other 32-bit integer parameters of llama-server's ``/completion`` and ``/v1`` bodies.
INT32_FIELDS = BUDGETS + ("top_k", "n_keep", "min_keep", "n_indent", "n_probs",
                          "dry_allowed_length", "n_discard")
#: A generation's longest budget, in slot contexts (Ollama's ``10 * num_ctx``).
MAX_CONTEXTS = 10
#: Windows (tokens) that size a buffer in the worker's sampler.
WINDOWS = ("repeat_last_n", "dry_penalty_last_n")


def bound(body: dict, context: int) -> None:
    """Clamp ``body``'s 32-bit integer fields in place, cap its token budget at
    ``MAX_CONTEXTS`` × ``context`` (tokens per slot; adding ``n_predict`` when it has none)
    and its penalty windows at ``context`` (0 = unknown: budget and windows left as they are). A number written as
    a float (``1e9``, ``40.0``) is taken as llama-server takes it, truncated to an integer
    (nlohmann's ``get<int32_t>``), and then bounded: ``repeat_last_n: 1e9`` got past an
    integers-only check and wedged a worker (a fresh tester's find). Other types are left
    for the API's own checks or llama-server's 400."""
    for k in INT32_FIELDS + WINDOWS:
        v = body.get(k)
        if type(v) is float:
            body[k] = v = _truncated(v)
        if type(v) is int and not INT32_MIN <= v <= INT32_MAX:
            body[k] = INT32_MAX if v > 0 else (-1 if k in BUDGETS else INT32_MIN)
    if context <= 0:
        return
    most = MAX_CONTEXTS * context
    budgets = [k for k in BUDGETS if type(body.get(k)) is int]
    for k in budgets:
        if body[k] < 0 or body[k] > most:
            body[k] = most
    if not budgets and not any(body.get(k) is not None for k in BUDGETS):
        body["n_predict"] = most  # llama-server prefers it to max_tokens
    for k in WINDOWS:
        v = body.get(k)
        if type(v) is int and (v > context or v == -1):
            body[k] = context


def _truncated(v: float) -> int:
    """``v`` toward zero as an int; infinities as the 32-bit bound of their sign (NaN: 0)."""
    if v != v:
        return 0
    if v in (float("inf"), float("-inf")):
        return INT32_MAX if v > 0 else INT32_MIN
    return int(v)
