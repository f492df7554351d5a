"""Why a request is refused at once instead of waiting in the queue (pure: no I/O).

Waiting only helps while some worker of the model is ready, starting or restarting. When none
can take a request without an operator or the supervisor's next scheduled try, the request
(queued or new) is answered at once with one of these, in the API's own error shape:

============== ====== ============================================= ===========================
exception      status when                                          Retry-After
============== ====== ============================================= ===========================
AllDrained     503    every worker of the model is drained by the    ``queue.retry_after_s``
                      operator (admin ``drain``)                     (an undrain brings it back)
AllFailed      503    every worker is in the crash-loop ``failed``   seconds until the
                      state, or failed and the rest drained          supervisor's next start
                      (``workers.supervisor``)                       (none if none is scheduled)
ShuttingDown   503    the gateway's shutdown drain time ran out      ``queue.retry_after_s`` (a
                      while the request was still queued             restarted gateway or another
                                                                     instance can take it)
ModelRemoved   404    a config reload removed the model (its last    none: the model is gone;
                      worker was removed)                            Ollama and OpenAI answer an
                                                                     unknown model with 404
NoWorkers      503    the config plans no worker for the model on    none: only a config change
                      this machine (no GPU and cpu_fallback 0)       helps
NotStarted     503    a reload added the model, but its workers did  none: only a config change
                      not start and were removed again               helps
============== ====== ============================================= ===========================

Retry-After is sent only where a retry can help (RFC 9110 §10.2.3: seconds the client should
wait). The texts live in ``gateway.texts``.
"""

from __future__ import annotations

from gateway.texts import (all_drained, model_removed, no_workers, not_started,
                          shutting_down_queued, workers_failed)


class Unavailable(Exception):
    """Base of the refusals above.

    Attributes:
        model: full model name of the refused request ("" when not model-specific).
        status: HTTP status to answer with.
        retry: whether a Retry-After header is sent.
        retry_after_s: its value in seconds; None means the configured ``queue.retry_after_s``.
        code / type: OpenAI's error ``code`` and ``type`` for ``/v1`` (None: by status).
    """

    status = 503
    retry = True
    code: str | None = None
    type: str | None = None

    def __init__(self, model: str, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.model, self.retry_after_s = model, retry_after_s

    def headers(self, default_retry_s: int) -> dict[str, str]:
        """Response headers: ``{"Retry-After": seconds}`` when a retry can help, else ``{}``."""
        if not self.retry:
            return {}
        return {"Retry-After": str(self.retry_after_s or default_retry_s)}


class AllDrained(Unavailable):
    """Every worker of the ticket's model is drained by the operator (admin ``drain``): answered
    503 at once (and queued tickets of that model leave the queue) instead of waiting
    ``queue.timeout_s`` for a worker the operator took out of rotation. Workers that are starting
    or restarting are not drained, so requests still wait for those."""

    def __init__(self, model: str):
        super().__init__(model, all_drained(model))


class AllFailed(Unavailable):
    """Every worker of the model gave up restarting (supervisor ``failed`` after a crash loop),
    or is failed or drained by the operator with at least one failed. ``retry_in_s``: whole
    seconds until the first failed worker's next automatic start (None: none scheduled, and
    then no Retry-After). ``drained``: how many of the workers are operator-drained instead."""

    def __init__(self, model: str, retry_in_s: int | None, drained: int = 0):
        super().__init__(model, workers_failed(model, retry_in_s, drained), retry_in_s)
        self.retry = retry_in_s is not None


class ShuttingDown(Unavailable):
    """The gateway is shutting down and the request was still queued when ``shutdown.drain_s``
    ran out (gateway/drain.py); later requests that reach admission get it too."""

    def __init__(self, model: str = ""):
        super().__init__(model, shutting_down_queued())


class ModelRemoved(Unavailable):
    """A config reload removed the model: queued tickets of it and requests that resolved it just
    before the reload. 404 like Ollama's and OpenAI's answer for an unknown model, no
    Retry-After: retrying the same request cannot succeed until the model is configured again."""

    status = 404
    retry = False
    code = "model_not_found"  # /v1: as an unknown model there (errors.model_not_found_v1)
    type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(model, model_removed(model))


class NoWorkers(Unavailable):
    """The model is configured but its plan has no worker on this machine (``gpus: auto`` found
    no GPU and ``cpu_fallback`` is 0): waiting cannot help, so 503 at once, with
    no Retry-After."""

    retry = False

    def __init__(self, model: str):
        super().__init__(model, no_workers(model))


class NotStarted(Unavailable):
    """The model is configured, but a config reload that added its workers removed them again
    because they did not start (``gateway.reload.Reloader._check_added``; ``why``: the worker's
    state and llama-server's reason). 503 at once, no Retry-After: only a config change helps."""

    retry = False

    def __init__(self, model: str, why: str):
        super().__init__(model, not_started(model, why))
