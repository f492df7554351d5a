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
``maxContains``), a count above 2^31 - 1, numeric bounds no number (or, for ``type: integer``,
no integer) satisfies, a ``pattern`` whose regex has a repetition ``{m,n}`` with ``n < m``, and
a GBNF repetition ``{m,n}`` with ``n < m`` (comments and spaces inside the braces skipped, as
llama.cpp skips them). Such a schema admits no value anyway, so the 400 loses no valid
request. Also refused: more than :data:`ENUM_MAX` ``enum`` values in one schema, whose grammar
the worker builds for longer than its liveness probes wait. Only the keys the worker builds a
grammar from are walked (``properties``, ``items``, ``anyOf`` …; not ``not``, annotations or
data such as ``default``).
"""

from __future__ import annotations

import math
import re

from gateway.api.errors import ApiError

#: Largest count llama.cpp's schema reader keeps (a C ``int``).
COUNT_MAX = 2**31 - 1
#: Most ``enum`` / ``const`` values in one schema: the pinned llama.cpp builds their grammar in
#: time that grows about quadratically (2,000 values 0.13 s, 20,000 values 4.8 s, 60,000 values
#: past the liveness probes, which killed the worker; a fresh tester's measurements).
ENUM_MAX = 4096
_COUNT_PAIRS = (("minItems", "maxItems"), ("minLength", "maxLength"),
                ("minProperties", "maxProperties"), ("minContains", "maxContains"))
# Keys whose value is one schema, a list of schemas, or a mapping of names to schemas: the
# only ones walked (a value under ``not``, an annotation such as ``x-note`` or data such as
# ``default`` is no schema the worker builds a grammar from; a fresh tester's find).
_ONE = frozenset(("items", "additionalProperties", "contains", "propertyNames", "if", "then",
                  "else", "unevaluatedItems", "unevaluatedProperties", "additionalItems"))
_LIST = frozenset(("prefixItems", "anyOf", "oneOf", "allOf", "items"))
_BY_NAME = frozenset(("properties", "patternProperties", "$defs", "definitions",
                      "dependentSchemas"))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_schema(schema, where: str) -> None:
    """Raise ApiError(400) naming the place (``where``, then the path inside the schema, e.g.
    ``format.properties.tags``) when ``schema`` holds a bound the pinned llama-server cannot
    take (module docstring), a ``pattern`` with such a repetition, or more than
    :data:`ENUM_MAX` ``enum``/``const`` values. Any other shape is left to the worker's own
    checks."""
    stack = [(schema, where)]
    enums = 0
    while stack:
        node, path = stack.pop()
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
        if isinstance(node.get("pattern"), str):
            bad = _regex_bad_repetition(node["pattern"])
            if bad:
                raise ApiError(400, f"{path}.pattern: repetition {bad} has its maximum below "
                                    f"its minimum")
        enums += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
        if enums > ENUM_MAX:
            raise ApiError(400, f"{path}: more than {ENUM_MAX} enum values in the schema; the "
                                f"worker's grammar for them would take too long to build")
        for k, v in node.items():
            if k in _LIST and isinstance(v, list):
                stack.extend((x, f"{path}.{k}[{i}]") for i, x in enumerate(v))
            elif k in _ONE:
                stack.append((v, f"{path}.{k}"))
            elif k in _BY_NAME and isinstance(v, dict):
                stack.extend((x, f"{path}.{k}.{name}") for name, x in v.items())


def _check_bounds(node: dict, path: str) -> None:
    lo_k = "minimum" if _is_num(node.get("minimum")) else "exclusiveMinimum"
    hi_k = "maximum" if _is_num(node.get("maximum")) else "exclusiveMaximum"
    lo, hi = node.get(lo_k), node.get(hi_k)
    if not (_is_num(lo) and _is_num(hi)):
        return
    if lo > hi or (lo == hi and "exclusive" in lo_k + hi_k):
        raise ApiError(400, f"{path}: {lo_k} ({lo}) and {hi_k} ({hi}) leave no number; no "
                            f"value can match the schema")
    if node.get("type") == "integer":  # the worker's integer range (json-schema.cpp
        # get_bound: inclusive bounds rounded inwards); an empty one answered 500 "Unexpected
        # empty grammar stack" (a fresh tester's find)
        first = math.floor(lo) + 1 if lo_k == "exclusiveMinimum" else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_k == "exclusiveMaximum" else math.floor(hi)
        if first > last:
            raise ApiError(400, f"{path}: {lo_k} ({lo}) and {hi_k} ({hi}) leave no integer; no "
                                f"value can match the schema")


def _regex_bad_repetition(pattern: str) -> str:
    """The first ``{m,n}`` quantifier with ``n < m`` in the regex ``pattern`` (outside escapes
    and character classes), as text, or "": llama.cpp's json-schema-to-grammar copies regex
    repetitions into the grammar as they are."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "{":
            m = re.match(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", pattern[i:])
            if m and int(m.group(2)) < int(m.group(1)):
                return m.group(0)
        i += 1
    return ""


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
        elif c == "#":  # to the end of the line, which llama.cpp ends at \r or \n
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "{":
            j = text.find("}", i)
            if j < 0:
                return
            # llama.cpp skips spaces and comments inside the braces too (parse_space)
            inner = re.sub(r"#[^\r\n]*|\s", "", text[i + 1:j])
            lo, comma, hi = inner.partition(",")
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
