"""How many slots a worker runs and how much context each gets (no I/O).

The plan's ``slots`` and ``context`` (per slot) become llama-server's ``-np`` and ``-c``
(slots × context), unless a model's ``args`` set ``-np`` / ``-c`` themselves: llama-server
takes the last of each, so theirs win. llama-server then caps each slot at the model's
training context (``n_ctx_slot = min(n_ctx / n_seq, n_ctx_train)``, tools/server/
server-context.cpp: "the slot context (N) exceeds the training context of the model (M) -
capping") but allocates the KV cache for all of ``-c``: a context above the training one only
costs memory (95 MB against 27 MB for the demo model; VRAM on a GPU; a fresh tester's find).
Its rounding of ``-c`` to multiples of 256 is not applied here.
"""

from __future__ import annotations

from gateway.config import CTX_FLAGS, SLOT_FLAGS, flag_values

_UNIFIED_ON, _UNIFIED_OFF = ("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified")


def slot_context(configured: int, trained: int) -> int:
    """Per-slot context (tokens) a worker gets for ``configured`` tokens per slot: capped at
    the model's training context ``trained`` (0 = unknown: not capped)."""
    return min(configured, trained) if trained > 0 else configured


def _last_int(args: list[str], names: tuple[str, ...]) -> int | None:
    values = [int(v) for _, v in flag_values(args, names) if v and v.isdigit()]
    return values[-1] if values else None


def _unified(args: list[str]) -> bool:
    flags = [a for a in args if a in _UNIFIED_ON + _UNIFIED_OFF]
    return bool(flags) and flags[-1] in _UNIFIED_ON


def args_override(args: list[str], slots: int, context: int) -> tuple[int, int, str]:
    """(slots, context per slot before the training-context cap, a note) of a worker of
    ``slots`` × ``context`` (tokens) whose llama-server ``args`` may hold their own ``-np`` /
    ``-c`` or ``--kv-unified`` (check-config printed the plan's values instead; a fresh
    tester's find). The note says which flags changed them ("" when none did)."""
    np_, c = _last_int(args, SLOT_FLAGS), _last_int(args, CTX_FLAGS)
    if np_ is None and c is None and not _unified(args):
        return slots, context, ""
    n = np_ or slots
    total = c if c is not None else slots * context
    if _unified(args):  # one KV buffer for all slots: llama-server gives each slot all of -c
        return n, total, " (--kv-unified in args: every slot may use the whole -c)"
    return n, total // max(n, 1), " (set by -np/-c in args)"


def launch_slots(args: list[str], slots: int, context: int, trained: int) -> tuple[int, int, int]:
    """(``-np``, context per slot, context per slot before the cap) to start a worker of the
    plan's ``slots`` × ``context`` (tokens) with, given the model's llama-server ``args`` and
    training context ``trained`` (tokens, 0 unknown); its ``-c`` is their product. The per-slot
    context is capped at ``trained``, also when ``args`` set ``-np`` alone (their slots then
    split the plan's slots × context): with ``-np 3`` and ``context: 8192`` on a
    4,096-trained model, 27 % of the KV cache was allocated and never used. ``--kv-unified``
    changes nothing here: its slots share the one cache, each up to the training context, so
    slots × the capped context is all they can use (a fresh tester's find: -c 8192 for 2 slots
    of a 1,024-trained model). With ``-c`` in ``args`` the total is the operator's, and left as
    it is."""
    np_, c = _last_int(args, SLOT_FLAGS), _last_int(args, CTX_FLAGS)
    if c is not None:
        return slots, context, context
    n = np_ or slots  # -np's slots split the plan's slots × context
    per_slot = slots * context // n if np_ else context
    return n, slot_context(per_slot, trained), per_slot
