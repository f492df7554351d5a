"""Schemas and grammars that freeze the pinned llama-server are refused with 400 before any
worker sees them, on every route that takes one; the worker is never wedged and serves on.

A fresh tester's find: ``format: {"type": "array", "minItems": 5, "maxItems": 2}`` made the
worker's grammar parser loop (``n - m`` repetitions as an unsigned 64-bit number); the gateway
found it wedged after about 15 s, killed it, and retried the request on the model's other
workers, which froze in turn: one request, a 502 after 39 s, and every worker restarted."""

import time

import httpx
import pytest

from tests.conftest import base_config, free_port, worker_key

pytestmark = pytest.mark.slow

BAD = {"type": "array", "minItems": 5, "maxItems": 2}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 1}}}}}]
MSGS = [{"role": "user", "content": "hi"}]


def test_schemas_and_grammars_that_would_freeze_the_worker_get_400(tmp_path, gateway_factory):
    from tests.e2e.compat_helpers import TOOLS_TEMPLATE
    tpl = tmp_path / "tools.jinja"
    tpl.write_text(TOOLS_TEMPLATE)
    cfg = base_config(free_port(), models=[{"name": "demo", "path": "builtin:demo", "slots": 2,
                                            "context": 512, "cpu": 1,
                                            "args": ["--chat-template-file", str(tpl)]}])
    gw = gateway_factory(cfg)
    opts = {"options": {"num_predict": 4}, "stream": False}
    cases = [
        ("/api/generate", {"model": "demo", "prompt": "hi", "format": BAD, **opts},
         "format: minItems (5) is greater than maxItems (2)"),
        ("/api/chat", {"model": "demo", "messages": MSGS, "format": BAD, **opts},
         "format: minItems (5)"),
        ("/api/chat", {"model": "demo", "messages": MSGS, "tools": TOOLS, **opts},
         "tools[0].function.parameters.properties.s: minLength (3)"),
        ("/v1/chat/completions", {"model": "demo", "messages": MSGS, "max_tokens": 4,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": BAD}}},
         "response_format.json_schema.schema: minItems (5)"),
        ("/v1/chat/completions", {"model": "demo", "messages": MSGS, "max_tokens": 4,
                                  "tools": TOOLS, "tool_choice": "required"},
         "tools[0].function.parameters.properties.s"),
        ("/v1/chat/completions", {"model": "demo", "messages": MSGS, "max_tokens": 4,
                                  "grammar": 'root ::= "a"{5,2}'},
         "grammar: repetition {5,2} has its maximum below its minimum"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "json_schema": {"type": "string", "minLength": 9, "maxLength": 2}},
         "json_schema: minLength (9)"),
        # nested repetitions of an undelimited group: the worker's grammar sampler tracks
        # 360,000 positions and its main loop stops answering (a fresh tester's find: both
        # workers wedged and restarted, and a stream of another client was cut)
        ("/api/chat", {"model": "demo", "messages": MSGS, **opts,
                       "format": {"type": "string", "pattern": "^(a{0,600}){0,600}$"}},
         "format.pattern: the repetitions (a{0,600}){0,600} have about 360000 positions"),
        ("/v1/chat/completions", {"model": "demo", "messages": MSGS, "max_tokens": 4,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "string",
                                                              "pattern": "^(a{0,200}){0,200}$"}}}},
         "response_format.json_schema.schema.pattern: the repetitions"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "grammar": 'root ::= x{0,600}\nx ::= "a"{0,600}'},
         "grammar: the repetitions x{0,600} have about 360000 positions"),
        # varying repetitions in a row add up (a fresh tester: 22.7 s for 64 tokens)
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts, "format": {
            "type": "string", "pattern": "^" + "[a-z]{0,100}" * 20 + "[a-z]{300}$"}},
         "format.pattern: the repetitions [a-z]{0,100} … [a-z]{0,100} have about 2000 positions"),
        # past llama.cpp's 2,000 repetitions the worker answered a bare "Failed to initialize
        # samplers: failed to parse grammar" (this session's find)
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts,
                           "format": {"type": "string", "minLength": 2001}},
         "format: minLength 2001 is more repetitions than the worker's grammar takes (at most 2000)"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "grammar": 'root ::= "a"{2001}'},
         "grammar: repetition {2001} repeats more times than the worker's grammar takes"),
        # a repeated part that can be empty: each character can go in any copy, which wedged
        # both workers under 500 positions (this session's tester: 502 after 25 s, the model
        # without a worker for 25 s)
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 64,
                             "grammar": 'root ::= x{0,600}\nx ::= "a" | ""'},
         "grammar: the repetitions x{0,600} repeat a part that can be empty, so each "
         "character could go in about 600 places"),
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts,
                           "format": {"type": "string", "pattern": "^(a?){0,400}$"}},
         "format.pattern: the repetitions (a?){0,400} repeat a part that can be empty"),
        # spelled as the worker reads it ({0, 500} wedged both workers; a tool's pattern goes
        # to the worker as sent, where ECMA-262 reads it as text and the gateway writes a
        # format's so) and a word list as one alternation (19,715 wedged both; a third
        # tester's finds)
        ("/api/chat", {"model": "demo", "messages": MSGS, **opts, "tools": [{
            "type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"s": {"type": "string",
                                                       "pattern": "^(a?){0, 500}$"}}}}}]},
         "tools[0].function.parameters.properties.s.pattern: the repetitions (a?){0, 500} "
         "repeat a part that can be empty"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "grammar": "root ::= w (\",\" w)*\nw ::= " + " | ".join(
                                 f'"w{i}"' for i in range(20000))},
         "grammar: 20000 alternatives"),
        # alternating optional characters (a fourth tester's: 300 times wedged the worker)
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts, "format": {
            "type": "string", "pattern": "^" + "a?b?" * 300 + "[ab]{60}$"}},
         "repeat a part that can be empty, so each character could go in about 300 places"),
        # an unclosed class: the gateway's pattern rewrite raised IndexError, a 500 (a
        # fifth tester's find); in a tool schema too, which is not rewritten
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts,
                           "format": {"type": "string", "pattern": "[a-"}},
         'format.pattern: unterminated character class (a [ without its ]) in "[a-"'),
        ("/v1/chat/completions", {"model": "demo", "messages": MSGS, "max_tokens": 4,
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "object", "properties": {
                                          "s": {"type": "string", "pattern": "[\\"}}}}}},
         'response_format.json_schema.schema.properties.s.pattern: unterminated character '
         'class (a [ without its ]) in "[\\\\"'),
        ("/api/chat", {"model": "demo", "messages": MSGS, **opts, "tools": [{
            "type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"s": {"type": "string", "pattern": "^[^$"}}}}}]},
         "tools[0].function.parameters.properties.s.pattern: unterminated character class"),
        # a class no character matches: the worker's 500 "Unexpected empty grammar stack" on
        # /api, and on /v1 a 400 that blamed a logit_bias (a sixth tester's find)
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts, "format": {
            "type": "object", "properties": {"v": {"type": "string", "pattern": "^[z-a]$"}}}},
         'format.properties.v.pattern: range out of order in character class (z-a) in '
         '"^[z-a]$"'),
        ("/api/chat", {"model": "demo", "messages": MSGS, **opts, "options": {"seed": 1},
                       "format": {"type": "string", "pattern": "^[z-a]$"}},
         "format.pattern: range out of order in character class (z-a)"),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "json_schema": {"type": "string", "pattern": "x[]"}},
         'json_schema.pattern: [] matches no character in "x[]"'),
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4,
                             "grammar": "root ::= [z-a]"},
         "grammar: the character class range z-a is out of order"),
        # rules ended by a lone CR, as the worker's parser ends them, are counted (this one
        # wedged both workers: a later tester's find)
        ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 1,
                             "grammar": 'root ::= x{0,400}\rx ::= "a" | ""'},
         "grammar: the repetitions x{0,400} repeat a part that can be empty"),
        # ECMA-262 syntax errors named as sent (the worker's named the gateway's rewrite:
        # "unbalanced parentheses" for "^a\\", which has none)
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts,
                           "format": {"type": "string", "pattern": "^a\\"}},
         'format.pattern: \\ at end of pattern in "^a\\\\"'),
        ("/api/generate", {"model": "demo", "prompt": "hi", **opts,
                           "format": {"type": "string", "pattern": "ab)"}},
         'format.pattern: unmatched ) at 2 in "ab)"'),
    ]
    for path, body, says in cases:
        t0 = time.monotonic()
        r = httpx.post(gw.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert time.monotonic() - t0 < 5
        err = r.json()["error"]
        text = err if path.startswith("/api/") else err["message"]  # each API's error shape
        assert says in text, (path, text)
    # the same shapes with bounds that can be met are served
    ok = httpx.post(gw.url + "/api/generate", timeout=60, json={
        "model": "demo", "prompt": "hi", "format": {**BAD, "minItems": 1}, **opts})
    assert ok.status_code == 200, ok.text
    for at_most in ({"type": "string", "minLength": 2000}, {"type": "array", "minItems": 2001},
                    {"type": "string", "pattern": "^a{2000}$"},  # the worker's own limits
                    {"type": "string", "pattern": "^(a?){0,60}$"},  # 20 ms per token
                    # refused before (a fourth tester's): a "." between the parts ends a run
                    {"type": "string", "pattern": r"^[a-z0-9]{1,255}\.[a-z0-9]{1,255}$"}):
        ok = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": "hi", "format": at_most, **opts})
        assert ok.status_code == 200, (at_most, ok.text)
    ok = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": MSGS, "max_tokens": 4, "grammar": 'root ::= "a"{2,5}'})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in (
        "aa", "aaa", "aaaa", "aaaaa"), ok.text
    ok = httpx.post(gw.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "hi", "max_tokens": 8,
        "grammar": 'root ::= "[" (v ("," v){0,1000})? "]"\nv ::= [0-9]+'})
    assert ok.status_code == 200, ok.text  # each item starts with ",": not counted
    ok = httpx.post(gw.url + "/v1/completions", timeout=60, json={  # CSV with quoted fields
        "model": "demo", "prompt": "hi", "max_tokens": 8,
        "grammar": 'root ::= row ("\\n" row){0,4}\nrow ::= field ("," field){0,7}\n'
                   'field ::= [a-z0-9]{1,10} | "\\"" [^"\\n]{0,20} "\\""'})
    assert ok.status_code == 200, ok.text
    # a delimited one is served at once (each word ends at its space)
    ok = httpx.post(gw.url + "/api/chat", timeout=60, json={
        "model": "demo", "messages": MSGS, **opts,
        "format": {"type": "string", "pattern": "^(\\w{1,50} ){0,100}$"}})
    assert ok.status_code == 200, ok.text
    w = gw.workers()[0]
    assert w["state"] == "ready" and w["restarts"] == 0, w  # never wedged


def test_an_invalid_format_is_400_even_when_the_model_cannot_run(gateway_factory):
    """``/api/generate`` checked ``format`` only after the model's availability, so an invalid
    one got 503 "drained" / "unavailable" while ``/api/chat`` said 400 ``invalid format`` (a
    fresh tester's find). The request's own fault comes first on both."""
    cfg = base_config(free_port(), admin={"token": "t"})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg)
    r = httpx.post(gw.url + "/gateway/api/admin/workers/demo-cpu0/drain",
                   headers={"Authorization": "Bearer t"}, timeout=30)
    assert r.status_code == 200, r.text
    for path, body in (("/api/generate", {"prompt": "hi"}), ("/api/chat", {"messages": MSGS})):
        r = httpx.post(gw.url + path, timeout=30, json={"model": "demo", "format": 5,
                                                        "stream": False, **body})
        assert r.status_code == 400 and r.json()["error"].startswith("invalid format: 5"), \
            (path, r.text)
        r = httpx.post(gw.url + path, timeout=30, json={"model": "demo", "stream": False, **body})
        assert r.status_code == 503, (path, r.text)  # drained: the valid request is refused


def test_patterns_with_class_escapes_or_no_anchors_are_enforced(gateway_factory):
    r"""The pinned llama.cpp's schema converter took ``\d``, ``\w``, ``\s`` and a pattern
    without both anchors as "any string" (a line in the worker's log only), so ``^\d{4}$``
    answered free text (a fresh tester's find). The gateway writes them as classes and adds
    ``.*`` for a missing anchor (JSON Schema's pattern is a search): the answers match."""
    import json
    import re

    cfg = base_config(free_port())
    cfg["models"][0].update(cpu=1, slots=2)
    gw = gateway_factory(cfg)
    for pattern, full in ((r"^\d{4}$", r"[0-9]{4}"), (r"^\d{4}-\d{2}-\d{2}$", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
                          (r"^\+?[1-9]\d{1,14}$", r"\+?[1-9][0-9]{1,14}")):
        for seed in (1, 2, 3):
            r = httpx.post(gw.url + "/api/generate", timeout=60, json={
                "model": "demo", "prompt": "hi", "stream": False,
                "options": {"num_predict": 40, "seed": seed},
                "format": {"type": "string", "pattern": pattern}})
            assert r.status_code == 200 and r.json()["done_reason"] == "stop", r.text
            assert re.fullmatch(full, json.loads(r.json()["response"])), (pattern, r.json())
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "max_tokens": 40, "seed": 4, "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"v": {"type": "string", "pattern": pattern}},
                "required": ["v"]}}}})
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["message"]["content"])["v"]
        assert re.fullmatch(full, value), (pattern, value)
    # what the grammar writes between the quotes is valid JSON whose value matches: "\s" as
    # [ \t\n\r] put a raw TAB in 7 of 8 answers, dots, negated classes and ranges such as
    # [!-/] let raw quotes and controls through, [\s\S] and [\W] constrained nothing, and
    # \x22 or \\ in the pattern were written raw (fresh testers' finds). Python regexes of
    # the same ECMA-262 meaning check the values. Classes are sent positive: under negated
    # ones the worker's grammar took invalid UTF-8, which the answer held as U+FFFD runs that
    # broke the counts (30 of 80 answers at temperature 1.5; a fresh tester's find).
    es_s = "\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
    for pattern, full in ((r"^\s?x$", f"[{es_s}]?x"), ("^.{6}$", "[^\n\r\u2028\u2029]{6}"),
                          ("^[^a]{6}$", "[^a]{6}"), (r"^\S{6}$", f"[^{es_s}]{{6}}"),
                          (r"^[\s\S]{4,8}$", r"[\s\S]{4,8}"), (r"^[\W]{3,6}$", "[^0-9A-Za-z_]{3,6}"),
                          (r"^[!-/]{4,8}$", "[!-/]{4,8}"), (r"^[\x00-\x7f]{4,8}$", r"[\x00-\x7f]{4,8}"),
                          (r"^\x22{2}$", '"{2}'), (r"^\\{2}$", r"\\{2}")):
        for seed in range(6):
            r = httpx.post(gw.url + "/api/generate", timeout=60, json={
                "model": "demo", "prompt": "hi", "stream": False,
                "options": {"num_predict": 60, "seed": seed},
                "format": {"type": "object", "properties": {"v": {"type": "string",
                                                                  "pattern": pattern}},
                           "required": ["v"]}})
            assert r.status_code == 200 and r.json()["done_reason"] == "stop", r.text
            value = json.loads(r.json()["response"])["v"]  # valid JSON, every seed
            assert re.fullmatch(full, value), (pattern, seed, value)
    for pattern, lo, hi in (("^[^a-z]{6,10}$", 6, 10), (r"^[\W]{3,6}$", 3, 6)):
        for seed in range(6):
            r = httpx.post(gw.url + "/api/generate", timeout=60, json={
                "model": "demo", "prompt": "hi", "stream": False,
                "options": {"num_predict": 80, "seed": seed, "temperature": 1.5, "top_p": 1},
                "format": {"type": "string", "pattern": pattern}})
            value = json.loads(r.json()["response"])
            assert lo <= len(value) <= hi and "\ufffd" not in value, (pattern, seed, value)
    # a pattern without "$" is a search from its start: "^xyz" makes every answer start with
    # "xyz" and go on freely (before: any string, the demo model's random text)
    for seed in (1, 2, 3):
        r = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": "hi", "stream": False,
            "options": {"num_predict": 8, "seed": seed},
            "format": {"type": "string", "pattern": "^xyz"}})
        assert r.status_code == 200 and r.json()["response"].startswith('"xyz'), r.text


_PARTS = ['root', 'x', ' ::= ', '::=', '"a"', '"b\\n"', '""', '[a-c]', '[^x]', '[]', '[a-]', '(',
          ')', '|', '*', '+', '?', '{2}', '{1,3}', '{2,}', '{ 1 , 2 }', '{0}', '\n', ' ',
          '#c\n', '<[5]>', '!<[7]>', '.', '\\', '"\\q"', '"\\x4g"', '\nx ::= ', '\nroot ::= ',
          '"', '[', '{', '}', ',', '-', 'y', '\r\n', '\t']
_ITEMS = ['"a"', '"bc"', '""', '"q"', 'x', 'y', '[a-c]', '[^x]', '.', '<[5]>', '[]', '[0-9]']
_QUANTIFIERS = ['', '', '', '*', '+', '?', '{2}', '{0,3}', '{1,}', '{0}', '{3,5}']


def _grammars(rng, n: int) -> list[str]:
    """Half fragments at random (mostly syntax errors), half rules built from items,
    quantifiers and groups (undefined rules, left recursion, loadable ones), some with one
    fragment swapped in."""
    def body(depth: int) -> str:
        alts = []
        for _ in range(rng.randint(1, 3)):
            alts.append(" ".join(
                ("(" + body(depth + 1) + ")" if depth < 2 and rng.random() < 0.25
                 else rng.choice(_ITEMS)) + rng.choice(_QUANTIFIERS)
                for _ in range(rng.randint(0, 3))))
        if depth == 0 and not alts[-1]:
            alts[-1] = '"z"'  # "| " before a newline would take the next rule's name in
        return " | ".join(alts)

    out = []
    for k in range(n):
        if k % 2:
            g = ("root ::= " if rng.random() < 0.7 else "") + "".join(
                rng.choice(_PARTS) for _ in range(rng.randint(1, 10)))
        else:
            g = "\n".join(["root ::= " + body(0)] + [f"{name} ::= " + body(0) for name in "xy"
                                                      if rng.random() < 0.95])
            if rng.random() < 0.2:
                i = rng.randrange(len(g))
                g = g[:i] + rng.choice(_PARTS) + g[i + 1:]
        if g.strip():
            out.append(g)
    return out


def test_the_worker_refuses_a_grammar_exactly_when_the_gateway_says_why(gateway_factory):
    """The pinned llama-server answers every grammar its parser refuses with one bare 400,
    "failed to parse grammar"; the gateway now refuses those itself, saying why and where
    (gateway/api/gbnf_syntax.py). On 240 generated grammars and the unit test's cases, sent
    straight to a real worker: the worker refuses one exactly when ``grammar_error`` gives a
    reason (a grammar it takes may still end in a dead end while decoding: that is not a
    parse refusal). Through the gateway the reason comes as the 400 on /v1."""
    import random

    from gateway.api.gbnf_syntax import grammar_error
    from tests.api.test_gbnf_syntax import test_grammars_the_worker_loads_pass as loads
    from tests.api.test_gbnf_syntax import test_refusals_in_the_parsers_words_with_a_place as refusals
    named = [m.args[1] for m in refusals.pytestmark if m.name == "parametrize"][0]
    named = [g for g, _ in named] + [m.args[1] for m in loads.pytestmark
                                     if m.name == "parametrize"][0]
    gw = gateway_factory(base_config(free_port(), models=[
        {"name": "demo", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1}]))
    w = gw.workers()[0]
    worker = f"http://127.0.0.1:{w['port']}"
    key = {"Authorization": f"Bearer {worker_key(w['pid'])}"}
    # left out: a NUL (JSON carries it; the worker's C string ends there, so would this
    # check's) and <text> tokens, which only the worker's vocabulary can read
    grammars = [g for g in named if "\0" not in g and "<hello>" not in g]
    grammars += _grammars(random.Random(20261202), 240)
    taken = refused = 0
    with httpx.Client(timeout=60) as c:
        for g in grammars:
            r = c.post(worker + "/completion", headers=key,
                       json={"prompt": "hi", "n_predict": 1, "grammar": g})
            parse_refused = (r.status_code == 400 and
                             "failed to parse grammar" in r.json()["error"]["message"])
            assert r.status_code in (200, 400, 500), (g, r.status_code, r.text)
            assert parse_refused == (grammar_error(g) is not None), (g, r.text, grammar_error(g))
            taken += not parse_refused
            refused += parse_refused
        assert taken >= 25 and refused >= 150, (taken, refused)  # both sides well tried
        g = 'root ::= "a"\nitem ::= ("b" | "c"\n'
        for path, body in (("/v1/chat/completions", {"messages": MSGS}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = c.post(gw.url + path, json={"model": "demo", "max_tokens": 2, "grammar": g,
                                            **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == \
                "grammar: expecting ')' at line 3, column 1 (its end)"
        r = c.post(gw.url + "/v1/completions", json={"model": "demo", "max_tokens": 2,
                                                     "prompt": "hi", "grammar": 'root ::= "ab"'})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
