"""Which prompt prefixes each worker probably still holds in its prompt cache (pure; no I/O).

Every placement is recorded: the ticket's prefix keys (its head key and prefix chain,
``gateway.sizing``) under the worker it went to, stamped with the tokens that worker's caches
have taken in so far. llama-server evicts least recently used first, both its slots
(``get_available_slot`` takes the least recently used idle slot) and its host prompt cache
(oldest saved first), so a prefix counts as still cached while fewer than ``capacity`` tokens
came in after it (LRU stack distance in tokens).

What comes in with a request: its whole sequence (``tokens``: prompt + answer budget), since the
host cache stores whole sequences and keeps one per request even when they share a system
prompt; except when the request extends the whole prompt of an earlier request on that worker
(the next turn of a conversation), which the cache replaces (server-task.cpp ``alloc`` drops
entries contained in the new one): then only the tokens beyond the earlier prompt come in.

``capacity`` is the worker's ``cache_tokens`` (slots + host cache), else its ``kv_capacity``.
Stale keys are pruned when a worker's table has doubled since its last prune, so memory stays
proportional to what the caches can hold.
"""

from __future__ import annotations

from typing import Sequence

Chain = Sequence[tuple[int, int]]


class PrefixIndex:
    """See module docstring. Keys are 64-bit prefix hashes, tokens are estimates."""

    def __init__(self) -> None:
        self._keys: dict[str, dict[int, int]] = {}  # worker -> key -> tokens taken in when last used
        self._ends: dict[str, set[int]] = {}        # worker -> keys that ended a request's prompt
        self._taken: dict[str, int] = {}            # worker -> tokens its caches took in so far
        self._prune_at: dict[str, int] = {}

    def _match(self, worker_id: str, chain: Chain, capacity: int) -> tuple[int, int | None]:
        """(tokens, key) of the longest boundary of ``chain`` still cached on the worker."""
        keys = self._keys.get(worker_id)
        if keys:
            taken = self._taken[worker_id]
            for key, tokens in reversed(chain):
                at = keys.get(key)
                if at is not None and taken - at < capacity:
                    return tokens, key
        return 0, None

    def cached_tokens(self, worker_id: str, chain: Chain, capacity: int) -> int:
        """Estimated tokens at the head of ``chain`` that ``worker_id`` still holds: those of the
        longest boundary it was sent within its last ``capacity`` tokens taken in, else 0."""
        return self._match(worker_id, chain, capacity)[0]

    def record(self, worker_id: str, chain: Chain, tokens: int, capacity: int) -> None:
        """``chain`` ((key, tokens), shortest first) was sent to ``worker_id`` with a request that
        may occupy ``tokens`` tokens; ``capacity``: tokens the worker can keep cached."""
        if not chain:
            return
        held, key = self._match(worker_id, chain, capacity)
        keys = self._keys.setdefault(worker_id, {})
        ends = self._ends.setdefault(worker_id, set())
        if key in ends:  # extends an earlier request's whole prompt: that entry is replaced
            ends.discard(key)
            tokens -= held
        taken = self._taken.get(worker_id, 0) + max(1, tokens)
        self._taken[worker_id] = taken
        for k, _ in chain:
            keys[k] = taken
        ends.add(chain[-1][0])
        if len(keys) > self._prune_at.get(worker_id, 1024):
            for k in [k for k, at in keys.items() if taken - at >= capacity]:
                del keys[k]
                ends.discard(k)
            self._prune_at[worker_id] = max(1024, 2 * len(keys))

    def forget(self, worker_id: str) -> None:
        """The worker restarted or left: its caches are gone."""
        for table in (self._keys, self._ends, self._taken, self._prune_at):
            table.pop(worker_id, None)
