"""Checks of an OpenAI-compatible request body (``/v1/chat/completions``,
``/v1/completions``) before it is sent: each raises ApiError(400) in OpenAI's shape where
llama-server would answer 500, drop the field without a word or read it as something else
(its ``json_value`` reads a wrong type as the default). Some also rewrite the body into what
llama-server does understand (a named ``tool_choice``)."""

from __future__ import annotations

from gateway.api.capabilities import model_capabilities, require
from gateway.api.errors import ApiError, shown as _short
from gateway.api.grammar_checks import check_grammar, check_schema, check_tools
from gateway.api.ollama_mapping import INT64_MAX, INT64_MIN, past_int64
from gateway.api.openai_legacy import MAX_LOGPROBS
from gateway.api.openai_structured import format_schema
from gateway.api.server_fields import check_server_fields, lora_adapters


async def check_request(gw, entry, body: dict, required: str) -> tuple[bool, dict | None, bool]:
    """Check ``body`` for the route whose input is ``required`` (``"messages"``: chat,
    ``"prompt"``: completions) and the model ``entry``; returns (``stream``, the
    ``stream_options`` object or None, ``include_usage``). Raises ApiError(400), or Ollama's
    400 ``does not support …`` for a capability the model lacks."""
    name = body["model"]
    # As /api/chat and /api/generate (Ollama routes /v1 through them): an embedding model
    # answers 400 "does not support chat|generate", not a generation.
    await require(gw, entry, "chat" if required == "messages" else "generate", name)
    if required not in body:
        raise ApiError(400, f"{required} is required")
    if required == "messages":
        if not isinstance(body["messages"], list):
            raise ApiError(400, "messages must be a list of message objects")
        if not body["messages"]:
            raise ApiError(400, "[] is too short - 'messages'")  # Ollama's openai middleware text
        for i, m in enumerate(body["messages"]):
            c = m.get("content") if isinstance(m, dict) else None
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                    c is None or isinstance(c, str) or
                    (isinstance(c, list) and all(isinstance(p, dict) for p in c))):
                raise ApiError(400, f"messages[{i}] must be an object with a string role and "
                                    f"string, null or content-part list content")
            for j, part in enumerate(c if isinstance(c, list) else ()):
                if part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content[{j}].text must be a string")
        if _has_image(body["messages"]):
            await require(gw, entry, "vision", name)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(
                isinstance(t, dict) for t in tools)):
            raise ApiError(400, "tools must be a list of tool objects")
        if tools:  # as Ollama's /v1 (through /api/chat): 400 for a template without tools
            await require(gw, entry, "tools", name)
            check_tools(tools)
        _named_tool_choice(body)
    if required == "messages":
        await _reasoning_effort(gw, entry, body)
    if required == "prompt" and body.get("suffix") is not None:
        suffix = body["suffix"]
        if not isinstance(suffix, str):
            raise ApiError(400, f"suffix must be a string, got {_short(suffix)}")
        if suffix:  # llama-server's /v1/completions ignored it without a word (a fresh tester's find)
            await require(gw, entry, "insert", name)  # Ollama's 400 for a model without FIM
            raise ApiError(400, "suffix (fill-in-the-middle) is not served on /v1/completions "
                                "by this gateway; send it to /api/generate")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise ApiError(400, "stream must be a boolean")
    n = body.get("n")
    if n is not None:
        check_int("n", n)
        if n < 1:
            raise ApiError(400, f"n must be an integer of at least 1, got {n}")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise ApiError(400, "stop must be a string or a list of strings")
    _check_types(body)
    mcfg = gw.model_config(entry.name) if body.get("lora") else None  # adapters: its args
    adapters = lora_adapters(list(gw.config.llama_server.extra_args) + list(mcfg.args)) \
        if mcfg is not None else None
    check_server_fields(body, required == "messages", adapters)
    # llama-server reads these with a default when the type is wrong (json_value), so a string
    # response_format or logit_bias was dropped without a word
    for k, kinds, what in (("response_format", dict, "an object"),
                           ("logit_bias", (dict, list), "an object")):
        if body.get(k) is not None and not isinstance(body[k], kinds):
            raise ApiError(400, f"{k} must be {what}, got {_short(body[k])}")
    if body.get("response_format") is not None:
        _check_response_format(body["response_format"])
    # two constraints of the whole answer: llama-server answered 500 "Cannot use both
    # json_schema and grammar" on the chat route, kept the grammar on /v1/completions, and under
    # a JSON response_format plus a grammar sent only "{" (a fresh tester's finds)
    both = [k for k, given in (("response_format", format_schema(body.get("response_format"))),
                               ("json_schema", body.get("json_schema")),
                               ("grammar", body.get("grammar"))) if given not in (None, "")]
    if len(both) > 1:
        raise ApiError(400, f"{' and '.join(both)} cannot be used together: each constrains "
                            f"the whole answer; send one")
    # llama-server's own fields, passed through: schemas and grammars that would freeze it
    if isinstance(body.get("json_schema"), dict):
        check_schema(body["json_schema"], "json_schema", rewrite=True)
    check_grammar(body.get("grammar"), "grammar")
    if body.get("logit_bias") is not None:
        _check_logit_bias(body["logit_bias"], entry.facts.n_vocab)
    if body.get("seed") is not None:  # llama-server replaced one past 64 bits by a fixed seed
        check_int("seed", body["seed"])
    if required == "messages" and body.get("logprobs") is not None and \
            not isinstance(body["logprobs"], bool):  # OpenAI's chat: a boolean
        raise ApiError(400, f"logprobs must be a boolean, got {_short(body['logprobs'])}")
    if required == "messages" and body.get("top_logprobs") is not None:
        top = body["top_logprobs"]
        check_int("top_logprobs", top)
        if not 0 <= top <= 20:  # Ollama's check: its /v1 goes through /api/chat
            raise ApiError(400, "top_logprobs must be between 0 and 20")
    if body.get("n_probs") is not None:  # llama-server's own field, passed through: the top
        # n of the whole vocabulary per token (a 69 MB answer for the demo's 559 tokens, and
        # the gateway folds a non-streamed one in memory; a fresh tester's find)
        check_int("n_probs", body["n_probs"])
        if not 0 <= body["n_probs"] <= MAX_LOGPROBS:
            raise ApiError(400, f"n_probs must be between 0 and {MAX_LOGPROBS}, as top_logprobs")
    stream = body.get("stream") is True
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, "stream_options must be an object")
    include_usage = (so or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(400, f"stream_options.include_usage must be a boolean, got "
                            f"{_short(include_usage)}")
    include_usage = include_usage is True
    return stream, so, include_usage


#: OpenAI's ``reasoning_effort`` values as Ollama's ``/v1`` maps them (openai/openai.go):
#: ``none`` turns thinking off (llama-server's own reading of "none" too), ``minimal`` is
#: ``low``, ``xhigh``/``ultra`` are ``max`` (what ``think: "max"`` sends on ``/api``).
_EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
            "xhigh": "max", "ultra": "max", "max": "max"}


async def _reasoning_effort(gw, entry, body: dict) -> None:
    """Check a chat's ``reasoning_effort`` (or OpenAI's newer ``reasoning: {"effort": …}``,
    which Ollama reads too and llama-server's chat route does not) and write the value
    llama-server takes as ``reasoning_effort``. Raises ApiError(400) for another value, and
    Ollama's 400 ``"<model>" does not support thinking`` for an effort above none on a model
    whose template does not reason (llama-server ignored it without a word; a fresh tester's
    find). ``none`` is accepted on any model, as Ollama's ``think: false`` is."""
    reasoning = body.pop("reasoning", None)
    if reasoning is not None and not isinstance(reasoning, dict):
        raise ApiError(400, f"reasoning must be an object, got {_short(reasoning)}")
    effort, field = body.get("reasoning_effort"), "reasoning_effort"
    if effort is None and reasoning is not None:
        effort, field = reasoning.get("effort"), "reasoning.effort"
    if effort is None:
        body.pop("reasoning_effort", None)
        # as Ollama's /v1 (through /api/chat): a model with the thinking capability thinks
        # unless told not to; not under a response_format, whose grammar would cover it
        if body.get("response_format") is None and \
                "thinking" in await model_capabilities(gw, entry):
            _enable_thinking(body)
        return
    if not isinstance(effort, str) or effort not in _EFFORTS:
        raise ApiError(400, f"{field} must be one of " + ", ".join(
            f"'{e}'" for e in _EFFORTS) + f", got {_short(effort)}")
    body["reasoning_effort"] = _EFFORTS[effort]
    if effort != "none":
        await require(gw, entry, "thinking", body["model"])
        # llama-server passes the effort to the template but leaves enable_thinking at its own
        # default, off for templates it does not take for reasoning ones: "high" rendered as
        # "none" did (a fresh tester's find)
        _enable_thinking(body)


def _enable_thinking(body: dict) -> None:
    """``chat_template_kwargs.enable_thinking`` true, unless the client set it itself."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    elif isinstance(kwargs, dict) and "enable_thinking" not in kwargs:
        body["chat_template_kwargs"] = {**kwargs, "enable_thinking": True}


def _named_tool_choice(body: dict) -> None:
    """Check ``tool_choice`` (OpenAI: ``"none"``, ``"auto"``, ``"required"`` or ``{"type":
    "function", "function": {"name": N}}``) and rewrite the named form, which the pinned
    llama-server reads as a wrong type and replaces with ``"auto"`` without a word: the tools
    are narrowed to the one named and the choice becomes ``"required"``, so the model must
    call that function, as OpenAI does. Raises ApiError(400) for anything else, or a name not
    among ``tools``."""
    tc = body.get("tool_choice")
    if tc is None or tc in ("none", "auto", "required"):
        return
    fn = tc.get("function") if isinstance(tc, dict) and tc.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                            f"{_short(tc)}")
    named = [t for t in body.get("tools") or ()
             if isinstance(t.get("function"), dict) and t["function"].get("name") == name]
    if not named:
        raise ApiError(400, f"tool_choice names function '{name}', which is not in tools")
    body["tools"], body["tool_choice"] = named[:1], "required"


#: Sampling fields of a ``/v1`` body (OpenAI's, then llama-server's own that it reads from
#: one, tools/server/server-common.cpp ``params_from_json_cmpl``) that must be numbers, and
#: flags that must be booleans. llama-server refused another type with its JSON library's
#: text (``[json.exception.type_error.302] type must be number, but is string``; a fresh
#: tester's find); null still means "not given".
_NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p",
                  "typical_p", "repeat_penalty", "dynatemp_range", "dynatemp_exponent",
                  "xtc_probability", "xtc_threshold", "top_n_sigma", "mirostat_tau",
                  "mirostat_eta", "dry_multiplier", "dry_base")
#: llama-server's integer fields (server-schema.cpp ``field_num`` of an ``int``): it truncates
#: a fraction without a word (``top_k: 1.5`` ran as 1), so one is refused; a whole float such
#: as ``40.0`` is what it reads as 40 and passes.
_INT_FIELDS = ("top_k", "repeat_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n",
               "n_keep", "min_keep", "n_indent", "n_discard", "n_cache_reuse",
               "t_max_predict_ms", "sse_ping_interval", "reasoning_budget_tokens", "id_slot")
_BOOL_FIELDS = ("cache_prompt", "ignore_eos", "return_tokens", "timings_per_token",
                "post_sampling_probs", "return_progress", "parallel_tool_calls",
                "add_generation_prompt", "grammar_lazy", "parse_tool_calls", "backend_sampling",
                "verbose")
#: Fields llama-server reads with ``json_value`` and a default, so that a wrong type was
#: dropped without a word (``grammar: 5`` generated unconstrained; server-common.h
#: ``json_value`` logs "Wrong type supplied" and uses the default): the JSON type each must be.
_SHAPED_FIELDS = (("grammar", str, "a string"), ("json_schema", dict, "an object"),
                  ("chat_template_kwargs", dict, "an object"),
                  ("reasoning_format", str, "a string"), ("chat_template", str, "a string"))
#: Fields that must be a list of strings (server-schema.cpp ``dry_sequence_breakers``,
#: ``response_fields``: a wrong type was read as the default list); ``samplers`` may also be
#: one string of sampler letters (another type was ignored).
_STRING_LIST_FIELDS = ("dry_sequence_breakers", "response_fields", "samplers",
                       "preserved_tokens")


def _check_types(body: dict) -> None:
    """Raise ApiError(400) ``<field> must be a number|an integer|a boolean|a string|an
    object|a list of strings, got <value>`` for a field of :data:`_NUMBER_FIELDS`,
    :data:`_INT_FIELDS`, :data:`_BOOL_FIELDS`, :data:`_SHAPED_FIELDS` or
    :data:`_STRING_LIST_FIELDS` of another type (a boolean is no number). A null is "not
    given", as llama-server reads it."""
    for k in _NUMBER_FIELDS:
        v = body.get(k)
        if v is not None and not _is_number(v):
            raise ApiError(400, f"{k} must be a number, got {_short(v)}")
    for k in _INT_FIELDS:
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            v = body[k] = int(v)
        check_int(k, v)
    for k in _BOOL_FIELDS:
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise ApiError(400, f"{k} must be a boolean, got {_short(v)}")
    for k, kind, what in _SHAPED_FIELDS:
        v = body.get(k)
        if v is not None and not isinstance(v, kind):
            raise ApiError(400, f"{k} must be {what}, got {_short(v)}")
    for k in _STRING_LIST_FIELDS:
        v = body.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)) \
                and not (k == "samplers" and isinstance(v, str)):
            what = "a list of strings or a string" if k == "samplers" else "a list of strings"
            raise ApiError(400, f"{k} must be {what}, got {_short(v)}")


#: OpenAI's ``response_format.type`` values (llama-server's too, server-common.cpp).
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_response_format(rf: dict) -> None:
    """Raise ApiError(400) for a ``response_format`` llama-server would drop without a word: a
    ``type`` that is not one of OpenAI's strings (llama-server reads a non-string as absent and
    runs unconstrained; an unknown string it refuses itself), or a ``json_schema`` /
    ``json_schema.schema`` / ``schema`` that is not an object (read as "any object"); and a
    schema the pinned llama-server cannot take (``grammar_checks.check_schema``)."""
    t = rf.get("type")
    if t not in _RESPONSE_FORMATS:
        raise ApiError(400, f"response_format.type must be one of 'text', 'json_object' or "
                            f"'json_schema', got {_short(t)}")
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, f"response_format.json_schema must be an object, got {_short(js)}")
        if js.get("schema") is not None and not isinstance(js["schema"], dict):
            raise ApiError(400, "response_format.json_schema.schema must be an object, got "
                                f"{_short(js['schema'])}")
        check_schema(js.get("schema"), "response_format.json_schema.schema", rewrite=True)
    if t == "json_object" and rf.get("schema") is not None and not isinstance(rf["schema"], dict):
        raise ApiError(400, f"response_format.schema must be an object, got {_short(rf['schema'])}")
    check_schema(rf.get("schema"), "response_format.schema", rewrite=True)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_logit_bias(lb, n_vocab: int) -> None:
    """Raise ApiError(400) for a ``logit_bias`` llama-server would skip without a word: an
    object whose values are not numbers (``false`` bans the token, llama-server's extension),
    a list that is not of ``[token, bias]`` pairs (token id or text), or a token id outside the
    vocabulary of ``n_vocab`` tokens (0: not known, unchecked); server-schema.cpp
    ``logit_bias``. An object key that is not an integer is text, as llama-server reads it."""
    pairs = []
    if isinstance(lb, dict):
        for k, v in lb.items():
            if not (_is_number(v) or v is False):
                raise ApiError(400, f"logit_bias[{_short(k)}] must be a number, got {_short(v)}")
            pairs.append((int(k) if k.lstrip("-").isdigit() else k, k))
    else:
        for i, pair in enumerate(lb):
            if not (isinstance(pair, list) and len(pair) == 2 and
                    (isinstance(pair[0], str) or (isinstance(pair[0], int) and not isinstance(pair[0], bool)))
                    and (_is_number(pair[1]) or pair[1] is False)):
                raise ApiError(400, f"logit_bias[{i}] must be a [token, bias] pair, got {_short(pair)}")
            pairs.append((pair[0], pair[0]))
    for tok, shown in pairs:
        if isinstance(tok, int) and (tok < 0 or (n_vocab and tok >= n_vocab)):
            raise ApiError(400, f"logit_bias token {shown} is outside the model's vocabulary "
                                f"of {n_vocab} tokens")


def _has_image(messages: list) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and
               any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
                   for p in m["content"]) for m in messages)


def check_int(key: str, v) -> None:
    """Raise ApiError(400) unless ``v`` is a JSON integer that fits 64 bits (llama-server's
    JSON integers; Go's ``int`` under Ollama). orjson reads an integer literal past 64 bits as a
    float, so a whole float of that size is called out of range, not "not an integer" (the
    float of -2**63 - 1 is -2**63 itself: ``past_int64``)."""
    if past_int64(v):
        raise ApiError(400, f"{key} is out of range for a 64-bit integer")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {_short(v)}")
    if not INT64_MIN <= v <= INT64_MAX:
        raise ApiError(400, f"{key} is out of range for a 64-bit integer")


