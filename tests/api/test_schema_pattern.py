r"""gateway.api.schema_pattern: a JSON Schema pattern (ECMA-262, a search in the value) as a
regex over the string's JSON text that the pinned llama.cpp converter enforces.

The rewrite is checked against its meaning with Python's ``re``: for each pattern, with a
Python regex of the same ECMA-262 meaning written by hand, (1) the JSON encoding of a value
matches the rewrite exactly when the value matches the pattern, and (2) every JSON text the
rewrite matches is valid JSON whose value matches the pattern. Then (3) each escape in a
rewrite is one the converter reads (common/json-schema-to-grammar.cpp ``gbnf_escape_length``
and ``ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS``), so it never falls back to "any string"."""

import json
import random
import re

import pytest

from gateway.api.schema_pattern import ANY, PatternError, rewrite_pattern, unescaped_outside_classes

#: ECMA-262's \s and its complement, for the hand-written Python regexes (Python's own \s
#: also takes \x1c-\x1f and \x85).
ES_S = "\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
#: ECMA-262's dot: any character but a line terminator.
ES_DOT = "[^\n\r\u2028\u2029]"

#: (pattern, a Python regex with the same meaning searched in the value, extra characters
#: the random values are drawn from). The first rows are fresh testers' finds.
CASES = [
    (r"^[\s\S]{4,8}$", r"^[\s\S]{4,8}\Z", ""),
    (r"^[\W]{3,6}$", r"^[^0-9A-Za-z_]{3,6}\Z", ""),
    (r"^[\d\W]{3,5}$", r"^[^A-Za-z_]{3,5}\Z", ""),
    (r"^[!-/]{4,8}$", r"^[!-/]{4,8}\Z", "!#$%&'()*+,./"),
    (r"^[\x00-\x7f]{4,8}$", r"^[\x00-\x7f]{4,8}\Z", ""),
    (r"^\x22{2}$", r'^"{2}\Z', '""""'),
    (r"^\u0022+$", r'^"+\Z', '""""'),
    (r"^\\{2}$", r"^\\{2}\Z", "\\\\\\"),
    (r'^a"b$', r'^a"b\Z', 'ab"'),
    (r"^\s?x$", "^[" + ES_S + r"]?x\Z", "xxx"),
    (r"^\S+\s\D$", "^[^" + ES_S + "]+[" + ES_S + r"][^0-9]\Z", ""),
    ("^.{5}$", "^" + ES_DOT + r"{5}\Z", ""),
    ("^[^a]+$", r"^[^a]+\Z", ""),
    (r"^\d{4}$", r"^[0-9]{4}\Z", "0123456789"),
    (r"^\d{4}-\d{2}$", r"^[0-9]{4}-[0-9]{2}\Z", "0123456789-"),
    (r"^[\w.-]+@[\w-]+\.\w{2,}$", r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_-]+\.[A-Za-z0-9_]{2,}\Z",
     "ab.-@_9"),
    ("[0-9]{3}", "[0-9]{3}", "0123456789"), ("abc$", r"abc\Z", "abc"), ("^ab", "^ab", "ab"),
    ("", "", ""), ("^$", r"^\Z", ""), (r"^a\$", r"^a\$", "a$"),
    ("^a|b$", r"^a|b\Z", "ab"), ("^a$|^bc$", r"^a\Z|^bc\Z", "abc"),
    (r"^[\]\d]$", r"^[\]0-9]\Z", "]1"), (r"^[\d-z]+$", r"^[0-9z-]+\Z", "5z-"),
    ("^[^]{2}$", r"^[\s\S]{2}\Z", ""), ("^(?:ab|c){2}$", r"^(?:ab|c){2}\Z", "abc"),
    ("^(?<y>[0-9]{2})x$", r"^([0-9]{2})x\Z", "12x"), ("^a{2$", r"^a\{2\Z", "a{2"),
    ("^a{2,}?b$", r"^a{2,}b\Z", "aab"), (r"^[\b]$", r"^\x08\Z", "\b"),
    (r"^\cJ\t$", r"^\n\t\Z", "\n\t"), (r"^[\101-\103]+$", r"^[A-C]+\Z", "ABCD"),
    ("^[[:alpha:]]{2}$", r"^[\[:alph]\]{2}\Z", "[:alph]]"),  # ECMA-262: no POSIX classes
    ("^\u00e9\U0001F600+$", "^\u00e9\U0001F600+\\Z", "\u00e9\U0001F600"),
    (r"^[\u2028-\u2029 ]+$", r"^[\u2028\u2029 ]+\Z", "\u2028 "),
    # a surrogate pair escape is its character (an empty string before; a fresh tester's find)
    (r"^\ud83d\ude00{2}$", "^\U0001F600{2}\\Z", "\U0001F600"),
    (r"^[\ud83d\ude00a]+$", "^[\U0001F600a]+\\Z", "\U0001F600a"),
    (r"^a\k$", r"^ak\Z", "ak"),
    # Annex B: a digit escape past the groups' count is octal, or 8/9 themselves (dropped as
    # back-references before; a fresh tester's find)
    (r"^\8\101$", r"^8A\Z", "8A"), (r"^(a)\2$", r"^(a)\x02\Z", "a\x02"),  # Annex B: without named groups, \k is the letter
]

#: What random values are drawn from, besides a case's own characters: the quote, the
#: backslash, controls (short escapes and not), DEL, line terminators, spaces and others.
ALPHABET = 'aZz09_-! /."\\\n\t\r\x01\x08\x0b\x1f\x7f\xa0\u2028\u00e9\U0001F600x{}'

#: What random JSON texts are drawn from: escapes' parts and raw characters.
TEXT = 'aZ09_-!/. "\\\\ntbu00001f7\x01\x7f\u2028\u00e9x{}'


def encode(v: str) -> str:
    """A value as the rewrite's grammar writes it between the quotes (DEL escaped, as
    llama.cpp's JSON grammar leaves it out raw)."""
    return json.dumps(v, ensure_ascii=False)[1:-1].replace("\x7f", "\\u007f")


@pytest.mark.parametrize("pattern, meaning, extra", CASES)
def test_an_encoded_value_matches_the_rewrite_exactly_when_the_value_matches(pattern, meaning,
                                                                            extra):
    sent = rewrite_pattern(pattern)
    rng = random.Random(pattern)
    matched = 0
    for k in range(4000):  # every other value from the case's own characters, if it has any
        chars = extra if extra and k % 2 else ALPHABET + extra
        v = "".join(rng.choice(chars) for _ in range(rng.randint(0, 9)))
        want = re.search(meaning, v) is not None
        matched += want
        assert (re.fullmatch(sent, encode(v)) is not None) == want, (v, encode(v), sent)
    assert matched, "no random value matched: the case checks nothing"


@pytest.mark.parametrize("pattern, meaning, extra", CASES)
def test_every_text_the_rewrite_matches_is_json_whose_value_matches(pattern, meaning, extra):
    sent = rewrite_pattern(pattern)
    rng = random.Random(pattern)
    chars = TEXT + encode(extra) * 2
    for _ in range(3000):
        t = "".join(rng.choice(chars) for _ in range(rng.randint(0, 14)))
        if re.fullmatch(sent, t):
            v = json.loads('"' + t + '"')
            assert re.search(meaning, v), (t, v, sent)


#: Escapes the converter reads: in a class (gbnf_escape_length) and in a literal (also
#: ESCAPED_IN_REGEXPS_BUT_NOT_IN_LITERALS); anything else made it take the pattern as any
#: string.
GBNF_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[trn\\\"\[\]-])")
LITERAL_ESCAPE = re.compile(r"\\[\^$.\[\]()|{}*+?]")


@pytest.mark.parametrize("pattern", [c[0] for c in CASES])
def test_rewrites_use_only_escapes_the_converter_reads(pattern):
    sent = rewrite_pattern(pattern)
    i = 0
    while i < len(sent):
        if sent[i] == "\\":
            m = GBNF_ESCAPE.match(sent, i) or LITERAL_ESCAPE.match(sent, i)
            assert m, (sent, sent[i:i + 6])
            i = m.end()
        else:
            assert sent[i].isascii() and sent[i].isprintable(), (sent, i)  # no raw byte runs
            i += 1
    assert sent.startswith("^") and sent.endswith("$")


def test_literals_with_escapes_are_classes_so_a_quantifier_takes_one_character():
    r"""The converter reads an escape into a literal run without looking at what follows,
    so ``ab\.+`` was ``(ab.)+``; a class is one item."""
    assert rewrite_pattern(r"^ab\.+$") == r"^ab[\x2E]+$"
    assert rewrite_pattern("^\u00e9+$") == r"^[\xE9]+$"


def test_unanchored_sides_get_any_characters():
    assert rewrite_pattern("x") == "^" + ANY + "x" + ANY + "$"
    assert rewrite_pattern("") == "^" + ANY + "$"


@pytest.mark.parametrize("pattern", [
    r"^\bx$", r"^x\B", r"^(a)\1$", r"^(?<n>a)\1$", "^(?=a)a$", "^(?!a).$", "^(?<=a)b", "^(?<!a)b",
    r"^\p{L}+$", r"^[\P{L}]$", r"^(?<n>a)\k<n>$", "^a$b", "a^b", "^(^a)$", "(" * 100 + ")" * 100,
    "(" * 5000 + ")" * 5000,  # past Python's recursion limit (a 500 RecursionError if recursed)
])
def test_constructs_the_converter_cannot_enforce_give_none(pattern):
    assert rewrite_pattern(pattern) is None


@pytest.mark.parametrize("pattern, says", [
    ("^[z-a]$", 'range out of order in character class (z-a) in "^[z-a]$"'),
    (r"[\x7f-\x00]", r'range out of order in character class (\x7f-\x00) in'),
    ("[]", 'matches no character'), (r"[^\s\S]", 'matches no character'),
    ("a\\", '\\ at end of pattern'), ("[a", 'unterminated character class (a [ without its ])'),
    ("(a", "unterminated group"), ("a)", "unmatched ) at 1"), ("*a", "nothing to repeat"),
    ("a|+", "nothing to repeat"), ("(?:)*?{2}", "nothing to repeat"), ("^*", "nothing to repeat"),
    ("(?x)", "invalid group"),
    (r"^\ud83d$", "matches only UTF-16 surrogates"), (r"[\ud800-\udfff]", "matches only UTF-16"),
    ("(?<a>x)(?<a>y)", "duplicate group name a"),
    (r"(?<n>a)\k<nope>", r"invalid named reference \k<nope> (no such group)"),
    (r"(?<n>a)\k", "invalid named reference"),
])
def test_ecma_syntax_errors_raise_naming_the_pattern(pattern, says):
    with pytest.raises(PatternError) as e:
        rewrite_pattern(pattern)
    assert says in str(e.value)
    assert str(e.value).endswith(json.dumps(pattern)[:40])


def _sets():
    """Character sets of classes and escapes a rewrite writes, as the reader builds them."""
    from gateway.api import schema_pattern as sp
    return [sp._DOT, sp._ALL, sp._SPACE, sp._complement(sp._SPACE), sp._complement(sp._WORD),
            sp._norm(((0, 0x7F),)), sp._norm(((0x01, 0x07), (0x0B, 0x0B), (0x1E, 0x22))),
            sp._norm(((0x09, 0x09), (0x0E, 0x0E), (0x19, 0x19), (0x5C, 0x5C), (0x7F, 0x7F))),
            sp._norm(((0x21, 0x2F), (0x80, 0x80), (0x2028, 0x2028), (0x10FFFF, 0x10FFFF)))]


@pytest.mark.parametrize("k", range(9))
def test_one_encoded_character_is_exactly_a_member_of_its_set(k):
    """Every two- and six-character escape (any printable ASCII after ``\\`` or ``\\u00``) and
    every character up to U+3000 and past the BMP's end: the encoding of one character matches
    exactly when it is JSON for a member of the set (``\\u001:`` once slipped through a hex
    class written 0-f)."""
    from gateway.api.schema_pattern import encoded
    r = _sets()[k]
    rx = re.compile(encoded(r, "x"))
    members = {c for lo, hi in r for c in range(lo, min(hi, 0x3000) + 1)} | \
        {c for lo, hi in r for c in range(max(lo, 0xFFF0), hi + 1)}
    printable = [chr(c) for c in range(0x20, 0x7F)]
    texts = ["\\" + a for a in printable] + ["\\u00" + a + b for a in printable for b in printable]
    texts += [chr(c) for c in list(range(0x3001)) + list(range(0xFFF0, 0x10000))
              + list(range(0x10FFF0, 0x110000)) if not 0xD800 <= c <= 0xDFFF]
    for t in texts:
        if rx.fullmatch(t):
            v = json.loads('"' + t + '"')
            assert len(v) == 1 and ord(v) in members, (t, v)
    for c in members:
        if not 0xD800 <= c <= 0xDFFF:
            assert rx.fullmatch(encode(chr(c))), hex(c)


@pytest.mark.parametrize("pattern, outside", [
    ("a(b)", "a(b)"),
    (r"\((x)", "(x)"),            # an escaped parenthesis is a literal, not a group
    (r"[(]{2}(", "{2}("),         # a class holds its "(" and ends at its first "]"
    (r"[\]{]x{3}", "x{3}"),       # an escaped "]" does not end the class
    (r"[]{1}", "{1}"),            # "[]" is an empty class (ECMA-262), not a class holding "]"
    ("\\", ""),                   # a lone backslash at the end yields nothing
])
def test_the_scan_skips_escapes_and_classes(pattern, outside):
    pairs = list(unescaped_outside_classes(pattern))
    assert "".join(c for _, c in pairs) == outside
    assert all(pattern[i] == c for i, c in pairs)
