"""Why llama.cpp would refuse a GBNF grammar, in its own words and with a line and column.

The pinned llama-server answers every grammar it cannot load with the same 400, "Failed to
initialize samplers: failed to parse grammar"; the reason goes only to the worker's log
(src/llama-grammar.cpp ``llama_grammar_parser::parse``, which throws the messages used here
and prints them with the whole rest of the grammar, and ``llama_grammar_init_impl``, which
then checks for the ``root`` rule and left recursion). :func:`grammar_error` reads a grammar
the way that parser does and returns the first reason, so the client gets it in the 400.

Read as the parser reads: the text ends at its first NUL (a C string); rules are ``name ::=
alternatives`` ending at a newline (inside parentheses newlines are spaces); ``#`` comments
run to the end of the line; names are ``[a-zA-Z0-9-]+``; literals ``"…"`` and classes ``[…]``
take the escapes ``\\x`` (2 hex digits), ``\\u`` (4), ``\\U`` (8), ``\\t \\r \\n \\\\ \\" \\[
\\] \\-``; tokens are ``<[id]>``, ``<text>`` and ``!`` before either (``<text>`` needs the
model's vocabulary: it is left to the worker); repetitions ``* + ? {m} {m,} {m,n}`` with at
most 2,000 (``MAX_REPETITION_THRESHOLD``) repetitions, also multiplied over nested ones.

Only refusals the worker would make are reported: a grammar this module passes may still be
refused by the worker (an unknown ``<text>`` token), never the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys

#: llama-grammar.cpp ``MAX_REPETITION_THRESHOLD``.
REPETITION_THRESHOLD = 2000
#: Most groups nested in one another: refused past it. The worker's parser recurses on its
#: stack once per level; it loaded 10,000 and crashed (signal 11) at 50,000, each of the
#: model's workers in turn as the request was retried (a fresh tester's find).
NESTING_MAX = 5000
#: Python frames the reading may use (a rule chain is followed one frame per reference).
_FRAMES = 40_000

_ESCAPES = {"x": 2, "u": 4, "U": 8}
_SIMPLE = "trn\\\"[]-"
_HEX = set("0123456789abcdefABCDEF")
_SPACES = " \t"
_PLAIN_LITERAL = re.compile(r'[^"\\]*')


class _Refused(Exception):
    """One of the parser's refusals: its message and where in the text (None: no place)."""

    def __init__(self, message: str, pos: int | None = None):
        super().__init__(message)
        self.message, self.pos = message, pos


def _digit(c: str) -> bool:
    return "0" <= c <= "9" and c != ""


def _word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


class _Parser:
    """llama_grammar_parser's reading, keeping per rule only what the refusals need: each
    alternative as a list of items, an item ``None`` for a terminal or a rule number.
    Repetitions keep llama.cpp's shape (``S{m,n}``: the first copy of ``S`` or none, then a
    rule ``S' ::= S S'' |``) with one copy of each generated rule: the copies change no
    refusal, and a grammar of 2,000 repetitions stays small here."""

    def __init__(self, text: str):
        self.s = text.split("\0", 1)[0]
        self.n = len(self.s)
        self.names: dict[str, int] = {}  # rule name -> number, in order of first mention
        self.generated = 0  # numbers llama.cpp gives its synthesized rules (counted only)
        self.rules: dict[int, list[list[int | None]]] = {}
        self.owner: dict[int, str] = {}  # rule number -> the named rule it was written in
        self.mentioned: dict[int, int] = {}  # rule number -> where it was first referenced
        self.bodies: dict[str, str] = {}  # rule name -> its alternatives' text (the last one)
        self.last_id = -1  # the highest of llama.cpp's rule ids a rule was added under
        self.depth = 0  # groups open

    # --- lexing (parse_space, parse_name, parse_int, parse_char) ---------------------------

    def at(self, i: int) -> str:
        return self.s[i] if i < self.n else ""

    def space(self, i: int, newline_ok: bool) -> int:
        s, n = self.s, self.n
        while i < n and (s[i] in _SPACES or s[i] == "#" or (newline_ok and s[i] in "\r\n")):
            if s[i] == "#":
                while i < n and s[i] not in "\r\n":
                    i += 1
            else:
                i += 1
        return i

    def run_end(self, i: int, member, what: str) -> int:
        """The end of the run of ``member`` characters at ``i`` (parse_name, parse_int);
        refused as ``expecting <what>`` when there is none."""
        j = i
        while j < self.n and member(self.s[j]):
            j += 1
        if j == i:
            raise _Refused(f"expecting {what}", i)
        return j

    def name_end(self, i: int) -> int:
        return self.run_end(i, _word, "name")

    def int_end(self, i: int) -> int:
        return self.run_end(i, _digit, "integer")

    def char_end(self, i: int) -> int:
        c = self.at(i)
        if c == "\\":
            e = self.at(i + 1)
            if e in _ESCAPES:
                size, j = _ESCAPES[e], i + 2
                k = j
                while k < j + size and self.at(k) in _HEX:
                    k += 1
                if k != j + size:
                    raise _Refused(f"expecting {size} hex chars", j)
                return k
            if e and e in _SIMPLE:
                return i + 2
            raise _Refused("unknown escape", i)
        if c:
            return i + 1
        raise _Refused("unexpected end of input")

    def token_end(self, i: int) -> int:
        if self.at(i) != "<":
            raise _Refused("expecting '<'", i)
        i += 1
        if self.at(i) == "[":
            j = self.int_end(i + 1)
            if int(self.s[i + 1:j]) > 0xFFFFFFFF:
                raise _Refused("parsed token id is too big", i + 1)
            if self.at(j) != "]":
                raise _Refused("expecting ']'", j)
            if self.at(j + 1) != ">":
                raise _Refused("expecting '>'", j + 1)
            return j + 2
        j = self.s.find(">", i)
        if j < 0:
            raise _Refused("expecting '>'", self.n)
        return j + 1

    def count(self, i: int, j: int) -> int:
        """A repetition count, which llama.cpp reads with ``std::stoull`` (a number past 64
        bits throws ``out_of_range``)."""
        value = int(self.s[i:j])
        if value >= 2**64:
            raise _Refused("repetition count out of range (stoull)", i)
        return value

    # --- rules (parse, parse_rule, parse_alternates, parse_sequence) -----------------------

    def symbol(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.names) + self.generated
        return self.names[name]

    def new_rule(self, owner: str) -> int:
        """A number for a rule llama.cpp synthesizes (negative: apart from the named rules')."""
        number = -1 - len(self.owner)
        self.owner[number] = owner
        return number

    def parse(self) -> None:
        i = self.space(0, True)
        while i < self.n:
            i = self.rule(i)

    def rule(self, i: int) -> int:
        j = self.name_end(i)
        name = self.s[i:j]
        number = self.symbol(name)
        self.owner[number] = name
        i = self.space(j, False)
        if not self.s.startswith("::=", i):
            raise _Refused("expecting ::=", i)
        start = self.space(i + 3, True)
        i = self.alternates(start, name, number, False)
        self.bodies[name] = self.s[start:i]
        self.last_id = max(self.last_id, number)
        c = self.at(i)
        if c == "\r":
            i += 2 if self.at(i + 1) == "\n" else 1
        elif c == "\n":
            i += 1
        elif c:
            raise _Refused("expecting newline or end", i)
        return self.space(i, True)

    def alternates(self, i: int, owner: str, number: int, nested: bool) -> int:
        alternatives: list[list[int | None]] = []
        seq: list[int | None] = []
        i = self.sequence(i, owner, seq, nested)
        alternatives.append(seq)
        while self.at(i) == "|":
            seq = []
            i = self.sequence(self.space(i + 1, True), owner, seq, nested)
            alternatives.append(seq)
        self.rules[number] = alternatives
        return i

    def sequence(self, i: int, owner: str, seq: list, nested: bool) -> int:
        last = len(seq)  # where the item a quantifier applies to starts
        before = 1  # the rules that item stands for (llama.cpp's n_prev_rules)

        def repeat(lo: int, hi: int | None, at: int) -> None:
            nonlocal before
            if last == len(seq):
                raise _Refused("expecting preceding item to */+/?/{", at)
            total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
            if before * total > REPETITION_THRESHOLD:
                raise _Refused("number of rules that are going to be repeated multiplied by "
                               "the new repetition exceeds sane defaults, please reduce the "
                               "number of repetitions or rule complexity")
            item = seq[last:]
            if lo == 0:
                del seq[last:]
            optional = 1 if hi is None else hi - lo  # llama.cpp's n_opt rules S'
            if optional > 0:
                self.last_id = max(self.last_id, len(self.names) + self.generated + optional - 1)
                self.generated += optional  # llama.cpp numbers each of them
                if hi is None:  # S' ::= S S' |
                    ref = self.new_rule(owner)
                    self.rules[ref] = [item + [ref], []]
                else:  # S'(1) ::= S |  and  S'(x) ::= S S'(x-1) |  standing for the rest
                    ref = self.new_rule(owner)
                    self.rules[ref] = [list(item), []]
                    if optional > 1:
                        chain = self.new_rule(owner)
                        self.rules[chain] = [item + [ref], []]
                        ref = chain
                seq.append(ref)
            before *= total

        while i < self.n:
            c = self.s[i]
            start = i
            if c == '"':
                last, before, i = len(seq), 1, i + 1
                opened = i
                while self.at(i) != '"':
                    if not self.at(i):
                        raise _Refused("unexpected end of input")
                    plain = _PLAIN_LITERAL.match(self.s, i).end()  # no escape: one step
                    i = plain if plain > i else self.char_end(i)
                if i > opened:
                    seq.append(None)
                i = self.space(i + 1, nested)
            elif c == "[":
                i += 1
                if self.at(i) == "^":
                    i += 1
                last, before = len(seq), 1
                chars = 0
                while self.at(i) != "]":
                    if not self.at(i):
                        raise _Refused("unexpected end of input")
                    i = self.char_end(i)
                    chars += 1
                    if self.at(i) == "-" and self.at(i + 1) != "]":
                        if not self.at(i + 1):
                            raise _Refused("unexpected end of input")
                        i = self.char_end(i + 1)
                if chars:
                    seq.append(None)
                i = self.space(i + 1, nested)
            elif c in "<!":
                i = self.token_end(i + 1 if c == "!" else i)
                last, before = len(seq), 1
                seq.append(None)
                i = self.space(i, nested)
            elif _word(c):
                j = self.name_end(i)
                number = self.symbol(self.s[i:j])
                self.mentioned.setdefault(number, i)
                i = self.space(j, nested)
                last, before = len(seq), 1
                seq.append(number)
            elif c == "(":
                i = self.space(i + 1, True)
                symbols_before = len(self.names) + self.generated
                self.last_id = max(self.last_id, len(self.names) + self.generated)
                self.generated += 1
                sub = self.new_rule(owner)
                self.depth += 1
                if self.depth > NESTING_MAX:
                    raise _Refused(f"groups nested more than {NESTING_MAX} deep (the worker's "
                                   f"parser goes one level deeper on its stack for each: "
                                   f"50,000 crashed it)", start)
                i = self.alternates(i, owner, sub, True)
                self.depth -= 1
                before = max(1, len(self.names) + self.generated - symbols_before)
                last = len(seq)
                seq.append(sub)
                if self.at(i) != ")":
                    raise _Refused("expecting ')'", i)
                i = self.space(i + 1, nested)
            elif c == ".":
                last, before = len(seq), 1
                seq.append(None)
                i = self.space(i + 1, nested)
            elif c in "*+?":
                i = self.space(i + 1, nested)
                repeat(1 if c == "+" else 0, 1 if c == "?" else None, start)
            elif c == "{":
                i = self.space(i + 1, nested)
                if not _digit(self.at(i)):
                    raise _Refused("expecting an int", i)
                j = self.int_end(i)
                lo, hi = self.count(i, j), None
                i = self.space(j, nested)
                if self.at(i) == "}":
                    hi = lo
                    i = self.space(i + 1, nested)
                elif self.at(i) == ",":
                    i = self.space(i + 1, nested)
                    if _digit(self.at(i)):
                        j = self.int_end(i)
                        hi = self.count(i, j)
                        i = self.space(j, nested)
                    if self.at(i) != "}":
                        raise _Refused("expecting '}'", i)
                    i = self.space(i + 1, nested)
                else:
                    raise _Refused("expecting ','", i)
                if lo > REPETITION_THRESHOLD:
                    raise _Refused("number of repetitions exceeds sane defaults, please "
                                   "reduce the number of repetitions")
                if hi is not None and hi > REPETITION_THRESHOLD:
                    hi = None
                repeat(lo, hi, start)
            else:
                break
        return i

    # --- after parsing (parse's check, llama_grammar_init_impl) ----------------------------

    def undefined(self) -> _Refused | None:
        """The first rule referred to (and not taken out again by a ``{0}``) that no rule
        defines, as the check at the end of llama.cpp's ``parse`` finds one."""
        referred = {item for alternatives in self.rules.values() for alt in alternatives
                    for item in alt if item is not None}
        # also one a {0} took out again when a later rule has a higher id: llama.cpp's rule
        # list then holds an empty entry for it ("Undefined rule")
        missing = [(self.mentioned[number], name) for name, number in self.names.items()
                   if number not in self.rules and number in self.mentioned
                   and (number in referred or number <= self.last_id)]
        if not missing:
            return None
        pos, name = min(missing)
        return _Refused(f"Undefined rule identifier '{name}'", pos)

    def left_recursive(self) -> str | None:
        """The named rule in which llama_grammar_detect_left_recursion finds a rule that can
        reach itself before any terminal, or None. As there, a rule "may be empty" only when
        one of its own alternatives has no items (not through the rules it refers to)."""
        in_progress: set[int] = set()
        empty: set[int] = set()
        done: set[int] = set()  # visited and not left-recursive: a second visit finds the same

        def visit(number: int) -> bool:
            if number in in_progress:
                return True
            if number in done:
                return False
            in_progress.add(number)
            alternatives = self.rules.get(number, [])
            if any(not alt for alt in alternatives):
                empty.add(number)
            for alt in alternatives:
                for item in alt:
                    if item is None:
                        break
                    if visit(item):
                        return True
                    if item not in empty:
                        break
            in_progress.discard(number)
            done.add(number)
            return False

        for number in list(self.rules):
            if visit(number):
                return self.owner[number]
        return None


def _where(text: str, pos: int) -> str:
    """Where ``pos`` is, lines ended by CR LF, LF or a lone CR as the parser ends rules."""
    before = text[:pos]
    line = before.count("\n") + before.count("\r") - before.count("\r\n") + 1
    column = pos - max(before.rfind("\n"), before.rfind("\r"))
    shown = re.split(r"[\r\n]", text[pos:pos + 24], maxsplit=1)[0]
    return f" at line {line}, column {column}" + (f" ({shown!r})" if shown else " (its end)")


@functools.lru_cache(maxsize=8)
def read_grammar(text: str) -> tuple[str | None, dict[str, str]]:
    """(:func:`grammar_error` of ``text``, each rule's name -> the text of its alternatives as
    the parser delimited them, for the grammar cost checks; the rules read before an error)."""
    p = _Parser(text)
    try:
        with deep_frames():
            return _refusal(p), p.bodies
    except RecursionError:
        return TOO_DEEP, p.bodies


#: The refusal of a grammar whose rules refer to one another past the frames of this reading.
TOO_DEEP = "rules refer to one another too deep to follow (a chain of many thousands of rules)"


@contextlib.contextmanager
def deep_frames():
    """Python's frame limit raised to :data:`_FRAMES` while a grammar is read (one frame per
    rule followed; Python 3.11 keeps such frames off the C stack)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, _FRAMES))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def _refusal(p: _Parser) -> str | None:
    try:
        p.parse()
        refused = p.undefined()
        if refused is not None:
            raise refused
    except _Refused as e:
        return e.message + ("" if e.pos is None else _where(p.s, e.pos))
    if not p.rules:
        return "the grammar has no rules"
    if "root" not in p.names:
        return "grammar does not contain a 'root' symbol"
    rule = p.left_recursive()
    if rule is not None:
        return f"unsupported grammar, left recursion detected in rule '{rule}'"
    return None


def grammar_error(text: str) -> str | None:
    """Why the pinned llama-server would refuse the GBNF ``text``, in its parser's words with a
    line and column (1-based), or None when it would load it. The reasons, in the order the
    worker checks them: a syntax error, an ``Undefined rule identifier``, no rules at all,
    no ``root`` rule, left recursion. Also refused here, where the worker crashes or this
    reading cannot follow: groups nested past :data:`NESTING_MAX`, chains of rules past
    Python's frames."""
    return read_grammar(text)[0]
