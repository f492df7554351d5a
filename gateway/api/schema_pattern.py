r"""A JSON Schema ``pattern`` as the regex the pinned llama.cpp's schema converter enforces.

JSON Schema's ``pattern`` is an ECMA-262 regular expression that a string's *value* must
contain (a search, not a full match; JSON Schema Validation 2020-12 §6.3.3). llama.cpp's
converter (common/json-schema-to-grammar.cpp ``_visit_pattern``) writes the pattern's
characters between the string's quotes as they are, so it constrains the JSON *text* of the
string, and it takes only part of the syntax. As sent, that gave (fresh testers' finds):

* invalid JSON: a class or dot that allows a quote, a backslash or a control put it raw
  between the quotes (``[!-/]``, ``[\x00-\x7f]``, ``.``, ``\x22``);
* answers that do not match: ``\\{2}`` wrote ``\\``, which decodes to one backslash;
* no constraint at all: ``\d \w \s``, ``[\s\S]``, and a pattern without both ``^`` and ``$``
  are "any string" with a line in the worker's log only;
* a 500 "Unexpected empty grammar stack" for a class no character can match (``[z-a]``).

:func:`rewrite_pattern` reads the pattern as ECMA-262 does (Annex B, without the ``u``
flag; sets of characters are Unicode code points) and writes each character class, escape,
dot and literal as the set of code points it matches, encoded as a JSON string holds them:
the characters JSON may hold raw as a class, and ``"``, ``\``, the controls and DEL as their
escapes (``\"``, ``\\``, ``\n``, ``\u0001``, …; DEL as ``\u007f`` since llama.cpp's own JSON
grammar leaves it out). A side without its anchor gets "any characters" (the search). The
answer is then valid JSON whose value matches the pattern.

ECMA-262 syntax errors (and a class that matches no character) raise :class:`PatternError`,
which the schema checks answer 400 naming the pattern as sent. What the converter cannot
enforce however written (``\b``, look-arounds, back-references, ``\p{…}``, an anchor inside
the pattern) makes :func:`rewrite_pattern` return None: the caller drops the ``pattern`` and
the string's other keywords still apply.
"""

from __future__ import annotations

import functools
import re

from gateway.api.errors import shown

_MAX = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]


def _norm(ranges) -> Ranges:
    """Sorted, merged (lo, hi) code point ranges, both ends included."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX:
        out.append((nxt, _MAX))
    return tuple(out)


def _minus(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_norm(_complement(a) + b))


def _within(r: Ranges, lo: int, hi: int) -> list[int]:
    """The code points of ``r`` in lo..hi (a small span)."""
    return [c for a, b in r for c in range(max(a, lo), min(b, hi) + 1)]


# ECMA-262 CharacterClassEscape sets (22.2.2.9) and the dot (any but a LineTerminator).
_DIGIT = ((0x30, 0x39),)
_WORD = _norm(((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)))
_SPACE = _norm(((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                (0xFEFF, 0xFEFF)))
_DOT = _complement(_norm(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))))
_ALL = ((0, _MAX),)
_CLASS_ESCAPES = {"d": _DIGIT, "D": _complement(_DIGIT), "w": _WORD, "W": _complement(_WORD),
                  "s": _SPACE, "S": _complement(_SPACE)}
_CONTROL_ESCAPES = {"f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}

#: What a JSON string may not hold raw (RFC 8259 §7: the quote, the backslash, the controls),
#: and DEL, which llama.cpp's JSON string grammar leaves out (PRIMITIVE_RULES ``char``).
_UNSAFE = _norm(((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)))
#: UTF-16 surrogates: no UTF-8 text holds them, so a class never offers them (llama.cpp's
#: grammar decodes their invalid 3-byte forms as these code points).
_SURROGATES = ((0xD800, 0xDFFF),)
#: RFC 8259's two-character escapes, by the code point they stand for.
_SHORT = {0x22: r"\x22", 0x5C: r"\x5C", 0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r"}
#: Characters a literal may hold raw: the converter copies them byte for byte and reads no
#: quantifier into them (an escape or a multi-byte character in a literal takes the whole
#: run under a following quantifier, ``ab\.+`` as ``(ab.)+``, so those are written as classes
#: where a quantifier follows, and as escapes elsewhere).
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !#%&',-/:;<=>@_`~")
#: The converter's group nesting limit (MAX_PATTERN_DEPTH): deeper is "any string".
_DEPTH_MAX = 100
_BRACES = re.compile(r"\{(\d+)(,(\d*))?\}")
_GROUP_NAME = re.compile(r"<([A-Za-z_$][\w$]*)>")
_DIGITS = re.compile(r"[0-9]+")
_OCTAL = re.compile(r"[0-7]{1,3}")


class PatternError(ValueError):
    """An ECMA-262 syntax error in a pattern (or a class no character can match); the
    message names the fault and quotes the pattern."""


class _Unsupported(Exception):
    """A construct llama.cpp's converter cannot enforce, however written."""


def _point(c: int) -> str:
    """Code point ``c`` as the converter's class syntax and Python's ``re`` both read it."""
    if chr(c).isascii() and chr(c).isalnum():
        return chr(c)
    return f"\\x{c:02X}" if c < 0x100 else f"\\u{c:04X}" if c < 0x10000 else f"\\U{c:08X}"


#: A class of one escaped code point, as :func:`_point` writes it.
_ONE_CLASS = re.compile(r"\[\\[xuU]([0-9A-F]+)\]")


def _literal(c: int) -> str:
    """Code point ``c`` (safe in a JSON string) as a literal escape that no quantifier
    follows: the regex escape for ``^$.[]()|{}*+?`` (the converter's
    ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS), else its hex escape."""
    return "\\" + chr(c) if chr(c) in "^$.[]()|{}*+?" else _point(c)


def _class_text(r: Ranges) -> str:
    """The set ``r`` as a positive class. Never a negated one: llama.cpp's grammar decodes
    invalid UTF-8 (lead bytes F5-FF, encoded surrogates) to code points past U+10FFFF or in
    U+D800-DFFF (llama-grammar.cpp ``decode_utf8``), which a negated class takes and a
    positive one does not, and the answer's
    text then held U+FFFD for each (30 of 80 answers under negated classes, demo model)."""
    return "[" + "".join(_point(a) if a == b else
                         _point(a) + ("" if b == a + 1 else "-") + _point(b) for a, b in r) + "]"


def _hex_class(digits: list[int]) -> str:
    """Hex digit values as one hex character or a class of them (``[0-7bef]``)."""
    if len(digits) == 1:
        return f"{digits[0]:x}"
    runs = _norm((ord(f"{d:x}"),) * 2 for d in digits)  # as characters: 9 and a are apart
    return "[" + "".join(chr(a) if a == b else f"{chr(a)}{'' if b == a + 1 else '-'}{chr(b)}"
                         for a, b in runs) + "]"


@functools.lru_cache(maxsize=1024)
def encoded(r: Ranges, source: str) -> str:
    r"""Regex over a JSON string's text that matches exactly one encoded character of the set
    ``r``: a class of what JSON holds raw, ``\\`` plus a short escape, ``\\u00XX`` for the
    other controls and DEL. Raises PatternError when ``r`` is empty (``source``: the
    pattern's text for that item, for the message)."""
    if not r:
        raise PatternError(f"{source} matches no character")
    if not _minus(r, _SURROGATES):
        raise PatternError(f"{source} matches only UTF-16 surrogates, which no JSON text in "
                           f"UTF-8 holds")
    alts = []
    safe = _minus(r, _UNSAFE + _SURROGATES)
    if safe:
        alts.append(_class_text(safe) if len(safe) > 1 or safe[0][0] != safe[0][1]
                    or chr(safe[0][0]) not in _PLAIN else chr(safe[0][0]))
    short = [c for c in sorted(_SHORT) if _within(r, c, c)]
    if short:
        alts.append("\\\\" + (_SHORT[short[0]] if len(short) == 1 and _SHORT[short[0]].isalpha()
                              else "[" + "".join(_SHORT[c] for c in short) + "]"))
    controls = _within(r, 0x00, 0x1F)
    if len(controls) == 32:
        alts.append("\\\\u00[01][0-9a-f]")
    else:
        for high in (0, 1):
            low = [c & 0xF for c in controls if c >> 4 == high and c not in _SHORT]
            if low:
                alts.append(f"\\\\u00{high}" + _hex_class(low))
    if _within(r, 0x7F, 0x7F):
        alts.append("\\\\u007f")
    if len(alts) == 1 and (alts[0].startswith("[") or len(alts[0]) == 1):
        return alts[0]
    return "(?:" + "|".join(alts) + ")"


#: Any characters (what an unanchored side of the search may hold), encoded.
ANY = encoded(_ALL, ".") + "*"


class _Reader:
    """Recursive descent over ECMA-262's Pattern grammar (22.2.1, Annex B.1.2)."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i, self.n, self.depth = pattern, 0, len(pattern), 0
        self.unsupported = False
        # named groups make \k a back-reference (ECMA-262 22.2.1, [+NamedCaptureGroups])
        self.named = "(?<" in pattern.replace("(?<=", "").replace("(?<!", "")
        self.names: set[str] = set()
        self.references: list[str] = []
        self.groups = _capturing_groups(pattern)

    def fail(self, why: str) -> PatternError:
        return PatternError(f"{why} in {shown(self.p)}")

    def _enc(self, r: Ranges, source: str) -> str:
        if self.unsupported:  # the pattern is dropped: what it would be does not matter
            return ""
        try:
            return encoded(r, source)
        except PatternError as e:
            raise self.fail(str(e)) from None

    def disjunction(self, top: bool) -> list[tuple[bool, str, bool]]:
        alts = [self.alternative(top)]
        while self.i < self.n and self.p[self.i] == "|":
            self.i += 1
            alts.append(self.alternative(top))
        return alts

    def alternative(self, top: bool) -> tuple[bool, str, bool]:
        """(starts with ^, the rewritten terms, ends with $) of one alternative."""
        p, terms, start, end = self.p, [], False, False
        while self.i < self.n and p[self.i] not in "|)":
            c = p[self.i]
            if end:  # something after a "$": an anchor inside the pattern
                self.unsupported = True
            if c in "^$":
                self.i += 1
                if self._quantifier():
                    raise self.fail(f"nothing to repeat ({c} followed by a quantifier)")
                if c == "^" and top and not terms and not start:
                    start = True
                elif c == "$" and top:
                    end = True
                else:
                    self.unsupported = True
                continue
            atom = self._atom()
            quant = self._quantifier()
            if atom is None:  # an assertion (\b, \B) or a look-around: not enforceable
                self.unsupported = True
                continue
            if not quant and (m := _ONE_CLASS.fullmatch(atom)):
                atom = _literal(int(m.group(1), 16))  # a literal the cost checks read as one
            terms.append(atom + quant)
        return start, "".join(terms), end

    def _quantifier(self) -> str:
        """The quantifier at the reader (consumed, lazy ``?`` dropped: it does not change
        what matches), or ""."""
        p, i = self.p, self.i
        if i < self.n and p[i] in "*+?":
            q, self.i = p[i], i + 1
        elif i < self.n and p[i] == "{" and (m := _BRACES.match(p, i)):
            q, self.i = m.group(0), m.end()
        else:
            return ""
        if self.i < self.n and p[self.i] == "?":
            self.i += 1
        return q

    def _atom(self) -> str | None:
        p, c = self.p, self.p[self.i]
        if c in "*+?" or (c == "{" and _BRACES.match(p, self.i)):
            raise self.fail(f"nothing to repeat at {shown(p[self.i:self.i + 8])}")
        if c == "(":
            return self._group()
        if c == "[":
            start = self.i
            r = self._class()
            return self._enc(r, p[start:self.i])
        if c == ".":
            self.i += 1
            return self._enc(_DOT, ".")
        if c == "\\":
            start = self.i
            r = self._escape(in_class=False)
            return None if r is None else self._enc(r, p[start:self.i])
        self.i += 1  # a literal (Annex B: "]", "{" and "}" that start no quantifier too)
        return self._enc(_one(ord(c)), c)

    def _group(self) -> str | None:
        p = self.p
        self.i += 1
        look = False
        if p.startswith("?", self.i):
            if p.startswith(("?=", "?!"), self.i):
                look, self.i = True, self.i + 2
            elif p.startswith(("?<=", "?<!"), self.i):
                look, self.i = True, self.i + 3
            elif p.startswith("?:", self.i):
                self.i += 2
            elif (m := _GROUP_NAME.match(p, self.i + 1)):
                if m.group(1) in self.names:
                    raise self.fail(f"duplicate group name {m.group(1)}")
                self.names.add(m.group(1))
                self.i = m.end()  # a named group: a group
            else:
                raise self.fail(f"invalid group at {shown(p[self.i - 1:self.i + 7])}")
        self.depth += 1
        if self.depth >= _DEPTH_MAX:  # the rewrite nests one more level for escapes; the
            raise _Unsupported()      # converter's "too deep" (and no deeper recursion here)
        alts = self.disjunction(top=False)
        if self.i >= self.n or p[self.i] != ")":
            raise self.fail("unterminated group (a ( without its ))")
        self.i += 1
        self.depth -= 1
        return None if look else "(" + "|".join(body for _, body, _ in alts) + ")"

    def _class(self) -> Ranges:
        """A character class's set (the reader after its ``]``)."""
        p = self.p
        self.i += 1
        negate = self.i < self.n and p[self.i] == "^"
        self.i += negate
        members: list[tuple[int, int]] = []
        while True:
            if self.i >= self.n:
                raise self.fail("unterminated character class (a [ without its ])")
            if p[self.i] == "]":
                self.i += 1
                break
            at = self.i
            first = self._class_atom()
            if p.startswith("-", self.i) and self.i + 1 < self.n and p[self.i + 1] != "]":
                self.i += 1
                last = self._class_atom()
                if isinstance(first, int) and isinstance(last, int):
                    if first > last:  # ECMA-262: a SyntaxError
                        raise self.fail(f"range out of order in character class "
                                        f"({p[at:self.i]})")
                    members.append((first, last))
                    continue
                members.extend(_as_ranges(first) + ((0x2D, 0x2D),) + _as_ranges(last))
                continue
            members.extend(_as_ranges(first))
        r = _norm(members)
        return _complement(r) if negate else r

    def _class_atom(self) -> int | Ranges:
        """One class member: a code point, or a class escape's set."""
        p = self.p
        if p[self.i] == "\\":
            if self.i + 1 >= self.n:
                raise self.fail("unterminated character class (a [ without its ])")
            if p[self.i + 1] == "b":  # in a class, \b is the backspace
                self.i += 2
                return 0x08
            r = self._escape(in_class=True)
            if r is None:
                self.unsupported = True
                return ()
            return r[0][0] if len(r) == 1 and r[0][0] == r[0][1] else r
        c = p[self.i]
        self.i += 1
        return ord(c)

    def _escape(self, in_class: bool) -> Ranges | None:
        """The set of the escape at the reader (consumed); None for one the converter cannot
        enforce (\\b, \\B, a back-reference, \\p{…})."""
        p, i = self.p, self.i
        if i + 1 >= self.n:
            raise self.fail("\\ at end of pattern")
        e = p[i + 1]
        self.i = i + 2
        if e in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[e]
        if e in _CONTROL_ESCAPES:
            return _one(_CONTROL_ESCAPES[e])
        if e == "B" and in_class:  # Annex B: an identity escape there
            return _one(0x42)
        if e in "bB":
            return None
        if e in "123456789" and not in_class:
            m = _DIGITS.match(p, i + 1)
            if int(m.group(0)) <= self.groups:
                return None  # a back-reference
            if e in "89":  # Annex B: no such group, an identity escape
                return _one(ord(e))
            # Annex B: no such group, a legacy octal escape (below)
        if e in "pP" and p.startswith("{", self.i):
            return None
        if e == "k" and self.named:  # a named back-reference (only an identity escape
            m = _GROUP_NAME.match(p, self.i)  # in a pattern without named groups)
            if not m:
                raise self.fail("invalid named reference (\\k without <name>)")
            self.i = m.end()
            self.references.append(m.group(1))
            return None
        if e in "xu":
            digits = 2 if e == "x" else 4
            h = p[self.i:self.i + digits]
            if len(h) == digits and all(ch in "0123456789abcdefABCDEF" for ch in h):
                self.i += digits
                c = int(h, 16)
                low = p[self.i + 2:self.i + 6]
                if 0xD800 <= c <= 0xDBFF and p.startswith("\\u", self.i) and len(low) == 4 \
                        and all(ch in "0123456789abcdefABCDEF" for ch in low) \
                        and 0xDC00 <= int(low, 16) <= 0xDFFF:  # a surrogate pair: one character
                    self.i += 6
                    c = 0x10000 + ((c - 0xD800) << 10) + (int(low, 16) - 0xDC00)
                return _one(c)
            return _one(ord(e))  # Annex B: \x, \u without hex digits are the letter
        if e == "c":
            if self.i < self.n and p[self.i].isascii() and p[self.i].isalpha():
                self.i += 1
                return _one(ord(p[self.i - 1]) % 32)
            self.i -= 1  # Annex B: "\c" not before a letter is a backslash
            return _one(0x5C)
        if e in "01234567":  # \0 or (in a class) a legacy octal escape
            m = _OCTAL.match(p, i + 1)
            text = m.group(0)
            if len(text) == 3 and int(text, 8) > 0o377:
                text = text[:2]
            self.i = i + 1 + len(text)
            return _one(int(text, 8))
        return _one(ord(e))  # an identity escape: the character itself


def unescaped_outside_classes(p: str):
    """The characters of regex ``p`` outside escapes and character classes, as ``(index,
    char)`` pairs in order: the ones that can open a group or a quantifier. A class ends at
    its first unescaped ``]`` (ECMA-262: ``[]`` is an empty class)."""
    i, n, in_class = 0, len(p), False
    while i < n:
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            yield i, c
        i += 1


def _capturing_groups(p: str) -> int:
    """How many capturing groups pattern ``p`` has (``(`` not before ``?``, and named ones),
    outside escapes and classes: whether a digit escape is a back-reference (ECMA-262 Annex B)."""
    return sum(1 for i, c in unescaped_outside_classes(p)
               if c == "(" and (not p.startswith("?", i + 1) or _GROUP_NAME.match(p, i + 2)))


def _one(c: int) -> Ranges:
    return ((c, c),)


def _as_ranges(member: int | Ranges) -> Ranges:
    return _one(member) if isinstance(member, int) else member


def rewrite_pattern(pattern: str) -> str | None:
    """``pattern`` (a JSON Schema ``pattern``: ECMA-262, a search in the value) as a regex
    over the string's JSON text, anchored at both ends, that the pinned converter enforces
    (module docstring); None when it has a construct no rewrite makes enforceable. Raises
    PatternError for an ECMA-262 syntax error or a class that matches no character."""
    reader = _Reader(pattern)
    try:
        alts = reader.disjunction(top=True)
    except _Unsupported:
        return None
    if reader.i < reader.n:  # a ")" with no "(" before it
        raise reader.fail(f"unmatched ) at {reader.i}")
    for name in reader.references:
        if name not in reader.names:
            raise reader.fail(f"invalid named reference \\k<{name}> (no such group)")
    if reader.unsupported:
        return None
    parts = [ANY if not (start or body or end) else
             ("" if start else ANY) + body + ("" if end else ANY) for start, body, end in alts]
    return "^" + (parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")") + "$"

