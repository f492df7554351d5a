"""Admission ticket: what the scheduler knows about one request."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_seq = itertools.count()


@dataclass(eq=False)
class Ticket:
    """One request waiting for, or holding, a slot.

    Attributes:
        request_id: the gateway's request id (``X-Request-ID`` or generated).
        model: full model name (``demo:latest``) the request targets.
        priority: class; higher dispatches first. Aging raises it while it waits.
        est_tokens: the gateway's size estimate in tokens: prompt tokens + the tokens it may
            generate (``num_predict``, or a configured guess when unlimited); 0 if unknown.
            This is what the request may occupy in its slot's KV cache.
        prompt_tokens: estimated prompt tokens (0 if unknown); a prompt larger than every
            worker's per-slot context is refused up front (``Dispatcher.check_fits``).
        prefill_tokens: estimated prompt tokens the worker computes before the first token
            (prefill; 0 if unknown). Counted in its worker's prefill backlog until then.
        prefix_key: hash of the shared prompt prefix (system prompt / conversation head), or None.
        prefix_chain: (hash, estimated tokens) of the prompt up to each of its boundaries (chat
            messages), shortest first (``gateway.sizing.prefix_chain``); () if unknown.
        enqueued_at: clock seconds when it was admitted (set by the dispatcher; a retry
            admits the same ticket again, so this is its last attempt's).
        waited_s: seconds it spent queued in the attempts that got a slot, a retried
            request's earlier attempts included (the dispatcher adds each attempt's wait when
            it grants one; ``queue_wait_s``).
        granted: whether its last admission got a slot (set by the dispatcher).
        admitted: whether any admission of it got a slot: a retry after its worker failed
            (``Upstream.request``'s next attempt, or answer-again) is admitted again past
            ``max_pending``, as a ``follow_on`` is (it counts there): an accepted request was
            answered 503 "maximum pending requests exceeded" when its worker crashed (a fresh
            tester's find).
        queue_timeout_s: longest wait in the queue, seconds; None = no limit.
        seq: admission order, for FIFO within a priority class.
        avoid: ids of workers this request already failed on before any response byte; a
            retry goes to another worker when one can take it now.
        follow_on: part of a request admission already accepted (the inputs of an embedding
            batch, admitted as one request): it may wait in the queue beyond ``max_pending``
            (it still counts there), so an accepted request is never refused halfway.
        slots: slots the request occupies on its one worker (>= 1): a ``/v1`` request with
            ``n`` choices runs ``n`` tasks side by side there (llama-server ``n_cmpl``, alias
            ``n``), so it is dispatched only to a worker with that many free slots and holds
            them all until it ends (``gateway.sizing.choices``); a ``/v1/completions`` with
            several prompts runs ``n`` tasks for each, so ``slots`` is prompts × ``n``.
        held_until: clock seconds until which the queued ticket waits for the worker holding
            its prefix while another could take it (delay scheduling, set by the dispatcher);
            None when it does not.
        prompts: how many prompts ``slots`` is made of (1 unless a ``/v1/completions`` sends a
            list of prompts; ``gateway.sizing.prompts_of``). ``Dispatcher.cut_slots`` cuts
            the ``slots`` of several prompts down to the largest worker's slots (see there).
    """

    request_id: str
    model: str
    priority: int = 0
    est_tokens: int = 0
    prefix_key: int | None = None
    prefix_chain: tuple[tuple[int, int], ...] = ()
    queue_timeout_s: float | None = None
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    enqueued_at: float = 0.0
    seq: int = field(default_factory=lambda: next(_seq))
    avoid: frozenset[str] = frozenset()
    follow_on: bool = False
    slots: int = 1
    prompts: int = 1
    held_until: float | None = None
    waited_s: float = 0.0
    granted: bool = False
    admitted: bool = False

    def queue_wait_s(self, now: float) -> float:
        """Seconds the request spent queued over all its attempts, up to ``now`` (clock
        seconds) while it still waits: ``waited_s``, plus the time since ``enqueued_at`` when
        its last admission has no slot yet."""
        if self.granted or not self.enqueued_at:
            return self.waited_s
        return self.waited_s + max(0.0, now - self.enqueued_at)

    def deadline(self) -> float | None:
        """Clock seconds after which a still-queued ticket is expired, or None."""
        if self.queue_timeout_s is None:
            return None
        return self.enqueued_at + self.queue_timeout_s
