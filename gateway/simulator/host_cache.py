"""llama-server's host-memory prompt cache (``--cache-ram``), modelled on token sequences.

Follows the pinned build's source (llama_cpp_python 0.3.36's vendored llama.cpp,
tools/server/server-task.cpp ``server_prompt_cache::alloc`` / ``load`` / ``update``):

- ``save`` (``alloc``): a sequence already contained in an entry is not saved again; entries
  contained in the new one are dropped; the oldest entries are evicted until it fits the byte
  limit; a sequence larger than the whole limit is not saved.
- ``load``: the entry that shares more of the new prompt than the slot's own content does, both
  as a fraction of the entry (``f_keep``, at least 0.25) and of the new prompt (``f_sim``), is
  copied into the slot and leaves the cache.
- Eviction is oldest-saved first, by bytes (``kv_bytes_per_token`` per token).

A sequence is a tuple of segments ``(content id, tokens)``: two sequences share a prefix as far as
their segments are equal (a segment with the same id and a different length is shared up to the
shorter one). Token ids themselves are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Segment = tuple[object, int]
Seq = tuple[Segment, ...]


def seq_len(seq: Seq) -> int:
    """Tokens of a sequence."""
    return sum(n for _, n in seq)


def common_prefix(a: Seq, b: Seq) -> int:
    """Tokens at the head of ``a`` and ``b`` that are the same (llama.cpp ``get_common_prefix``)."""
    n = 0
    for (ia, na), (ib, nb) in zip(a, b):
        if ia != ib:
            break
        n += min(na, nb)
        if na != nb:
            break
    return n


@dataclass
class HostPromptCache:
    """See module docstring. ``limit_bytes``: ``--cache-ram`` × 2**20 (0 = disabled)."""

    limit_bytes: int
    kv_bytes_per_token: int
    entries: list[tuple[Seq, int]] = field(default_factory=list)  # (sequence, tokens), oldest first

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0 and self.kv_bytes_per_token > 0

    def tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def _bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def save(self, seq: Seq) -> int:
        """Copy a slot's sequence into the cache. Returns the tokens copied (0 if skipped)."""
        n = seq_len(seq)
        if not self.enabled or n == 0 or self._bytes(n) > self.limit_bytes:
            return 0
        if any(common_prefix(e, seq) == n for e, _ in self.entries):
            return 0  # already contained in an entry
        self.entries = [(e, m) for e, m in self.entries if common_prefix(e, seq) != m]
        while self.entries and self._bytes(self.tokens() + n) > self.limit_bytes:
            self.entries.pop(0)
        self.entries.append((seq, n))
        return n

    def load(self, current: Seq, new: Seq) -> Seq | None:
        """The entry to restore into a slot holding ``current`` for prompt ``new`` (removed from
        the cache), or None when no entry beats the slot's own content."""
        if not self.enabled or not new:
            return None
        n_new, n_cur = seq_len(new), seq_len(current)
        lcp = common_prefix(current, new)
        f_keep_best = lcp / n_cur if n_cur else -1.0
        f_sim_best = lcp / n_new
        best = None
        for i, (e, m) in enumerate(self.entries):
            lcp = common_prefix(e, new)
            f_keep, f_sim = lcp / m, lcp / n_new
            if f_keep < 0.25:
                continue
            if f_keep > f_keep_best and f_sim > f_sim_best:
                f_keep_best, f_sim_best, best = f_keep, f_sim, i
        return None if best is None else self.entries.pop(best)[0]

    def update(self) -> None:
        """Evict oldest entries while over the byte limit."""
        while self.entries and self._bytes(self.tokens()) > self.limit_bytes:
            self.entries.pop(0)
