"""Unit tests of gateway.api.gbnf_syntax: the pinned llama-server's grammar refusals, in its
parser's words (src/llama-grammar.cpp), with a place. That the worker refuses exactly these
is checked against a real worker in tests/e2e/test_grammar_checks.py."""

import pytest

from gateway.api.gbnf_syntax import grammar_error


@pytest.mark.parametrize("grammar, says", [
    ('root ::= foo', "Undefined rule identifier 'foo' at line 1, column 10 ('foo')"),
    ('root ::= "a"\nx ::= "b" y', "Undefined rule identifier 'y' at line 2, column 11 ('y')"),
    ('roo ::= "a"', "grammar does not contain a 'root' symbol"),
    ('# only a comment\n', "the grammar has no rules"),
    ('root = "a"', "expecting ::= at line 1, column 6 ('= \"a\"')"),
    ('root ::= ("a"', "expecting ')' at line 1, column 14 (its end)"),
    ('root ::= "a', "unexpected end of input"),
    ('root ::= [a-', "unexpected end of input"),
    ('root ::= *"a"', "expecting preceding item to */+/?/{ at line 1, column 10 ('*\"a\"')"),
    ('root ::= ""*', "expecting preceding item to */+/?/{ at line 1, column 12 ('*')"),
    ('root ::= "a"\nx ::= "b" )', "expecting newline or end at line 2, column 11 (')')"),
    ('root ::= "\\q"', "unknown escape at line 1, column 11 ('\\\\q\"')"),
    ('root ::= "\\x4"', "expecting 2 hex chars at line 1, column 13 ('4\"')"),
    ('root ::= "a"{x}', "expecting an int at line 1, column 14 ('x}')"),
    ('root ::= "a"{1;2}', "expecting ',' at line 1, column 15 (';2}')"),
    ('root ::= "a"{1,2', "expecting '}' at line 1, column 17 (its end)"),
    ('root ::= <[5', "expecting ']' at line 1, column 13 (its end)"),
    ('root ::= <[5]', "expecting '>' at line 1, column 14 (its end)"),
    ('root ::= <[99999999999]>', "parsed token id is too big at line 1, column 12 "
                                 "('99999999999]>')"),
    ('root ::= "a"{2001}', "number of repetitions exceeds sane defaults, please reduce the "
                           "number of repetitions"),
    ('root ::= (("a"){2}){1001}', "number of rules that are going to be repeated multiplied by "
                                  "the new repetition exceeds sane defaults, please reduce the "
                                  "number of repetitions or rule complexity"),
    ('root ::= root "a" | "b"', "unsupported grammar, left recursion detected in rule 'root'"),
    ('root ::= a\na ::= b\nb ::= root', "unsupported grammar, left recursion detected in rule "
                                       "'root'"),
    ('root ::= x root\nx ::= ""', "unsupported grammar, left recursion detected in rule 'root'"),
    ('root ::= ("a" | "")*', "unsupported grammar, left recursion detected in rule 'root'"),
    ('root ::= "a" x{0}\nb ::= "c"', "Undefined rule identifier 'x' at line 1, column 14 "
                                      "('x{0}')"),
    ('root ::= "a"\rx ::= "b" )', "expecting newline or end at line 2, column 11 (')')"),
])
def test_refusals_in_the_parsers_words_with_a_place(grammar, says):
    assert grammar_error(grammar) == says


@pytest.mark.parametrize("grammar", [
    'root ::= "a" | "b"',
    'root ::= (\n  "a"\n  | "b"  # a comment\n)\n',
    'root ::= "a" { 2 , 3 } [a-z]{1,5} "x"{3,} "y"? .*',
    'root ::= <[5]> !<[6]> <hello> .',  # <text> tokens need the vocabulary: the worker's
    'root ::= "a"\r\nroot ::= "b"',     # a rule defined again replaces the first
    'root ::= "a"{0,99999}',            # past 2,000 a maximum is read as none
    'root ::= (("a"){2}){1000}',
    'root ::= -{0}',                    # {0} takes the reference out: nothing undefined
    'root ::= ("a"?)*',                 # its group's one alternative is not empty itself
    'root ::= b root | "x"\nb ::= c\nc ::= ""',  # the same: "may be empty" is not transitive
    'root ::= "a"\0 garbage after a NUL, which ends the C string',
    'root ::= [-a\\]-]',
    'root ::= [az-a] [^z-a]',           # reversed ranges: the class still matches something
    'root ::= "a"\rx ::= "b"',          # a lone CR ends a rule
])
def test_grammars_the_worker_loads_pass(grammar):
    assert grammar_error(grammar) is None


def test_deep_groups_and_long_rule_chains():
    """50,000 nested groups crashed the worker (signal 11, each worker in turn as the request
    was retried); it loads 10,000. Past NESTING_MAX they are refused; a chain of 1,500 rules,
    which the worker loads, was a 500 RecursionError (both a later tester's finds)."""
    assert grammar_error("root ::= " + "(" * 5000 + '"a"' + ")" * 5000) is None
    assert grammar_error("root ::= " + "(" * 50000 + '"a"' + ")" * 50000).startswith(
        "groups nested more than 5000 deep")
    chain = "root ::= r0\n" + "".join(f"r{k} ::= r{k + 1}\n" for k in range(1500))
    assert grammar_error(chain + 'r1500 ::= "a"') is None
    assert grammar_error(chain + 'r1500 ::= root "a"') == \
        "unsupported grammar, left recursion detected in rule 'root'"
    from gateway.api.grammar_checks import check_grammar  # the cost walk follows it too
    check_grammar(chain + 'r1500 ::= "a"', "grammar")


def test_a_reference_taken_out_by_zero_repetitions_is_undefined_when_a_later_rule_exists():
    """llama.cpp still numbers the name ``x{0}`` removes; when a rule with a higher number
    exists its entry is empty and the worker refuses ("Undefined rule"); alone it loads
    (a later tester's find: those passed to the worker's bare message)."""
    assert grammar_error('root ::= "a" x{0}\nb ::= "c"').startswith(
        "Undefined rule identifier 'x'")
    assert grammar_error('root ::= "a" x{0} "b"?').startswith("Undefined rule identifier 'x'")
    assert grammar_error('root ::= "a" x{0}') is None


def test_lines_ended_by_a_lone_cr_are_counted():
    assert grammar_error('root ::= "a"\rx ::= "b" )') == \
        "expecting newline or end at line 2, column 11 (')')"
