"""User-facing error texts shared by the APIs and the (I/O-free) scheduler."""

# Ollama's runner text for a prompt over the context when context shift is off (llm/server.go).
CONTEXT_OVERFLOW_MESSAGE = ("the prompt is longer than the context length currently available to the "
                            "model; shorten the prompt, adjust the context length in settings, or use "
                            "a model with a longer context length")

# llama-server's words when a decode finds no free KV cells (server-context.cpp: it then fails
# every slot it is processing with them, status 500) and the gateway's for the same fault.
KV_EXHAUSTED_WORKER_TEXT = "Context size has been exceeded."
KV_EXHAUSTED_MESSAGE = ("the worker ran out of KV cache for the requests it was running together "
                        "(its slots share one cache), so llama-server ended them all (\"Context "
                        "size has been exceeded.\"); please retry")


def header_text(value: str) -> str:
    """A request header's value made safe to show in an error text or a log: ``value`` is what
    aiohttp's parser gives (bytes that are not UTF-8 decoded as surrogate escapes, e.g.
    ``\\udce9`` for a Latin-1 ``é``), returned with each such byte written ``\\xNN``
    (``caf\\xe9.com``), as Go's ``%q`` under Ollama shows them; valid UTF-8 stays as it is.
    The result encodes as UTF-8 (a raw surrogate made orjson refuse the error body)."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


#: A request past ``timeouts.request_s`` (504): the watchdog's cut, the wait for a slot, a
#: side call begun after it.
DEADLINE_MESSAGE = "request deadline exceeded"


def context_overflow(prompt_tokens: int, n_ctx: int, approx: bool = False,
                     at_least: bool = False) -> str:
    """Ollama's over-long-prompt text plus the numbers (tokens): one message for every place
    that finds it (the exact /tokenize check, the scheduler's estimate, the worker's own 400,
    the fewest tokens the prompt's bytes can take: ``at_least``)."""
    about = "at least " if at_least else "about " if approx else ""
    return (f"{CONTEXT_OVERFLOW_MESSAGE} (prompt: {about}{prompt_tokens} tokens, "
            f"context per slot: {n_ctx} tokens)")


def too_many_choices(slots: int, max_slots: int) -> str:
    """A ``/v1`` request whose ``n`` (choices generated side by side, one slot each on one
    worker) exceeds the slots of every worker of its model."""
    return (f"n = {slots} asks for {slots} choices at once, each taking a slot of the same "
            f"worker, but the workers of this model have at most {max_slots} slots; ask for at "
            f"most {max_slots} (or raise the model's slots in the gateway config)")


def all_drained(model: str) -> str:
    """Every worker of ``model`` was drained by the operator (admin ``drain``)."""
    return f"every worker of model '{model}' is drained; please try again later"


def workers_failed(model: str, retry_in_s: int | None, drained: int = 0) -> str:
    """Every worker of ``model`` is in the supervisor's crash-loop ``failed`` state (``drained``
    of them, if any, are also drained by the operator). ``retry_in_s``: seconds until the
    supervisor's next automatic start (None: none scheduled)."""
    also = f" ({drained} of them drained by the operator)" if drained else ""
    when = (f"the gateway tries to start them again in {retry_in_s} s"
            if retry_in_s is not None else "no automatic restart is scheduled")
    return (f"model '{model}' is unavailable: every worker of it failed{also} (crash loop: it "
            f"keeps exiting, wedging or failing to start; see the gateway log); {when}, or an "
            f"operator can restart one now (llama-gateway worker restart ID)")


# The middleware's answer to a request that arrives after shutdown began (gateway/middleware.py).
SHUTTING_DOWN_MESSAGE = "server shutting down, please try again"


def shutting_down_queued() -> str:
    """A queued request still waiting when the gateway's shutdown drain time ran out."""
    return (f"{SHUTTING_DOWN_MESSAGE}: the gateway is shutting down and stopped before a worker "
            f"slot became free for this request")


def shutting_down_running() -> str:
    """A running request cut when the gateway stopped its workers at the end of its shutdown
    drain time (``shutdown.drain_s``)."""
    return (f"{SHUTTING_DOWN_MESSAGE}: the gateway is shutting down and stopped its workers "
            f"before this answer was complete")


def no_workers(model: str) -> str:
    """A request for a configured ``model`` whose config plans no worker on this machine."""
    return (f"model '{model}' has no worker on this machine: its config plans none (gpus: auto "
            "found no NVIDIA GPU and cpu_fallback is 0); change the config and reload")


def not_started(model: str, why: str) -> str:
    """A request for a configured ``model`` whose only workers a config reload added and then
    removed again because they did not start (``why``: the worker's state and reason)."""
    return (f"model '{model}' has no running worker: the config reload that added it could not "
            f"start its worker ({why}); fix the config and reload")


def model_removed(model: str) -> str:
    """A request for ``model`` after a config reload removed it (every worker stopped)."""
    return f"model '{model}' not found (removed from the gateway's config by a reload)"


def side_call_failed(model: str, path: str, why: str) -> str:
    """No worker of ``model`` answered the side call ``path`` (``/tokenize`` …) after retries on
    every worker in rotation; ``why``: the last failure in words (no addresses: those are
    logged)."""
    return (f"no worker of model '{model}' answered {path} ({why}); the gateway tried every "
            f"worker in rotation, please retry")


def side_call_crashed(model: str, path: str, second: bool) -> str:
    """A worker of ``model`` exited while it computed the side call ``path`` for this request,
    and another did too (``second``: evidence against the request), or none other is left to
    try: not tried again."""
    if second:
        return (f"two workers of model '{model}' exited while they computed {path} for this "
                f"request: it is not tried again (a request that crashes workers would take "
                f"each in turn)")
    return (f"a worker of model '{model}' exited while it computed {path} for this request, "
            f"and no other worker of the model is left to try it on; the worker is restarted, "
            f"please retry once it is back")


def side_call_too_big(model: str, path: str, size: int, timeout_s: float) -> str:
    """A side call ``path`` of ``size`` bytes that a worker of ``model`` did not answer within
    ``timeout_s`` seconds: not retried (``worker_calls.BIG_BODY_BYTES``)."""
    return (f"a worker of model '{model}' did not answer {path} within {timeout_s:g} s for "
            f"{size / 2**20:.1f} MiB of input; input this large is not sent again; send less")


def side_call_unsupported(model: str, path: str, status: int) -> str:
    """A worker of ``model`` answered the side call ``path`` with ``status`` 404 or 405: its
    llama-server does not serve that endpoint (an older or different build)."""
    return (f"the workers of model '{model}' do not serve {path} (HTTP {status} from "
            f"llama-server); the gateway needs a llama-server build with it")


def no_ready_worker(model: str) -> str:
    """No worker of ``model`` came into rotation while a side call waited for one."""
    return f"no ready worker for model '{model}'; please try again"


#: A request's answer when the gateway could not open a socket to a worker because it has no
#: file descriptors left (EMFILE/ENFILE): the gateway's own limit, not the worker's fault.
OUT_OF_DESCRIPTORS = ("the gateway has no file descriptors left (its open-files limit, "
                      "RLIMIT_NOFILE, is reached: too many open connections); please retry")
