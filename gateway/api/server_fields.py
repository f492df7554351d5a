"""Checks of llama-server's own request fields that a ``/v1`` body may carry and the gateway
passes through: ``lora``, ``samplers``, ``continue_final_message``, ``grammar_triggers``, and
the fields the chat route replaces. The pinned llama-server drops each of these without a word
when it does not understand it, so a client got an answer that ignored what it asked for; here
each is an ApiError(400) that names the field. Sources: tools/server/server-schema.cpp (the
field handlers), server-common.cpp (``parse_lora_request``, ``oaicompat_chat_params_parse``),
common/sampling.cpp (``common_sampler_types_from_names`` / ``_from_chars``), common/chat.cpp
(``common_chat_continuation_parse``)."""

from __future__ import annotations

from gateway.api.errors import ApiError, shown as _short
from gateway.config import flag_values

#: Sampler names llama-server knows (common_sampler_types_from_names: the canonical names,
#: each ``a_b`` also as ``a-b`` and ``ab``, plus ``nucleus``, ``temp`` and ``typ``; matched in
#: lower case). It skipped any other name with a log warning and sampled without it.
_CANONICAL_SAMPLERS = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature",
                       "xtc", "infill", "penalties", "adaptive_p")
SAMPLER_NAMES = frozenset(
    [n for c in _CANONICAL_SAMPLERS for n in (c, c.replace("_", "-"), c.replace("_", ""))]
    + ["nucleus", "temp", "typ"])
#: The letters of ``samplers`` given as one string (common_sampler_type_to_chr).
SAMPLER_CHARS = frozenset("dkypsmtxiea")

#: ``continue_final_message`` values besides a boolean (common_chat_continuation_parse: any
#: other value, ``5`` or ``"x"``, meant "do not continue" without a word).
CONTINUATIONS = ("content", "reasoning_content")

#: llama-server's grammar trigger types (common/common.h ``common_grammar_trigger_type``):
#: 0 a token (with ``token``), 1 a word, 2 a pattern, 3 a pattern over the whole output.
TRIGGER_TYPES = range(4)

#: LoRA flags of llama-server (common/arg.cpp): each value is a comma-separated list of
#: adapters (``--lora-scaled`` items are ``FILE:SCALE``); adapter ids count from 0 in order.
LORA_FLAGS = ("--lora", "--lora-scaled")


def lora_adapters(args: list[str]) -> int:
    """How many LoRA adapters a worker started with llama-server ``args`` loads (adapters)."""
    return sum(len([p for p in (v or "").split(",") if p]) for _, v in flag_values(args, LORA_FLAGS))


def check_server_fields(body: dict, chat: bool, adapters: int | None) -> None:
    """Raise ApiError(400) for a llama-server field of ``body`` that the worker would drop or
    misread: ``lora`` not a list of ``{"id": integer, "scale": number}`` objects, or an id
    outside the ``adapters`` the model's workers load (None: not known, ids unchecked);
    ``samplers`` naming a sampler llama-server does not have; ``continue_final_message`` not
    a boolean, ``"content"`` or ``"reasoning_content"``; ``grammar_triggers`` not a list of
    ``{"type": 0-3, "value": string}`` objects (``token`` integer for type 0). On the chat
    route (``chat``) llama-server replaces ``grammar_lazy``, ``grammar_triggers`` and
    ``preserved_tokens`` with the chat template's own (server-common.cpp
    ``oaicompat_chat_params_parse``), so a lazy grammar ran from the first token: those are
    refused there, with the route that takes them named. A chat that continues its last
    message (``continue_final_message`` set) without ``add_generation_prompt`` gets
    ``add_generation_prompt: false`` in ``body``: llama-server's default true made it answer
    400 "Cannot set both add_generation_prompt and continue_final_message to true"."""
    _check_lora(body.get("lora"), adapters)
    _check_samplers(body.get("samplers"))
    cont = body.get("continue_final_message")
    if cont is not None and not isinstance(cont, bool) and cont not in CONTINUATIONS:
        raise ApiError(400, f"continue_final_message must be a boolean, \"content\" or "
                            f"\"reasoning_content\", got {_short(cont)}")
    if chat and cont not in (None, False) and "add_generation_prompt" not in body:
        body["add_generation_prompt"] = False  # what continuing means; llama-server's default
        # true made it refuse the pair it was not sent (a fresh tester's find)
    if chat:
        for k in ("grammar_lazy", "grammar_triggers", "preserved_tokens"):
            if body.get(k):  # false / [] / null change nothing
                raise ApiError(400, f"{k} is not applied on /v1/chat/completions (llama-server "
                                    f"replaces it with the chat template's own); send a lazy "
                                    f"grammar to /v1/completions")
    else:
        _check_triggers(body.get("grammar_triggers"))


def _check_lora(lora, adapters: int | None) -> None:
    if lora is None:
        return
    if not isinstance(lora, list):
        raise ApiError(400, f"lora must be a list of {{\"id\", \"scale\"}} objects, got {_short(lora)}")
    for i, item in enumerate(lora):
        ok = isinstance(item, dict) and _is_int(item.get("id")) and \
            isinstance(item.get("scale"), (int, float)) and not isinstance(item.get("scale"), bool)
        if not ok:
            raise ApiError(400, f"lora[{i}] must be an object with an integer id and a number "
                                f"scale, got {_short(item)}")
        if item["id"] < 0 or (adapters is not None and item["id"] >= adapters):
            have = f"{adapters} LoRA adapter{'s' if adapters != 1 else ''} (ids from 0)" \
                if adapters else "no LoRA adapters (its args load none: --lora)"
            raise ApiError(400, f"lora[{i}].id {item['id']}: this model's workers have {have}")


def _check_samplers(samplers) -> None:
    if isinstance(samplers, str):
        bad = sorted(set(samplers) - SAMPLER_CHARS)
        if bad:
            raise ApiError(400, f"samplers: unknown sampler letter {_short(bad[0])} (known: "
                                f"{''.join(sorted(SAMPLER_CHARS))})")
    elif isinstance(samplers, list):
        for s in samplers:
            if isinstance(s, str) and s.lower() not in SAMPLER_NAMES:
                raise ApiError(400, f"samplers: unknown sampler {_short(s)} (known: "
                                    f"{', '.join(_CANONICAL_SAMPLERS)})")


def _check_triggers(triggers) -> None:
    if triggers is None:
        return
    if not isinstance(triggers, list):
        raise ApiError(400, f"grammar_triggers must be a list of {{\"type\", \"value\"}} objects, "
                            f"got {_short(triggers)}")
    for i, t in enumerate(triggers):
        ok = isinstance(t, dict) and _is_int(t.get("type")) and t["type"] in TRIGGER_TYPES and \
            isinstance(t.get("value"), str) and (t["type"] != 0 or _is_int(t.get("token")))
        if not ok:
            raise ApiError(400, f"grammar_triggers[{i}] must be an object with a type 0-3 "
                                f"(token, word, pattern, full pattern), a string value and, "
                                f"for type 0, an integer token; got {_short(t)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
