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
fields, as the worker reads them. Refused: a count pair whose minimum is above its maximum
(``minItems``/``maxItems`` for arrays, ``minLength``/``maxLength`` for strings, either when no
type is given), a count outside 0..2^31 - 1 (the worker's C ``int`` wraps it), numeric bounds no
number (or, for ``integer``, no integer) satisfies, a ``pattern`` whose regex repeats ``{m,n}``
with ``n < m`` as ``std::stoi`` reads the numbers, ``$ref`` targets in the document wherever
they point, and a GBNF repetition ``{m,n}`` with ``n < m`` (comments and spaces inside the
braces skipped, as llama.cpp skips them). Such a schema admits no value anyway, so the 400
loses no valid request. Also refused: more than :data:`UNITS_MAX` schema nodes plus
``enum``/``const`` values, whose grammar the worker builds for longer than its liveness probes
wait. Only what the worker builds a grammar from is walked (``properties``, ``items``,
``anyOf`` …, ``$ref`` targets; not ``not``, annotations, unreferenced ``$defs`` or data such as
``default``). Also refused: nested repetitions past :data:`NESTED_POSITIONS_MAX` grammar
positions, a bounded repetition of a part that can be empty past :data:`REPEATED_EMPTY_MAX`
places per character, and a repetition minimum past :data:`REPETITIONS_MAX`. Fresh testers
found the ways past earlier versions.
"""

from __future__ import annotations

import math
import re
import string

import orjson

from gateway.api.errors import ApiError, shown
from gateway.api.gbnf_syntax import TOO_DEEP, deep_frames, grammar_error, read_grammar
from gateway.api.schema_pattern import PatternError, rewrite_pattern, unescaped_outside_classes

#: Largest count llama.cpp's schema reader keeps (a C ``int``).
COUNT_MAX = 2**31 - 1
#: Most schema nodes plus ``enum``/``const`` values in one schema (an ``enum`` counted once per
#: entry of a ``type`` list, which the worker copies it into): the pinned llama.cpp builds
#: their grammar in time that grows about quadratically (2,000 enum values 0.13 s, 20,000
#: 4.8 s, 30,000 ``anyOf`` consts 6.6 s, 60,000 of either past the liveness probes, which
#: killed the worker; fresh testers' measurements).
UNITS_MAX = 4096
#: Most times llama.cpp's grammar parser repeats an item (src/llama-grammar.cpp
#: ``MAX_REPETITION_THRESHOLD``): a larger minimum is its error "number of repetitions exceeds
#: sane defaults", which llama-server answered as a bare 400 "Failed to initialize samplers:
#: failed to parse grammar" (``minLength: 3000``; a larger maximum it reads as unbounded).
REPETITIONS_MAX = 2000
# The count pairs the worker reads (common/json-schema.cpp), with the type that reads them.
_COUNT_PAIRS = (("minItems", "maxItems", "array"), ("minLength", "maxLength", "string"))
# Keys whose value is one schema, a list of schemas, or a mapping of names to schemas: the
# only ones walked, besides ``$ref`` targets (a value under ``not``, an annotation such as
# ``x-note``, an unreferenced ``$defs`` entry or data such as ``default`` is no schema the
# worker builds a grammar from; fresh testers' finds).
_ONE = frozenset(("items", "additionalProperties", "contains", "propertyNames", "if", "then",
                  "else", "unevaluatedItems", "unevaluatedProperties", "additionalItems"))
_LIST = frozenset(("prefixItems", "anyOf", "oneOf", "allOf", "items"))
_BY_NAME = frozenset(("properties", "patternProperties", "dependentSchemas"))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_schema(schema, where: str, *, rewrite: bool = False) -> None:
    """Raise ApiError(400) naming the place (``where``, then the path inside the schema, e.g.
    ``format.properties.tags``) when ``schema`` holds a bound the pinned llama-server cannot
    take (module docstring), a ``pattern`` with such a repetition, or more than
    :data:`UNITS_MAX` nodes and ``enum``/``const`` values. ``$ref`` targets inside the document
    (``#/…``, wherever they point, as the worker follows them) are checked where they are
    used. Any other shape is left to the worker's own checks. With ``rewrite`` (a schema the
    worker only turns into a grammar: ``format``, ``response_format``, ``json_schema``; not
    tools, whose schema the model also reads), each string ``pattern`` is replaced in place by
    ``schema_pattern.rewrite_pattern``'s (dropped where that is None) before it is checked.
    A pattern that is not valid ECMA-262, or has a class no character matches, is a 400
    naming it as sent (``schema_pattern.PatternError``) on every route."""
    stack = [(schema, where)]
    refs: set[str] = set()
    units = 0
    totals = [0, 0]  # the patterns' positions and repeated-empty branching, summed
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        tset = set(t for t in types if isinstance(t, str)) if isinstance(types, list) else \
            ({types} if isinstance(types, str) else None)  # None: any (no type given)
        copies = len(types) if isinstance(types, list) and types else 1
        values = (len(node["enum"]) if isinstance(node.get("enum"), list) else 0) + \
            ("const" in node)
        units += 1 + copies * values
        if units > UNITS_MAX:
            raise ApiError(400, f"{path}: more than {UNITS_MAX} schema nodes and enum/const "
                                f"values in the schema; the worker's grammar for them would "
                                f"take too long to build")
        for lo_k, hi_k, kind in _COUNT_PAIRS:
            if tset is not None and kind not in tset:
                continue  # read only for that type
            lo, hi = node.get(lo_k), node.get(hi_k)
            for k, v in ((lo_k, lo), (hi_k, hi)):
                if _is_int(v) and not 0 <= v <= COUNT_MAX:  # the worker's C int wraps others
                    raise ApiError(400, f"{path}: {k} must be a whole number from 0 to "
                                        f"{COUNT_MAX}, got {v}")
            if _is_int(lo) and _is_int(hi) and lo > hi:
                raise ApiError(400, f"{path}: {lo_k} ({lo}) is greater than {hi_k} ({hi}); "
                                    f"no value can match the schema")
            # an array's items after the first are one repetition (json-schema-to-grammar.cpp
            # build_repetition with a separator), a string's characters another
            if _is_int(lo) and lo - (kind == "array") > REPETITIONS_MAX:
                raise ApiError(400, f"{path}: {lo_k} {lo} is more repetitions than the worker's "
                                    f"grammar takes (at most {REPETITIONS_MAX + (kind == 'array')})")
        if tset is None or tset & {"integer", "number"}:
            _check_bounds(node, path, integer=tset is not None and "integer" in tset)
        if (tset is None or "string" in tset) and "pattern" in node:
            if not isinstance(node["pattern"], str):  # JSON Schema: it MUST be a string (the
                raise ApiError(400, f"{path}.pattern must be a string, got "  # worker named
                                    f"{shown(node['pattern'])}")  # its own json_schema field)
            _check_pattern(node, path, rewrite, totals, where)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and ref not in refs:
            refs.add(ref)
            stack.append((_pointer(schema, ref), f"{where}{ref[1:].replace('/', '.')}"))
        for k, v in node.items():
            if k in _LIST and isinstance(v, list):
                stack.extend((x, f"{path}.{k}[{i}]") for i, x in enumerate(v))
            elif k in _ONE:
                stack.append((v, f"{path}.{k}"))
            elif k in _BY_NAME and isinstance(v, dict):
                stack.extend((x, f"{path}.{k}.{name}") for name, x in v.items())


def _check_pattern(node: dict, path: str, rewrite: bool, totals: list[int], where: str) -> None:
    """:func:`check_schema`'s checks of the string schema ``node``'s ``pattern`` (at
    ``path``): ECMA-262 syntax, then (``rewrite``) the pattern replaced by the worker's
    rewrite or dropped, ``enum``/``const`` kept to what it matches, and the rewrite's
    repetitions counted, alone and, in an ``anyOf``/``oneOf`` branch, added to ``totals``
    (the schema's, named ``where``)."""
    sent_by_client = node["pattern"]
    try:
        sent = rewrite_pattern(sent_by_client)
    except PatternError as e:
        raise ApiError(400, f"{path}.pattern: {e}") from None
    if rewrite and sent is None:  # not enforceable: the string's other keywords apply
        del node["pattern"]
        return
    # in a branch of anyOf/oneOf other branches are live at once, and may match instead
    branch = "anyOf[" in path or "oneOf[" in path
    if rewrite:
        node["pattern"] = sent
        _keep_matching_values(node, sent, path, branch)
    try:
        bad = _regex_bad_repetition(node["pattern"])
        if bad:
            raise ApiError(400, f"{path}.pattern: {bad}")
        found = regex_costs(node["pattern"])
        _check_positions(found, f"{path}.pattern")
    except ApiError as e:
        if node["pattern"] != sent_by_client:  # the text quoted is the rewrite's
            e.message += (f" (counted in {shown(sent_by_client)} as the gateway writes it for "
                          f"the worker, each class and dot with its JSON escapes)")
        raise
    if not branch:
        return  # sequential properties are not live at once (a fresh tester: two at 5.2 ms
    totals[0] += found[0][0]  # per token, one at 5.6)
    totals[1] += found[1][0]
    if totals[0] > SCHEMA_COST_FACTOR * NESTED_POSITIONS_MAX or \
            totals[1] > SCHEMA_COST_FACTOR * REPEATED_EMPTY_MAX:
        raise ApiError(400, f"{where}: its patterns together have about {totals[0]} grammar "
                            f"positions and {totals[1]} places per character in repetitions "
                            f"of parts that can be empty (at most {SCHEMA_COST_FACTOR} times "
                            f"each pattern's limit, {NESTED_POSITIONS_MAX} and "
                            f"{REPEATED_EMPTY_MAX}, in one schema): the worker's grammar tries "
                            f"anyOf branches at once, so their costs add up")


def _keep_matching_values(node: dict, sent: str, path: str, branch: bool) -> None:
    """Leave out of ``node``'s ``enum`` the strings that its rewritten ``pattern`` (``sent``,
    a regex over the JSON text that Python's ``re`` reads as the worker's converter does) does
    not match; a ``const`` string it does not match is a 400. llama.cpp's schema reader takes
    ``const``, then ``enum``, before the type's keywords (common/json-schema.cpp), so the
    answer could be an ``enum`` value the pattern refused (a fresh tester's find). Raises
    ApiError(400) when no value is left, unless ``node`` is an ``anyOf``/``oneOf`` branch
    (``branch``), which another branch may stand in for: it is left as the worker takes it (a
    fresh tester's false refusal)."""
    only_strings = node.get("type") == "string" or node.get("type") == ["string"]

    def matches(v) -> bool:
        if not isinstance(v, str):
            return not only_strings  # the pattern is for strings; the type refuses others
        text = orjson.dumps(v).decode()[1:-1].replace("\x7f", "\\u007f")
        return re.fullmatch(sent, text) is not None
    if "const" in node:
        if not matches(node["const"]) and not branch:
            raise ApiError(400, f"{path}: const {shown(node['const'])} does not match the "
                                f"pattern; no value can match the schema")
    elif isinstance(node.get("enum"), list) and node["enum"]:
        kept = [v for v in node["enum"] if matches(v)]
        if kept:
            node["enum"] = kept
        elif not branch:
            raise ApiError(400, f"{path}: no enum value matches the pattern; no value can "
                                f"match the schema")


def _pointer(doc, ref: str):
    """The value a ``#/a/b/0`` JSON pointer names in ``doc``, or None."""
    cur = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _check_bounds(node: dict, path: str, integer: bool) -> None:
    lo_k = "minimum" if _is_num(node.get("minimum")) else "exclusiveMinimum"
    hi_k = "maximum" if _is_num(node.get("maximum")) else "exclusiveMaximum"
    lo, hi = node.get(lo_k), node.get(hi_k)
    if not (_is_num(lo) and _is_num(hi)):
        return
    if lo > hi or (lo == hi and "exclusive" in lo_k + hi_k):
        raise ApiError(400, f"{path}: {lo_k} ({lo}) and {hi_k} ({hi}) leave no number; no "
                            f"value can match the schema")
    if integer:  # the worker's integer range (json-schema.cpp
        # get_bound: inclusive bounds rounded inwards); an empty one answered 500 "Unexpected
        # empty grammar stack" (a fresh tester's find)
        first = math.floor(lo) + 1 if lo_k == "exclusiveMinimum" else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_k == "exclusiveMaximum" else math.floor(hi)
        if first > last:
            raise ApiError(400, f"{path}: {lo_k} ({lo}) and {hi_k} ({hi}) leave no integer; no "
                                f"value can match the schema")


def _stoi(text: str) -> int | None:
    """``std::stoi``'s reading of ``text``: leading spaces, a sign, digits; what follows is
    ignored ("2x" and "2.5" are 2); None when no digits start it."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else None


def _regex_bad_repetition(pattern: str) -> str:
    """What is wrong with the first bad quantifier in the regex ``pattern`` (outside escapes
    and character classes), or "": ``{m,n}`` with ``n < m``, or a minimum ``m`` above
    :data:`REPETITIONS_MAX`. llama.cpp's json-schema-to-grammar copies regex repetitions into
    the grammar, reading each number with ``std::stoi`` up to the first ``}`` (so ``{5,2x}``
    and ``{5,+2}`` are ``{5,2}``)."""
    skip_to = 0
    for i, c in unescaped_outside_classes(pattern):
        if c != "{" or i < skip_to:
            continue
        j = pattern.find("}", i)
        if j < 0:
            return ""
        nums = pattern[i + 1:j].split(",")
        lo = _stoi(nums[0]) if len(nums) <= 2 else None
        if len(nums) == 2:
            hi = _stoi(nums[1])
            if lo is not None and hi is not None and hi < lo:
                return f"repetition {pattern[i:j + 1]} has its maximum below its minimum"
        if lo is not None and lo > REPETITIONS_MAX:
            return _too_many(pattern[i:j + 1])
        skip_to = j + 1
    return ""


#: Most grammar positions one bounded repetition of an ambiguous group may multiply out to
#: (:func:`regex_nested_cost`). llama.cpp's grammar sampler keeps one stack per position a
#: partial answer can be in and matches every vocabulary token against each of them; a group
#: whose iterations have no fixed end (``(a{0,100}){0,100}``: any "a" can end one and start
#: the next) leaves up to its count times its inner positions live at once. Measured on the
#: pinned llama-server with the demo model: ``(a{0,20}){0,20}`` (400) 0.11 s for its answer,
#: ``((a{0,10}){0,10}){0,10}`` (1,000) 1.1 s for 4 tokens, ``(a{0,10}b?){0,100}`` (1,100)
#: 7.8 s for 6 tokens, ``(a{0,141}){0,141}`` 6.8 s for 5; at 400 x 400 the worker's main loop
#: stopped answering and the gateway killed it as wedged, then the retried request killed the
#: next one (a fresh tester's find). Delimited groups such as ``(\w{1,50} ){0,100}``
#: (0.07 s for 64 tokens) have one live position and are not counted.
NESTED_POSITIONS_MAX = 500

#: Most places one character can go in a repetition of a part that can be empty
#: (:func:`regex_costs`): ``(a?){0,n}`` matches a run of "a" by choosing which of its ``n``
#: copies are not empty, so after each character llama.cpp's grammar sampler can be in any of
#: the ``n`` copies, and it matches every vocabulary token character by character against
#: each (a recursion that branches again at every character). A part with ``f`` first
#: characters counts ``n x f``; a nested one multiplies (``((a?){0,16}){0,16}``: 256), and
#: such repetitions in a row add up. Measured on the pinned llama-server with the demo model,
#: 48 tokens forced: ``(a?){0,40}`` 7 ms per token, ``(a?){0,60}`` 20 ms, ``(a|b?){0,60}``
#: (120) 85 ms, ``(a?){0,100}`` 81 ms, ``(a?){0,200}`` 0.86 s, ``(a?){0,300}`` wedged the
#: worker (a fresh tester's find, the same with a GBNF ``x ::= "a" | ""``);
#: ``((a{0,5}){0,10}){0,10}`` (100) 1.2 s per token and ``((a?){0,16}){0,16}`` more than 1.9 s,
#: both within the position count above. An unbounded ``(a?)*`` is one recursive rule (2 ms
#: per token) and is not counted; ``(a{0,20}){0,20}`` counts 20 (36 ms per token).
REPEATED_EMPTY_MAX = 64

#: How many times each pattern's limit above all the patterns of one schema may reach
#: together: patterns in ``anyOf`` branches are live at once, and their costs add up (a fresh
#: tester's: 10 branches of ``^(a*){60}a{100}$``, each within the limits, 485 ms per token;
#: 80 branches 5.5 s, which froze both slots).
#: Only patterns under ``anyOf``/``oneOf`` are added (sequential properties are not live at
#: once: two properties of ``^(a?){0,60}X$`` 5.2 ms per token, one 5.6 ms).
SCHEMA_COST_FACTOR = 2

_QUANT = re.compile(r"[*+?]\??")  # braces: read by hand in _quantifier


def _quantifier(pattern: str, i: int) -> tuple[int, int | None, int]:
    """The quantifier at ``pattern[i:]``: (minimum, maximum or None when unbounded, its
    length); (1, 1, 0) when none is there. Braces are read as llama.cpp's
    json-schema-to-grammar reads a regex's (``_visit_pattern``): up to the first ``}``, one or
    two numbers split at ``,``, each as ``std::stoi`` reads it (``{0, 500}``, ``{0,+500}`` and
    ``{0,500x}`` are ``{0,500}``; a fresh tester's find), an empty minimum 0 and an empty
    maximum unbounded."""
    if pattern.startswith("{", i):
        j = pattern.find("}", i)
        nums = pattern[i + 1:j].split(",") if j > 0 else []
        if len(nums) not in (1, 2):
            return 1, 1, 0
        if len(nums) == 1:
            lo = hi = _stoi(nums[0])
        else:
            lo = _stoi(nums[0]) if nums[0] else 0
            hi = _stoi(nums[1]) if nums[1] else None
            if nums[1] and hi is None:
                lo = None
        if lo is None:  # the worker takes the pattern as any string
            return 1, 1, 0
        end = j + 1 + (pattern.startswith("?", j + 1))
        return max(lo, 0), (max(hi, 0) if hi is not None else None), end - i
    m = _QUANT.match(pattern, i)
    if not m:
        return 1, 1, 0
    lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[m.group(0)[0]]
    return lo, hi, m.end() - i


class _Nesting:
    r"""The fold behind :func:`regex_nested_cost` and :func:`grammar_nested_cost`, fed items
    and groups in order: each item (a character, a class, a rule reference, a closed group)
    comes with its own positions, whether it is undelimited, its quantifier (minimum, maximum
    or None when unbounded, and its text for the refusal), and, for a literal, its text
    (``literal``). ``worst`` is the largest cost seen: a bounded repetition (maximum above 1)
    of an undelimited item, times its positions; or the summed positions of the varying items
    (a count that varies, or an undelimited group) of one group or the whole, when it has two
    or more: ``[a-z]{0,100}`` twenty times in a row leaves any split of a partial answer among
    them live at once, as a nesting does (a fresh tester's find: 2,300 positions, 22.7 s for
    64 tokens; ten ``(a{0,20}){0,24}`` in a row, 480 positions each, wedged the worker).

    A group is delimited, each iteration's end fixed by its input, when its last item repeats
    a fixed number of times and is itself delimited, or when it starts with a literal (once)
    that its last item is not: ``(\w{1,50} )``, ``("," value)``; undelimited otherwise:
    ``(a{0,10})``, ``(a{0,10}b?)``, ``(a a{0,5})``. A heuristic: a class or rule that matches
    the starting literal still passes."""

    def __init__(self) -> None:
        self.stack: list[dict] = [self._frame()]
        self.worst: tuple[int, str] = (0, "")
        #: the largest repeated-empty branching (:data:`REPEATED_EMPTY_MAX`) and its text
        self.worst_empty: tuple[int, str] = (0, "")
        #: alternatives (``|``) seen, every group's together (:data:`UNITS_MAX`)
        self.alternatives = 0

    @staticmethod
    def _frame() -> dict:
        # positions so far; the last item varies or is undelimited; every item nullable; an
        # earlier alternative undelimited; the first item's literal text (None: not a literal
        # met once, or no item yet: "") and the last item's literal text. For the
        # repeated-empty count: first characters of the finished alternatives and of this one
        # (while its items so far can be empty), whether some alternative can match nothing,
        # the largest branching inside, and the run of empty-able repetitions in a row
        return {"pos": 0, "open_end": False, "nullable": True, "undelim": False, "first": "",
                "last": None, "var_pos": 0, "var_n": 0, "var_first": "", "var_literal": None,
                "firsts": 0, "alt_firsts": 0, "alt_empty": True, "any_empty": False,
                "branch": 0, "run": 0, "run_n": 0, "run_text": "", "run_wild": 0,
                "run_leads": {}, "alts": False}

    def item(self, positions: int, undelimited: bool, lo: int, hi: int | None,
             text: str, literal: str | None = None, group: bool = False,
             firsts: int = 1, empty: bool = False, branch: int = 0,
             lead: str | None = None) -> None:
        """One item: its positions, whether undelimited, its quantifier and text, its literal
        text; for a group or rule, also its number of first characters (``firsts``), whether
        it can match nothing (``empty``), the largest branching inside it (``branch``) and
        the literal it starts with (``lead``)."""
        # nested repetitions multiply when the repeated part can be empty; without one they
        # measured fast: (a{1,100}){1,100} (10,000 positions) 9 ms per token,
        # (\w{1,20}\s?){1,50} 4-6 ms (a fresh tester's false refusal)
        if hi is not None and hi > 1 and undelimited and empty and \
                hi * positions > self.worst[0]:
            self.worst = (hi * positions, text)
        self._empty_count(lo, hi, text, firsts, empty, branch,
                          literal if literal is not None else lead)
        f = self.stack[-1]
        f["pos"] += positions * (hi if hi is not None else 1)
        if (literal is not None and lo == hi and lo >= 1) or (group and lead):
            # a literal that must be there (a "." between two names, a group that starts
            # with "\n") ends the run of varying items before it (a fourth tester's false
            # refusals: [a-z0-9]{1,255}\.[a-z0-9]{1,255}, a CSV grammar of rows)
            f["var_pos"], f["var_n"], f["var_first"], f["var_literal"] = 0, 0, "", None
        if hi is None or lo != hi or undelimited:  # a varying item: its positions add up
            # a delimited group has one iteration live at a time; two different literals in
            # a row cannot trade characters, so a new run starts
            live = positions if group and not undelimited else \
                positions * (hi if hi is not None else 1)
            if literal is not None and f["var_literal"] not in (None, literal):
                f["var_pos"], f["var_n"], f["var_first"] = 0, 0, ""
            f["var_pos"] += live
            f["var_n"] += 1
            f["var_first"] = f["var_first"] or text
            f["var_literal"] = literal
            if f["var_n"] >= 2 and f["var_pos"] > self.worst[0]:
                self.worst = (f["var_pos"], f"{f['var_first']} … {text}")
        f["open_end"] = hi is None or lo != hi or undelimited
        f["nullable"] = f["nullable"] and (lo == 0 or (undelimited and positions == 0))
        if f["first"] == "":
            f["first"] = literal if lo == hi == 1 else None
        f["last"] = literal

    def _empty_count(self, lo: int, hi: int | None, text: str, firsts: int, empty: bool,
                     branch: int, lead: str | None) -> None:
        f = self.stack[-1]
        # copies llama.cpp writes out: {m,n} n of them, {m,} m and then one recursive rule
        copies = hi if hi is not None else (lo + 1 if lo > 1 else 1)
        if empty and copies > 1:  # any copy can take the next character
            firsts = copies * max(firsts, 1)
            branch = max(branch, firsts)
        if branch > self.worst_empty[0]:
            self.worst_empty = (branch, text)
        can_skip = lo == 0 or empty
        if f["alt_empty"]:
            f["alt_firsts"] += firsts
        f["alt_empty"] = f["alt_empty"] and can_skip
        if can_skip:
            # parts that can be skipped, in a row: a character can go in any of them
            # (``a?`` 600 times wedged both workers, a fresh tester's find), so their first
            # characters add up, per literal they start with: parts that start with
            # different literals (optional "key": value pairs) are told apart by their text,
            # but ``a?b?`` 100 times puts a run of "a" in any of 100 copies (a fourth
            # tester's find: 0.92 s per token; 300 times wedged the worker); a part that
            # starts with no literal (a class) can take any of them
            c = max(branch, firsts)
            if lead is None:
                f["run_wild"] += c
            else:
                f["run_leads"][lead] = f["run_leads"].get(lead, 0) + c
            f["run"] = f["run_wild"] + max(f["run_leads"].values(), default=0)
            f["run_n"] += 1
            f["run_text"] = f["run_text"] or text
            if f["run_n"] >= 2 and f["run"] > self.worst_empty[0]:
                self.worst_empty = (f["run"], f"{f['run_text']} … {text}")
        else:
            f["run"], f["run_n"], f["run_text"], f["run_wild"] = 0, 0, "", 0
            f["run_leads"] = {}
        f["branch"] = max(f["branch"], branch, f["run"] if f["run_n"] >= 2 else 0)

    def _ends_open(self, f: dict) -> bool:
        if f["nullable"]:
            return True
        if not f["open_end"]:
            return False
        return not (f["first"] and f["last"] != f["first"])  # a starting literal delimits

    def alternative(self) -> None:
        self.alternatives += 1
        f = self.stack[-1]
        f["undelim"] = f["undelim"] or self._ends_open(f)
        self.stack[-1] = {**self._frame(), "undelim": f["undelim"], "pos": f["pos"],
                          "var_pos": f["var_pos"], "var_n": f["var_n"],
                          "var_first": f["var_first"],
                          "var_literal": f["var_literal"],  # alternatives are live together
                          "firsts": f["firsts"] + f["alt_firsts"],
                          "any_empty": f["any_empty"] or f["alt_empty"], "branch": f["branch"],
                          "alts": True}

    def open(self) -> None:
        self.stack.append(self._frame())

    def close(self) -> tuple[int, bool, int, bool, int, str | None]:
        """End the innermost group (or, with none open, the whole): (its positions, whether
        it is undelimited in some alternative, its first characters, whether it can match
        nothing, the largest branching inside it, the literal it starts with or None)."""
        f = self.stack.pop() if len(self.stack) > 1 else self.stack[0]
        lead = f["first"] if f["first"] and not f["alts"] else None
        return (max(f["pos"], 1), f["undelim"] or self._ends_open(f),
                f["firsts"] + f["alt_firsts"], f["any_empty"] or f["alt_empty"], f["branch"],
                lead)


def regex_nested_cost(pattern: str) -> tuple[int, str]:
    """The positions half of :func:`regex_costs`."""
    return regex_costs(pattern)[0]


def regex_costs(pattern: str) -> tuple[tuple[int, str], tuple[int, str], int]:
    """(the largest number of grammar positions a bounded repetition of an undelimited group
    in the regex ``pattern`` multiplies out to, that repetition's text), or (0, ""). A group
    is undelimited when its last item (of any alternative) repeats a varying number of times
    or it can match nothing; its positions are the sum of its items' maximum counts times
    their own positions (unbounded ``*``/``+`` count once: llama.cpp writes them as one
    recursive rule). Escapes and character classes are single items; the pattern is read as
    llama.cpp's json-schema-to-grammar reads it, without validating it. Second: the largest
    branching of a bounded repetition of a part that can match nothing, with its text
    (:data:`REPEATED_EMPTY_MAX`), or (0, ""). Third: the number of ``|`` in it."""
    fold = _Nesting()
    starts: list[int] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            fold.open()
            starts.append(i)
            i += 3 if pattern.startswith("?:", i + 1) else 1
            continue
        is_group = c == ")" and bool(starts)
        firsts, empty, branch, lead = 1, False, 0, None
        if is_group:
            positions, undelimited, firsts, empty, branch, lead = fold.close()
            start, i = starts.pop(), i + 1
        elif c == "|":
            fold.alternative()
            i += 1
            continue
        elif c in "^$":
            i += 1
            continue
        else:
            start, positions, undelimited = i, 1, False
            i = _regex_atom_end(pattern, i)
        atom = pattern[start:i]
        # a literal: one plain character, or an escaped one that is not a class (\d, \w …)
        literal = atom if (len(atom) == 1 and atom != ".") or (
            len(atom) == 2 and atom[0] == "\\" and not atom[1].isalnum()) else None
        lo, hi, qlen = _quantifier(pattern, i)
        fold.item(positions, undelimited, lo, hi, pattern[start:i + qlen], literal, is_group,
                  firsts, empty, branch, lead)
        i += qlen
    return fold.worst, fold.worst_empty, fold.alternatives


#: Hex digits after ``\x``, ``\u`` and ``\U``, in a regex as the converter reads it
#: (gbnf_escape_length) and in GBNF (llama-grammar.cpp parse_char).
_GBNF_HEX = {"x": 2, "u": 4, "U": 8}


def _regex_atom_end(pattern: str, i: int) -> int:
    """The index after the single item (an escape, a character class, a character) at
    ``pattern[i]``."""
    n = len(pattern)
    if pattern[i] == "\\":  # \xHH, \uHHHH and \UHHHHHHHH are one character
        hexes = _GBNF_HEX.get(pattern[i + 1:i + 2], 0)
        digits = pattern[i + 2:i + 2 + hexes]
        if hexes and len(digits) == hexes and all(c in string.hexdigits for c in digits):
            return i + 2 + hexes
        return i + 2
    if pattern[i] != "[":
        return i + 1
    j = i + 1
    if j < n and pattern[j] == "^":
        j += 1
    if j < n and pattern[j] == "]":
        j += 1
    while j < n and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


_RULE_HEAD = re.compile(r"^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z0-9_-]+")


def grammar_nested_cost(text: str) -> tuple[int, str]:
    """The positions half of :func:`grammar_costs`."""
    return grammar_costs(text)[0]


def grammar_costs(text: str) -> tuple[tuple[int, str], tuple[int, str], int]:
    """:func:`regex_costs` for a GBNF grammar: its rules' items (literals, classes, rule
    references, groups) with their quantifiers, a reference standing for the rule's own
    positions (a rule that refers back to itself, a recursion as llama.cpp writes ``*``,
    counts once). An empty literal ``""`` or an empty alternative matches nothing. ((cost,
    the repetition's text) of the worst one, or (0, ""); the same for the repeated-empty
    branching; the number of ``|`` in all rules)."""
    refused, bodies = read_grammar(text)  # each rule as the worker's parser delimits it
    if refused is not None:  # (only tests ask for the costs of a grammar the worker refuses)
        heads = list(_RULE_HEAD.finditer(text))
        bodies = {m.group(1): text[m.end():(heads[k + 1].start() if k + 1 < len(heads) else
                                             len(text))] for k, m in enumerate(heads)}
    done: dict[str, tuple[int, bool, int, bool, int, str | None]] = {}
    worst: list[tuple[int, str]] = [(0, ""), (0, "")]
    alternatives = [0]

    busy: set[str] = set()  # the rules being read, outermost first (one set: a chain of
    # thousands of rules copied a set per level, 254 s for 30,000)

    def rule(name: str) -> tuple[int, bool, int, bool, int, str | None]:
        if name in done:
            return done[name]
        if name in busy or name not in bodies:
            return 1, False, 1, False, 0, None
        busy.add(name)
        fold, body = _Nesting(), bodies[name]
        i, n, starts = 0, len(body), []
        while i < n:
            c = body[i]
            if c in " \t\r\n":
                i += 1
                continue
            if c == "#":
                while i < n and body[i] not in "\r\n":
                    i += 1
                continue
            if c == "(":
                fold.open()
                starts.append(i)
                i += 1
                continue
            if c == "|":
                fold.alternative()
                i += 1
                continue
            start, literal, is_group = i, None, c != '"' and c != "["
            firsts, empty, branch, lead = 1, False, 0, None
            if c == ")" and starts:
                positions, undelimited, firsts, empty, branch, lead = fold.close()
                start, i = starts.pop(), i + 1
            elif c in "\"[":
                close = '"' if c == '"' else "]"
                i += 1
                while i < n and body[i] != close:
                    i += 2 if body[i] == "\\" else 1
                i, positions, undelimited = i + 1, 1, False
                literal = body[start:i] if c == '"' else None
                if literal == '""':
                    firsts, empty = 0, True
            else:
                m = _NAME.match(body, i)
                if not m:
                    i += 1
                    continue
                i = m.end()
                positions, undelimited, firsts, empty, branch, lead = rule(m.group(0))
            j = i
            while j < n and body[j] in " \t":
                j += 1
            lo, hi, qlen = _grammar_quantifier(body, j)
            if qlen:
                i = j + qlen
            fold.item(positions, undelimited, lo, hi, body[start:i].strip(), literal, is_group,
                      firsts, empty, branch, lead)
        done[name] = fold.close()
        busy.discard(name)
        alternatives[0] += fold.alternatives
        for k, found in enumerate((fold.worst, fold.worst_empty)):
            if found[0] > worst[k][0]:
                worst[k] = found
        return done[name]

    for name in bodies:
        rule(name)
    return worst[0], worst[1], alternatives[0]


def _grammar_quantifier(body: str, i: int) -> tuple[int, int | None, int]:
    """:func:`_quantifier` for GBNF, whose braces may hold spaces and comments."""
    if i < len(body) and body[i] == "{":
        j = body.find("}", i)
        if j > 0:
            inner = _brace_text(body[i + 1:j])
            lo_t, comma, hi_t = inner.partition(",")
            if lo_t.isdigit() and (not comma or hi_t.isdigit() or hi_t == ""):
                lo = int(lo_t)
                hi = lo if not comma else (int(hi_t) if hi_t else None)
                return lo, hi, j + 1 - i
        return 1, 1, 0
    return _quantifier(body, i)


def check_grammar(text, where: str) -> None:
    """Raise ApiError(400) when the GBNF ``text`` has a repetition ``{m,n}`` with ``n < m``
    (outside string literals, character classes and comments), or nested repetitions past
    :data:`NESTED_POSITIONS_MAX` positions (:func:`grammar_nested_cost`), and with the reason
    and place (``gbnf_syntax.grammar_error``) for a grammar the worker's parser refuses, which
    the worker answers with a bare "failed to parse grammar"."""
    if not isinstance(text, str) or text == "":  # "": no grammar, as llama-server reads it
        return
    text = text.split("\0", 1)[0]  # the worker's parser reads a C string: it ends at a NUL
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "[":
            i = _gbnf_class_end(text, i, where)
        elif c == '"':  # a literal "…", with backslash escapes
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "#":  # to the end of the line, which llama.cpp ends at \r or \n
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "{":
            j = i + 1  # the closing brace, past comments (llama.cpp skips them, and the
            while j < n and text[j] != "}":  # spaces, inside the braces too: parse_space)
                if text[j] == "#":
                    while j < n and text[j] not in "\r\n":
                        j += 1
                else:
                    j += 1
            if j >= n:
                return
            inner = _brace_text(text[i + 1:j])
            lo, comma, hi = inner.partition(",")
            if comma and lo.isdigit() and hi.isdigit() and int(hi) < int(lo):
                raise ApiError(400, f"{where}: repetition {{{lo},{hi}}} has its maximum below "
                                    f"its minimum")
            if lo.isdigit() and int(lo) > REPETITIONS_MAX:
                raise ApiError(400, f"{where}: {_too_many('{' + inner + '}')}")
            i = j + 1
        else:
            i += 1
    refused = grammar_error(text)
    if refused is not None:  # the worker's answer would be a bare "failed to parse grammar"
        raise ApiError(400, f"{where}: {refused}")
    try:
        with deep_frames():
            costs = grammar_costs(text)
    except RecursionError:
        raise ApiError(400, f"{where}: {TOO_DEEP}") from None
    _check_positions(costs, where)


_GBNF_ESCAPED = {"t": 9, "r": 13, "n": 10}


def _gbnf_char(text: str, i: int) -> tuple[int | None, int]:
    """(code point, index after it) of the GBNF character at ``text[i]``, read as
    llama-grammar.cpp ``parse_char`` reads it; None for an escape it would refuse."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    e = text[i + 1:i + 2]
    if e in _GBNF_HEX:
        digits = text[i + 2:i + 2 + _GBNF_HEX[e]]
        return (int(digits, 16) if digits and all(d in string.hexdigits for d in digits)
                else None), i + 2 + len(digits)
    return _GBNF_ESCAPED.get(e, ord(e) if e else None), i + 2


def _gbnf_class_end(text: str, i: int, where: str) -> int:
    """The index after the GBNF character class at ``text[i]`` (``[``), read as
    llama-grammar.cpp ``parse_sequence`` reads one. Raises ApiError(400) for a range whose
    end is below its start (``[z-a]``): the worker took it, matched no character with it, and
    answered 500 "Unexpected empty grammar stack" when an answer reached it (a fresh
    tester's find)."""
    n = len(text)
    negated = text.startswith("[^", i)
    i += 2 if negated else 1
    reversed_range, member = None, False
    while i < n and text[i] != "]":
        at = i
        lo, i = _gbnf_char(text, i)
        if i + 1 < n and text[i] == "-" and text[i + 1] != "]":
            hi, i = _gbnf_char(text, i + 1)
            if lo is not None and hi is not None and hi < lo:
                reversed_range = reversed_range or text[at:i]
                continue
        member = True
    # only a class that then matches nothing: [az-a] still matches "a", [^z-a] any character
    if reversed_range and not member and not negated:
        raise ApiError(400, f"{where}: the character class range {reversed_range} is out of "
                            f"order (its end is below its start), so the class matches no "
                            f"character")
    return i + 1


def _too_many(rep: str) -> str:
    return (f"repetition {rep} repeats more times than the worker's grammar takes (at most "
            f"{REPETITIONS_MAX})")


def _check_positions(found: tuple[tuple[int, str], tuple[int, str], int], where: str) -> None:
    """Raise ApiError(400) naming ``where`` when ``found`` (:func:`regex_costs` or
    :func:`grammar_costs`: (positions, the repetitions' text), (repeated-empty branching, its
    text), alternatives) is past :data:`NESTED_POSITIONS_MAX`, :data:`REPEATED_EMPTY_MAX` or
    :data:`UNITS_MAX`."""
    (cost, rep), (branch, empty_rep), alternatives = found
    if alternatives >= UNITS_MAX:  # a word list written as one alternation (a fresh
        # tester's: 19,715 of them wedged both workers, 3,000 took 65 ms per token)
        raise ApiError(400, f"{where}: {alternatives + 1} alternatives; the worker's grammar "
                            f"for more than {UNITS_MAX} would take too long to build and "
                            f"match (an enum has the same limit)")
    if cost <= NESTED_POSITIONS_MAX and branch > REPEATED_EMPTY_MAX:
        raise ApiError(400, f"{where}: the repetitions {empty_rep} repeat a part that can be "
                            f"empty, so each character could go in about {branch} places the "
                            f"worker's grammar would try at once (at most "
                            f"{REPEATED_EMPTY_MAX}); make the repeated part non-empty (a{{0,n}} "
                            f"instead of (a?){{0,n}}) or lower the counts")
    if cost > NESTED_POSITIONS_MAX:
        raise ApiError(400, f"{where}: the repetitions {rep} have about {cost} positions "
                            f"the worker's grammar would track at once (at most "
                            f"{NESTED_POSITIONS_MAX}); give the inner part a fixed end, such "
                            f"as a delimiter, or lower the counts")


def _brace_text(inner: str) -> str:
    """What llama.cpp reads between a GBNF repetition's braces: comments and spaces skipped
    (``parse_space``)."""
    return re.sub(r"#[^\r\n]*|\s", "", inner)


def check_tools(tools, where: str = "tools") -> None:
    """:func:`check_schema` of each tool's ``function.parameters`` (llama-server compiles them
    into a grammar for tool calls)."""
    if not isinstance(tools, list):
        return
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), dict):
            check_schema(fn["parameters"], f"{where}[{i}].function.parameters")
