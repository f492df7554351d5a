"""gateway.api.grammar_checks: schemas and grammars that would freeze the pinned llama-server
are refused with 400; everything else passes to the worker unchanged."""

import pytest

from gateway.api.errors import ApiError
from gateway.api.schema_pattern import rewrite_pattern
from gateway.api.gbnf_syntax import grammar_error
from gateway.api.grammar_checks import (COUNT_MAX, NESTED_POSITIONS_MAX, REPEATED_EMPTY_MAX,
                                         check_grammar, grammar_costs, regex_costs,
                                         check_schema, check_tools, grammar_nested_cost,
                                         regex_nested_cost)


@pytest.mark.parametrize("schema, says", [
    ({"type": "array", "minItems": 5, "maxItems": 2}, "format: minItems (5) is greater than maxItems (2)"),
    ({"type": "string", "minLength": 3, "maxLength": 1}, "format: minLength (3) is greater than maxLength (1)"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
      "minLength": 9, "maxLength": 8}}}}, "format.properties.tags.items: minLength (9)"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "minItems": 2, "maxItems": 1}]},
     "format.anyOf[1]: minItems (2)"),
    ({"$defs": {"a": {"type": "array", "minItems": 3, "maxItems": 0}}, "$ref": "#/$defs/a"},
     "format.$defs.a: minItems (3)"),
    ({"type": "array", "minItems": 5, "maxItems": 2**32 + 1},
     f"maxItems must be a whole number from 0 to {COUNT_MAX}, got 4294967297"),
    # read as a C int by the worker: -4294967291 is 5 there (a fresh tester's find)
    ({"type": "array", "minItems": -4294967291, "maxItems": 2}, "minItems must be a whole number"),
    ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum (10) and maximum (1) leave no number"),
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 5}, "exclusiveMinimum (5)"),
    ({"type": "number", "minimum": 5, "exclusiveMaximum": 5}, "minimum (5) and exclusiveMaximum (5)"),
    # a fresh tester's ways past the first check: an empty integer range (the worker's 500),
    # a regex repetition in a pattern, schemas under properties named like data keywords
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 6}, "leave no integer"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "leave no integer"),
    ({"type": "string", "pattern": "^x{5,2}$"}, "format.pattern: repetition {5,2} has its maximum"),
    ({"type": "string", "pattern": "(ab){ 3 , 1 }"}, "format.pattern: repetition { 3 , 1 }"),
    ({"type": "object", "properties": {"enum": {"type": "array", "minItems": 5, "maxItems": 2}}},
     "format.properties.enum: minItems (5)"),
    ({"type": "object", "properties": {"default": {"type": "string", "minLength": 9,
                                                   "maxLength": 1}}},
     "format.properties.default: minLength (9)"),
    ({"type": "array", "items": [{"type": "string"}, {"type": "array", "minItems": 2,
                                                      "maxItems": 1}]}, "format.items[1]: minItems"),
    ({"enum": [f"v{i}" for i in range(4096)]}, "more than 4096 schema nodes and enum/const"),
    ({"anyOf": [{"enum": list(range(3000))}, {"enum": list(range(1097))}]}, "more than 4096"),
    ({"anyOf": [{"const": i} for i in range(3000)]}, "more than 4096"),  # consts count too
    ({"type": ["string", "integer"], "enum": list(range(2100))}, "more than 4096"),  # copied
    # $ref is followed wherever it points, as the worker follows it (a fresh tester's find)
    ({"properties": {"a": {"$ref": "#/x-bad"}}, "x-bad": {"type": "array", "minItems": 5,
                                                          "maxItems": 2}},
     "format.x-bad: minItems (5)"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a", "minLength": 3,
                                           "maxLength": 1}}}, "format.$defs.a: minLength (3)"),
    # std::stoi reads "2x", "+2" and "2.5" as 2
    ({"type": "string", "pattern": "^a{5,2x}$"}, "format.pattern: repetition {5,2x}"),
    ({"type": "string", "pattern": "^a{5,+2}$"}, "format.pattern: repetition {5,+2}"),
    ({"pattern": "^a{5,2.5}$"}, "format.pattern: repetition {5,2.5}"),
])
def test_unsatisfiable_bounds_are_400_naming_where(schema, says):
    with pytest.raises(ApiError) as e:
        check_schema(schema, "format")
    assert e.value.status == 400 and says in e.value.message, e.value.message


@pytest.mark.parametrize("schema", [
    {"type": "array", "minItems": 2, "maxItems": 2},
    {"type": "string", "minLength": 0, "maxLength": 5000},
    {"type": "integer", "minimum": 1, "maximum": 1},
    {"type": "integer", "minimum": 1, "exclusiveMaximum": 2},
    {"type": "object", "properties": {"minItems": {"type": "integer"}, "maxItems": {"type": "integer"}}},
    {"enum": [{"minItems": 5, "maxItems": 2}], "default": {"minLength": 3, "maxLength": 1}},
    {"type": "array", "minItems": True, "maxItems": 0},  # not counts: the worker's own 400
    {"type": "string", "minLength": "3", "maxLength": 1},
    # no schema the worker builds a grammar from: `not`, annotations, data (a tester's find)
    {"type": "integer", "not": {"minimum": 10, "maximum": 1}},
    {"type": "string", "x-note": {"minLength": 3, "maxLength": 1}},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 7},  # 6
    {"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 6},
    {"type": "string", "pattern": "^[{5,2}]\\{5,2}x{2,5}$"},  # a class, an escape, a good one
    {"enum": [f"v{i}" for i in range(4095)]},
    # keys the worker does not read for that type, or at all; unreferenced $defs (a tester's)
    {"type": "string", "minItems": 5, "maxItems": 2},
    {"type": "string", "minimum": 5, "maximum": 1},
    {"type": "array", "minContains": 3, "maxContains": 1},
    {"minProperties": 3, "maxProperties": 1},
    {"type": "object", "$defs": {"unused": {"type": "array", "minItems": 5, "maxItems": 2}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # a cycle ends
    {"$ref": "#/nowhere"},  # the worker's own error
])
def test_satisfiable_or_other_schemas_pass(schema):
    check_schema(schema, "format")


@pytest.mark.parametrize("pattern, cost", [
    # a fresh tester's find: 400 x 400 froze the worker and, retried, the next one
    ("^(a{0,600}){0,600}$", 360_000),
    ("^(a{0,10}b?){0,100}$", 1_100),       # 7.8 s for 6 tokens on the demo model
    ("^((a{0,10}){0,10}){0,10}$", 1_000),  # three levels
    ("^(a{2,4}){0,600}$", 0),  # cannot be empty: 3 ms per token
    ("^(ab|a{0,100}){0,100}$", 10_200),    # one alternative without a fixed end
    ("^(?:a{0,30}){0,30}$", 900),          # a non-capturing group is a group too
    ("(a{0,20}){0,20}", 400),              # counted, and let through (0.11 s)
    # varying repetitions in a row add up (this session's tester: 20 in a row, 22.7 s for 64
    # tokens; ten nested groups of 480 positions in a row wedged the worker)
    ("^" + "[a-z]{0,100}" * 20 + "[a-z]{300}$", 2_000),
    ("^" + "(a{0,20}){0,24}" * 10 + "a{100}$", 4_800),
    ("^" + "(a{0,20}){0,24}" * 3 + "a{100}$", 1_440),  # 52.7 s for 32 tokens
    ("^a{0,600}a{0,600}$", 1_200),
    # an e-mail: the "@" and "." that must be there end each run (380 before)
    (r"^[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9.-]{1,253}\.[a-zA-Z]{2,63}$", 0),
    (r"^[A-Za-z]{0,30}\s?[A-Za-z]{0,30}$", 61),
    # a repeated part that cannot be empty is not multiplied: ([a-z]+ " "?){1,20} 2 ms per
    # token, (a{2,4}){0,600} 3 ms, (a{1,100}){1,100} 9 ms on the pinned worker
    ("^([a-z]+ ?){1,20}$", 2),  # the two varying items inside add up
])
def test_nested_repetitions_of_undelimited_groups_are_counted(pattern, cost):
    assert regex_nested_cost(pattern)[0] == cost
    if cost > NESTED_POSITIONS_MAX:
        with pytest.raises(ApiError) as e:
            check_schema({"type": "string", "pattern": pattern}, "format")
        assert e.value.status == 400 and e.value.message.startswith(
            "format.pattern: the repetitions ") and f"about {cost} positions" in \
            e.value.message, e.value.message
    else:
        check_schema({"type": "string", "pattern": pattern}, "format")


@pytest.mark.parametrize("pattern", [
    r"^(\w{1,50} ){0,100}$",   # each word ends at its space: one live position (0.07 s)
    "^(a{600}){0,600}$",       # a fixed count inside
    "^(a{0,600})*$",            # unbounded: one recursive rule
    "^a{0,600}b{0,600}$",       # two different literals cannot trade characters
    r"^((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$",
    r"^(?:[a-f0-9]{2}:){5}[a-f0-9]{2}$",
    "^[(a{0,600}){0,600}]$",    # a character class, not a group
    r"^\(a{0,600}\){0,600}$",  # escaped parentheses
])
def test_delimited_or_flat_repetitions_are_not_counted(pattern):
    assert regex_nested_cost(pattern) == (0, "")
    check_schema({"type": "string", "pattern": pattern}, "format")


@pytest.mark.parametrize("grammar, cost", [
    ('root ::= ("a"{0,600}){0,600}', 360_000),
    ('root ::= x{0,600}\nx ::= "a"{0,600}', 360_000),          # through a rule reference
    ('root ::= (w){0,600}\nw ::= x\nx ::= "a"{0,600}', 360_000),  # two references deep
    ('root ::= item{0,100}\nitem ::= "a"{0,10} "b"?', 1_100),
    ('root ::= ("a" "a"{0,5}){0,600}', 0),  # cannot be empty: 2 ms per token
    ('root ::= ( "a"{0, # c\n 600} ){0,600}', 360_000),  # a comment in the braces
    ('root ::= x{0,600}\nx ::= [a-z]{1,50} " "', 0),        # each ends at its space
    ('root ::= "[" (v ("," v){0,1000})? "]"\nv ::= [0-9]+', 0),  # each starts with ",", which ends the run
    ('root ::= r\nr ::= "a" r | ""', 0),                     # recursion counts once
    ('root ::= "a"{0,600} "b"{0,600}', 0),  # different literals
    ('root ::= ' + "x " * 20 + '[^z]{300}\nx ::= [^z]{0,100}', 2_000),  # in a row, by reference
    ('root ::= row ("\\n" row){0,20}\nrow ::= [a-z]+ ("," [a-z]+){0,10}', 0),  # CSV rows: each row after the first starts with "\n"
])
def test_grammar_nested_repetitions_are_counted(grammar, cost):
    assert grammar_nested_cost(grammar)[0] == cost
    refused = grammar_error(grammar)  # the worker's own parser refuses some: its words first
    if refused is not None:
        with pytest.raises(ApiError) as e:
            check_grammar(grammar, "grammar")
        assert (e.value.status, e.value.message) == (400, f"grammar: {refused}")
    elif cost > NESTED_POSITIONS_MAX:
        with pytest.raises(ApiError) as e:
            check_grammar(grammar, "grammar")
        assert e.value.status == 400 and e.value.message.startswith(
            "grammar: the repetitions ") and f"about {cost} positions" in e.value.message
    else:
        check_grammar(grammar, "grammar")


@pytest.mark.parametrize("grammar, bad", [
    ('root ::= "a"{5,2}', True),
    ('root ::= [a-z]{ 3 , 1 }', True),
    ('root ::= x{2,5}\nx ::= "y"', False),
    ('root ::= "a"{3}', False),
    ('root ::= "a"{3,}', False),
    ('root ::= "{5,2}"', False),       # inside a literal
    ('root ::= ["{5,2}"] "b"', False),  # inside a class
    ('root ::= "\\"{5,2}" "b"', False),  # an escaped quote does not end the literal
    ('# {5,2} in a comment\nroot ::= "a"', False),
    ('# c\rroot ::= "a"{5,1}', True),  # llama.cpp ends a comment at \r too
    ('root ::= ("a"{5,#c\n1})', True),  # and skips comments inside the braces
    ('root ::= ("a"{#c\n5,1})', True),
    ('root ::= ( "a"{5, # }\n 2} )', True),  # a } inside a comment in the braces
])
def test_grammar_repetitions_with_max_below_min_are_400(grammar, bad):
    if bad:
        with pytest.raises(ApiError) as e:
            check_grammar(grammar, "grammar")
        assert e.value.status == 400 and "has its maximum below its minimum" in e.value.message
    else:
        check_grammar(grammar, "grammar")
    check_grammar(None, "grammar")  # absent: nothing to check


def test_tool_parameters_are_checked():
    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "minItems": 4, "maxItems": 3}}}}}
    check_tools([good])
    check_tools("not a list")
    with pytest.raises(ApiError) as e:
        check_tools([good, bad])
    assert "tools[1].function.parameters.properties.xs: minItems (4)" in e.value.message


@pytest.mark.parametrize("schema,msg", [
    ({"type": "string", "minLength": 3000},
     "format: minLength 3000 is more repetitions than the worker's grammar takes (at most 2000)"),
    ({"type": "array", "minItems": 2002},
     "format: minItems 2002 is more repetitions than the worker's grammar takes (at most 2001)"),
    ({"type": "string", "pattern": "^a{2001}$"},
     "format.pattern: repetition {2001} repeats more times than the worker's grammar takes "
     "(at most 2000)"),
    ({"type": "string", "pattern": "^[0-9]{3000,}$"},
     "format.pattern: repetition {3000,} repeats more times than the worker's grammar takes "
     "(at most 2000)")])
def test_repetition_minimum_past_llama_cpps_threshold_is_400(schema, msg):
    """llama.cpp's grammar parser refuses a repetition minimum above 2,000
    (MAX_REPETITION_THRESHOLD), which llama-server answered with a bare "failed to parse
    grammar"; the limits themselves and larger maximums (read as unbounded) pass."""
    with pytest.raises(ApiError) as e:
        check_schema(schema, "format")
    assert e.value.status == 400 and e.value.message == msg
    for ok in ({"type": "string", "minLength": 2000, "maxLength": 10000},
               {"type": "array", "minItems": 2001}, {"type": "string", "pattern": "^a{2000}b{0,5000}$"}):
        check_schema(ok, "format")


def test_grammar_repetition_minimum_past_threshold_is_400():
    with pytest.raises(ApiError, match=r"grammar: repetition \{2001,\} repeats more times"):
        check_grammar('root ::= "a"{2001,}', "grammar")
    check_grammar('root ::= "a"{2000} "b"{0,9000}', "grammar")


@pytest.mark.parametrize("pattern,branch", [
    # a fresh tester's finds: (a?){0,400} was under 500 positions and wedged both workers
    ("^(a?){0,400}$", 400), ("^(a|){0,2000}$", 2000), ("^(a|b?){0,60}$", 120),
    ("^((a?){0,16}){0,16}$", 256),          # more than 1.9 s per token
    ("^((a{0,5}){0,10}){0,10}$", 100),      # 500 positions, 1.2 s per token
    ("^(a?){0,60}(a?){0,60}$", 120),        # in a row, they add up
    # at most 64 pass: (a?){0,60} took 20 ms per token, (a?){0,64} 26 ms
    ("^(a?){0,60}$", 60), ("^(a?b?){0,30}$", 60), ("^(a?){0,60}b(a?){0,60}$", 60),
    ("^(a{0,20}){0,20}$", 20), (r"^(\s*[a-z]*\s*,?){0,10}$", 40),
    ("^(a?)*$", 0),                          # unbounded: one recursive rule, 2 ms per token
    ("^" + "a?" * 150 + "$", 150), ("^(a{0,3}){150,}$", 151), ("^(a?){150}$", 150),
    (r"^(\+\d{1,3})?\s?\(?\d{3}\)?[\s.-]?\d{3}[\s.-]?\d{4}$", 2),  # a phone number
    # alternating optional characters: a run of "a" can go in any a? (a fourth tester's find:
    # 100 times 0.92 s per token, 300 times wedged the worker)
    ("^" + "a?b?" * 100 + "$", 100), ("^" + "a?b?c?" * 40 + "$", 40),
    ("^" + "a?b?" * 100 + "[ab]{60}$", 100), ("^" + "a?b?" * 32 + "[ab]{60}$", 32),
    (r"^([a-z]+ ?){1,20}$", 0), (r"^(\w{1,50} ){0,100}$", 0),
])
def test_repetitions_of_a_part_that_can_be_empty_are_counted(pattern, branch):
    assert regex_costs(pattern)[1][0] == branch
    positions = regex_costs(pattern)[0][0]
    if branch > REPEATED_EMPTY_MAX and positions <= NESTED_POSITIONS_MAX:
        with pytest.raises(ApiError) as e:
            check_schema({"type": "string", "pattern": pattern}, "format")
        assert e.value.status == 400 and e.value.message.startswith(
            "format.pattern: the repetitions ") and "repeat a part that can be empty, so each " \
            f"character could go in about {branch} places" in e.value.message, e.value.message
    elif positions <= NESTED_POSITIONS_MAX:
        check_schema({"type": "string", "pattern": pattern}, "format")


@pytest.mark.parametrize("grammar,branch", [
    ('root ::= x{0,600}\nx ::= "a" | ""', 600),  # the tester's: not counted at all before
    ('root ::= x{0,300}\nx ::= "a" |', 300),     # an empty alternative
    ('root ::= x{0,100}\nx ::= "a"?', 100),
    ('root ::= x{0,16}\nx ::= y{0,16}\ny ::= "a"?', 256),
    ('root ::= x{0,60}\nx ::= "a" | ""', 60), ('root ::= x*\nx ::= "a"?', 0),
    ('root ::= r\nr ::= "a" r | ""', 0),
    ('root ::= "{" space (kv ("," space kv)*)? "}"\nkv ::= [a-z]+ ":" space [0-9]+\n'
     'space ::= | " " | "\\n" [ \\t]{0,20}', 3),  # what llama.cpp writes for a schema
    # parts that can be skipped, in a row (a fresh tester: a? 600 times wedged both workers;
    # 150 times 0.36 s per token), and {m,} counts, written as m copies
    ('root ::= ' + '"a"? ' * 150, 150), ('root ::= ' + '[a-z]* ' * 150, 150),
    ('root ::= x{100,}\nx ::= [a-z]{0,10}', 101),
    # optional "key": value pairs start with different literals: their text tells them apart
    ('root ::= "{" ' + " ".join(f'("\\"k{i}\\":" v)?' for i in range(100)) + ' "}"\nv ::= [0-9]+', 1),
    ('root ::= ' + '"a"? "b"? ' * 100 + '[ab]{60}', 100),  # the fourth tester's, 0.62 s per token
    # the fourth tester's false refusals: a "." or a group starting with "\n" between parts
    ('root ::= row ("\\n" row){0,4}\nrow ::= field ("," field){0,7}\n'
     'field ::= [a-z0-9]{1,10} | "\\"" [^"\\n]{0,20} "\\""', 0),
])
def test_grammar_repetitions_of_a_part_that_can_be_empty_are_counted(grammar, branch):
    assert grammar_costs(grammar)[1][0] == branch
    if branch > REPEATED_EMPTY_MAX and grammar_costs(grammar)[0][0] <= NESTED_POSITIONS_MAX:
        with pytest.raises(ApiError, match=f"about {branch} places"):
            check_grammar(grammar, "grammar")
    else:
        check_grammar(grammar, "grammar")


@pytest.mark.parametrize("pattern", [r"^\d{4}$", "[0-9]{4}", r"^[\s\S]{4,8}$", "^a$|^b$"])
def test_format_patterns_are_rewritten_and_tool_patterns_kept(pattern):
    """Where only a grammar is built from the schema, its patterns are rewritten for the
    worker (tests/api/test_schema_pattern.py); tools' schemas, which the model reads, stay."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}}
    check_schema(schema, "format", rewrite=True)
    assert schema["properties"]["v"]["pattern"] == rewrite_pattern(pattern) != pattern
    tools = {"type": "string", "pattern": pattern}
    check_schema(tools, "tools[0]")
    assert tools["pattern"] == pattern


def test_a_pattern_no_rewrite_enforces_is_dropped_and_its_lengths_apply():
    """``\b`` cannot be enforced by the worker's converter however written: it took the
    pattern as any string and ignored minLength/maxLength; dropped, those apply."""
    schema = {"type": "string", "pattern": r"^\bx", "maxLength": 4}
    check_schema(schema, "format", rewrite=True)
    assert schema == {"type": "string", "maxLength": 4}


@pytest.mark.parametrize("pattern, says", [
    ("^[z-a]$", 'format.pattern: range out of order in character class (z-a) in "^[z-a]$"'),
    ("[]", 'format.pattern: [] matches no character in "[]"'),
    ("^a\\", 'format.pattern: \\ at end of pattern in "^a\\\\"'),
    ("*a", 'format.pattern: nothing to repeat at "*a" in "*a"'),
    ("ab)", 'format.pattern: unmatched ) at 2 in "ab)"'),
])
def test_invalid_patterns_are_400_naming_the_pattern_as_sent(pattern, says):
    """The worker's 400 for these quoted the gateway's rewrite ("unbalanced parentheses" for
    a pattern without any), and ``[z-a]`` was its 500 "Unexpected empty grammar stack"
    (a fresh tester's finds). Tools' patterns, which the worker also converts, alike."""
    for rewrite in (True, False):
        schema = {"type": "string", "pattern": pattern}
        with pytest.raises(ApiError) as e:
            check_schema(schema, "format", rewrite=rewrite)
        assert (e.value.status, e.value.message) == (400, says)
        assert schema["pattern"] == pattern


@pytest.mark.parametrize("pattern", [
    # braces as the worker reads them: a fresh tester got these past the count (0.18-0.27 s
    # per token; {0, 500} wedged both workers)
    "^(a?){0, 150}$", "^(a?){0,150 }$", "^(a?){ 0,150}$", "^(a?){0,+150}$", "^(a?){0,150x}$",
    "^(a{,1}){0,150}$", r"^(\x61?){0,150}$", r"^(\u0061?){0,150}$",
])
def test_spellings_the_worker_reads_are_counted_alike(pattern):
    with pytest.raises(ApiError, match="repeat a part that can be empty"):
        check_schema({"type": "string", "pattern": pattern}, "format")


def test_long_alternations_are_refused_as_long_enums_are():
    """A word list as one alternation (a fresh tester's: 19,715 alternatives wedged both
    workers in a pattern and in a grammar; 3,000 took 65 ms per token)."""
    words = "|".join(f"w{i}" for i in range(5000))
    with pytest.raises(ApiError, match=r"format\.pattern: 5000 alternatives"):
        check_schema({"type": "string", "pattern": f"^({words})$"}, "format")
    with pytest.raises(ApiError, match=r"grammar: 5000 alternatives"):
        check_grammar("root ::= " + " | ".join(f'"w{i}"' for i in range(5000)), "grammar")
    few = "|".join(f"w{i}" for i in range(4000))
    check_schema({"type": "string", "pattern": f"^({few})$"}, "format")


def test_words_with_optional_spaces_pass():
    """(\\w{1,20}\\s?){1,50}: 1,050 positions, refused before, ran at 3.5-5.8 ms per token (a
    fresh tester's false refusal): its repeated part cannot be empty."""
    check_schema({"type": "string", "pattern": r"^(\w{1,20}\s?){1,50}$"}, "format", rewrite=True)


@pytest.mark.parametrize("pattern", ["[", "[[[", "[a-", "[^", "[\\", "a[b", "[a]b[", "^[^$"])
def test_an_unclosed_class_is_400_before_any_rewrite(pattern):
    """The rewrite read past the end of the pattern (IndexError, a 500; a fifth tester's find);
    the worker's own answer named the rewritten pattern."""
    for rewrite in (True, False):
        schema = {"type": "string", "pattern": pattern}
        with pytest.raises(ApiError) as e:
            check_schema(schema, "format", rewrite=rewrite)
        assert e.value.status == 400
        assert e.value.message.startswith("format.pattern: unterminated character class")
        assert schema["pattern"] == pattern  # refused as the client sent it


@pytest.mark.parametrize("pattern", ["[a]", "[^]", "\\[", "[\\]]", "^[a-z]+$"])
def test_closed_classes_pass(pattern):
    check_schema({"type": "string", "pattern": pattern}, "format", rewrite=True)


@pytest.mark.parametrize("grammar, bad", [
    ("root ::= [z-a]", "z-a"), (r"root ::= [a-z]+ [\x7f-\x00]", r"\x7f-\x00"),
    (r"root ::= [\u0100-\u00ff]", r"\u0100-\u00ff"), ("root ::= [z-ab-a]", "z-a"),
])
def test_grammar_class_ranges_out_of_order_are_400(grammar, bad):
    """The worker took ``[z-a]``, which matches no character, and answered 500 "Unexpected
    empty grammar stack" when an answer reached it (a fresh tester's find). Only a class that
    then matches nothing is refused: ``[az-a]`` matches "a", ``[^z-a]`` any character (the
    worker answered both: a later tester's find)."""
    with pytest.raises(ApiError) as e:
        check_grammar(grammar, "grammar")
    assert e.value.message == (f"grammar: the character class range {bad} is out of order (its "
                               f"end is below its start), so the class matches no character")
    last = grammar.rindex("[") + 1  # the class that matched nothing, negated or given "q"
    for matching in (grammar[:last] + "^" + grammar[last:], grammar[:last] + "q" + grammar[last:]):
        check_grammar(matching, "grammar")


@pytest.mark.parametrize("grammar", [
    'root ::= "[z-a]"', "root ::= [a-z] # [z-a]", r"root ::= [^\]a-]", r"root ::= [\x00-\x7f]",
    "root ::= [a-a]", r'root ::= ["\\-z]'])
def test_grammar_class_ranges_in_order_literals_and_comments_pass(grammar):
    check_grammar(grammar, "grammar")


def test_enum_values_the_pattern_refuses_are_left_out_and_a_const_is_checked():
    """The worker's schema reader takes const, then enum, before the string's pattern, so
    ``enum: ["ab", "12"]`` beside ``^\\d{2}$`` could answer "ab" (a fresh tester's find)."""
    schema = {"pattern": r"^\d{2}$", "enum": ["ab", "12", 3, "1\x7f"]}
    check_schema(schema, "format", rewrite=True)
    assert schema["enum"] == ["12", 3]  # no type: a non-string is not the pattern's to refuse
    for bad, says in (({"pattern": "^a", "enum": ["ba"]}, "format: no enum value matches"),
                      ({"pattern": "^a", "const": "ba"}, 'format: const "ba" does not match')):
        with pytest.raises(ApiError, match=says):
            check_schema(bad, "format", rewrite=True)
    # an anyOf branch another branch can stand in for is left to the worker (a tester's
    # false refusal); under type string, non-strings go too
    either = {"anyOf": [{"type": "string", "pattern": r"^\d$", "enum": ["a"]}, {"type": "integer"}]}
    check_schema(either, "format", rewrite=True)
    assert either["anyOf"][0]["enum"] == ["a"]
    typed = {"type": "string", "pattern": r"^\d$", "enum": ["1", 2, None]}
    check_schema(typed, "format", rewrite=True)
    assert typed["enum"] == ["1"]
    tools = {"type": "string", "pattern": "^a", "enum": ["ba", "ab"]}
    check_schema(tools, "tools[0]")
    assert tools["enum"] == ["ba", "ab"]  # tools' schemas, which the model reads, stay


def test_the_patterns_of_one_schema_are_counted_together():
    """anyOf branches are live at once in the worker's grammar: 10 branches of a pattern each
    within the limits took 485 ms per token, 80 froze the worker (a fresh tester's find)."""
    branch = {"type": "string", "pattern": r"^(a*){60}a{100}$"}  # 60 places on its own
    check_schema({"anyOf": [dict(branch) for _ in range(2)]}, "format", rewrite=True)
    with pytest.raises(ApiError) as e:
        check_schema({"anyOf": [dict(branch) for _ in range(3)]}, "format", rewrite=True)
    assert e.value.message.startswith("format: its patterns together have about 180 grammar "
                                      "positions and 180 places per character")
    # sequential properties are not live at once and are not added (a tester: two of these
    # 5.2 ms per token, one 5.6 ms)
    check_schema({"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": r"^(a?){0,60}X$"} for i in range(8)}},
        "format", rewrite=True)


@pytest.mark.parametrize("value", [None, 123, ["a"]])
def test_a_pattern_that_is_not_a_string_is_400(value):
    with pytest.raises(ApiError, match=f"format.properties.v.pattern must be a string, got "):
        check_schema({"properties": {"v": {"type": "string", "pattern": value}}}, "format")
    check_schema({"type": "integer", "pattern": 5}, "format")  # read only for strings


@pytest.mark.parametrize("grammar", [
    'root ::= x{0,400}\rx ::= "a" | ""',                # rules ended by a lone CR
    'root ::= "x\ny ::= " x{0,400}\nx ::= "a" | ""',   # a raw newline inside a literal
    'root ::= x{0,400}\nx ::= "a" | ""\u0000{',         # text after a NUL, which ends it
])
def test_rules_are_read_as_the_workers_parser_delimits_them(grammar):
    """The cost checks found rules by a line-start regex: a lone CR (which ends a rule for
    llama.cpp), a newline inside a literal or a NUL (the end of the worker's C string) took
    them past the count, and one such request wedged both workers (a later tester's finds).
    Rules now come from gbnf_syntax's reading."""
    with pytest.raises(ApiError) as e:
        check_grammar(grammar, "grammar")
    assert "repeat a part that can be empty" in e.value.message, e.value.message


def test_an_empty_grammar_is_none_and_text_after_a_nul_is_not_read():
    check_grammar("", "grammar")  # llama-server reads "" as no grammar (it answered 200)
    check_grammar('root ::= "a"\0 x{5,2}', "grammar")  # the worker loads it: it ends at \0
    with pytest.raises(ApiError) as e:
        check_grammar("root ::= foo\0{", "grammar")
    assert e.value.message.startswith("grammar: Undefined rule identifier 'foo'")
