"""Refusals (400) for JSON schemas and GBNF grammars that freeze the pinned llama-server.

llama.cpp's grammar parser expands a repetition ``S{m,n}`` into ``n - m`` optional rules, with
``n - m`` computed as an unsigned 64-bit number (src/llama-grammar.cpp ``handle_repetitions``):
for ``n < m`` that is about 1.8e19 rules, so the worker's main loop (which builds a request's
sampler when a slot takes it) never comes back. Its JSON-schema conversion writes such a
repetition for ``minItems`` > ``maxItems`` and ``minLength`` > ``maxLength``
(common/json-schema-to-grammar.cpp ``build_repetition``), and reads those counts as C ``int``
(common/json-schema.cpp ``get_count``), so a count past 2^31 - 1 wraps (2^32 + 1 is read as 1).
One such ``format`` froze a worker until the gateway found it wedged and killed it, and the
request, retried on the model's other workers, froze each in turn (a fresh tester's find).

Checked here, wherever a schema or grammar reaches a worker: Ollama ``format`` and ``tools``,
OpenAI ``response_format``, ``tools`` and llama-server's own ``json_schema`` / ``grammar``
fields. Refused: a count pair whose minimum is above its maximum (``minItems``/``maxItems``,
``minLength``/``maxLength``, ``minProperties``/``maxProperties``, ``minContains``/
``maxContains``), a count above 2^31 - 1, numeric bounds no number satisfies (``minimum`` above
``maximum``, or equal with an exclusive one), and a GBNF repetition ``{m,n}`` with ``n < m``.
Such a schema admits no value anyway, so the 400 loses no valid request.
"""

from __future__ import annotations

from gateway.api.errors import ApiError

#: Largest count llama.cpp's schema reader keeps (a C ``int``).
COUNT_MAX = 2**31 - 1
_COUNT_PAIRS = (("minItems", "maxItems"), ("minLength", "maxLength"),
                ("minProperties", "maxProperties"), ("minContains", "maxContains"))
# keys whose values are data (instances), not schemas: not walked
_DATA_KEYS = frozenset(("enum", "const", "default", "examples"))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_schema(schema, where: str) -> None:
    """Raise ApiError(400) naming the place (``where``, then the path inside the schema, e.g.
    ``format.properties.tags``) when ``schema`` holds a bound the pinned llama-server cannot
    take (module docstring). Any other shape is left to the worker's own checks."""
    stack = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for lo_k, hi_k in _COUNT_PAIRS:
            lo, hi = node.get(lo_k), node.get(hi_k)
            for k, v in ((lo_k, lo), (hi_k, hi)):
                if _is_int(v) and v > COUNT_MAX:
                    raise ApiError(400, f"{path}: {k} must be at most {COUNT_MAX}, got {v}")
            if _is_int(lo) and _is_int(hi) and lo > hi:
                raise ApiError(400, f"{path}: {lo_k} ({lo}) is greater than {hi_k} ({hi}); "
                                    f"no value can match the schema")
        _check_bounds(node, path)
        for k, v in node.items():
            if k not in _DATA_KEYS and isinstance(v, (dict, list)):
                stack.append((v, f"{path}.{k}"))


def _check_bounds(node: dict, path: str) -> None:
    lo_k = "minimum" if _is_num(node.get("minimum")) else "exclusiveMinimum"
    hi_k = "maximum" if _is_num(node.get("maximum")) else "exclusiveMaximum"
    lo, hi = node.get(lo_k), node.get(hi_k)
    if not (_is_num(lo) and _is_num(hi)):
        return
    if lo > hi or (lo == hi and "exclusive" in lo_k + hi_k):
        raise ApiError(400, f"{path}: {lo_k} ({lo}) and {hi_k} ({hi}) leave no number; no "
                            f"value can match the schema")


def check_grammar(text, where: str) -> None:
    """Raise ApiError(400) when the GBNF ``text`` has a repetition ``{m,n}`` with ``n < m``
    (outside string literals, character classes and comments). Other grammar errors are left
    to the worker, which refuses them with its own 400."""
    if not isinstance(text, str):
        return
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":  # a literal "…" or a class […], with backslash escapes
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "{":
            j = text.find("}", i)
            if j < 0:
                return
            lo, comma, hi = text[i + 1:j].partition(",")
            lo, hi = lo.strip(), hi.strip()
            if comma and lo.isdigit() and hi.isdigit() and int(hi) < int(lo):
                raise ApiError(400, f"{where}: repetition {{{lo},{hi}}} has its maximum below "
                                    f"its minimum")
            i = j + 1
        else:
            i += 1


def check_tools(tools, where: str = "tools") -> None:
    """:func:`check_schema` of each tool's ``function.parameters`` (llama-server compiles them
    into a grammar for tool calls)."""
    if not isinstance(tools, list):
        return
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), dict):
            check_schema(fn["parameters"], f"{where}[{i}].function.parameters")
