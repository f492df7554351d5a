"""Unit tests of gateway.limits: prompt_texts (only the text a route sends to a worker counts
against the slot context) and the bounded body decoder (the end-to-end checks are
tests/e2e/test_limits.py)."""

import gzip

import pytest

from gateway.api.errors import ApiError
from gateway import limits
from gateway.limits import _Decoder, prompt_texts

MSGS = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                     {"type": "text", "text": "b"}]}]


def test_generate_counts_system_only_where_the_template_uses_it():
    body = {"system": "S", "prompt": "P", "suffix": "", "messages": MSGS}
    assert prompt_texts(body, "/api/generate") == ["S\nP"]
    assert prompt_texts({**body, "raw": True}, "/api/generate") == ["P"]
    assert prompt_texts({**body, "suffix": "X"}, "/api/generate") == ["P\nX"]
    assert prompt_texts({"prompt": ""}, "/api/generate") == []


def test_chat_routes_count_messages_only():
    body = {"system": "S" * 9000, "prompt": "P" * 9000, "messages": MSGS}
    for path in ("/api/chat", "/v1/chat/completions"):
        assert prompt_texts(body, path) == ["be brief\nab"]
    assert prompt_texts({"messages": "nope"}, "/api/chat") == []


def test_v1_completions_counts_each_prompt_and_nothing_else():
    assert prompt_texts({"prompt": "P", "system": "S", "suffix": "X"}, "/v1/completions") == ["P"]
    assert prompt_texts({"prompt": ["a", "", 3, "b"]}, "/v1/completions") == ["a", "b"]
    for path in ("/api/show", "/api/embed", "/v1/embeddings", "/api/pull"):
        assert prompt_texts({"prompt": "P", "system": "S", "input": "I"}, path) == []


def test_decoder_stops_a_gzip_bomb_at_the_limit():
    """100 MB of zeros gzip to ~100 KB; decoding stops after limit + 1 bytes, not 100 MB."""
    bomb = gzip.compress(b"\0" * 100_000_000, compresslevel=9)
    d = _Decoder("gzip", 1_000_000)
    with pytest.raises(ApiError) as e:
        for i in range(0, len(bomb), 16384):
            d.feed(bomb[i:i + 16384])
    assert e.value.status == 413 and len(d.out) == 1_000_001


def test_decoder_round_trips_and_refuses_bad_or_truncated_data():
    data = b'{"model": "demo"}' * 100
    d = _Decoder("gzip", 10_000)
    d.feed(gzip.compress(data))
    assert d.finish() == data
    for enc, body in [("gzip", data), ("deflate", b"\x78\x9c" + data)]:
        with pytest.raises(ApiError) as e:
            _Decoder(enc, 10_000).feed(body)
        assert e.value.status == 400 and enc in e.value.message
    d = _Decoder("gzip", 10_000)
    d.feed(gzip.compress(data)[:-10])
    with pytest.raises(ApiError) as e:
        d.finish()
    assert e.value.status == 400 and "incomplete" in e.value.message


def _decode(enc, body, split=None):
    d = _Decoder(enc, 10_000)
    for i in range(0, len(body), split or len(body)):
        d.feed(body[i:i + (split or len(body))])
    return d.finish()


@pytest.mark.parametrize("split", [None, 7])  # in one read, or in reads that split members
def test_decoder_reads_every_gzip_member_and_refuses_what_follows_a_stream(split):
    """``cat a.gz b.gz`` is one gzip body (RFC 1952 §2.2), however the reads split it; bytes
    after a member that are not a member, or after a deflate stream, are invalid data."""
    import zlib
    a, b = b'{"model":"demo",', b'"messages":[]}'
    assert _decode("gzip", gzip.compress(a) + gzip.compress(b), split) == a + b
    for enc, body in [("gzip", gzip.compress(a) + b"garbage"),
                      ("gzip", gzip.compress(a) + b"\x1f\x8b\x08\x00garbage"),
                      ("deflate", zlib.compress(a) + b"garbage")]:
        with pytest.raises(ApiError) as e:
            _decode(enc, body, split)
        assert e.value.status == 400, (enc, body)


def test_body_with_invalid_utf8_is_read_as_go_reads_it():
    """Bytes that are not UTF-8 become U+FFFD (Go's encoding/json, so Ollama, answers such a
    request); anything else that is not JSON is still an error (found by a tester: the gateway
    answered 400 "str is not valid UTF-8")."""
    import orjson

    from gateway.api.common import loads_body
    assert loads_body(b'{"prompt": "caf\xc3"}') == {"prompt": "caf\ufffd"}
    assert limits.parse_object(b'{"model": "demo", "prompt": "\xff\xfe"}') == \
        {"model": "demo", "prompt": "\ufffd\ufffd"}
    assert loads_body('{"prompt": "café"}'.encode()) == {"prompt": "café"}
    with pytest.raises(orjson.JSONDecodeError):
        loads_body(b'{"prompt": ')
    # lone surrogate escapes too (Go writes U+FFFD); a pair stays one character
    assert loads_body(b'{"a": "ab\\ud800cd", "b": ["\\udc00"], "c": "\\ud83d\\ude00"}') == \
        {"a": "ab\ufffdcd", "b": ["\ufffd"], "c": "\U0001F600"}
    with pytest.raises(orjson.JSONDecodeError):  # NaN is not JSON, surrogate or not
        loads_body(b'{"a": "\\ud800", "b": NaN}')


def test_json_nested_past_the_limit_is_an_invalid_body():
    """orjson parses 1,024 levels but writes 254, and the gateway forwards client values inside
    its own: past MAX_JSON_DEPTH levels a body is invalid JSON (400 from the handler), whatever
    kind of nesting and however many brackets sit in strings."""
    import orjson

    from gateway.api.common import MAX_JSON_DEPTH, JSONTooDeep, json_depth, loads_body
    assert MAX_JSON_DEPTH == 128
    assert [json_depth(v) for v in (1, "x", [], {}, [{}], {"a": [1, {"b": []}]})] == [0, 0, 1, 1, 2, 4]
    at_limit = b'{"a":' + b'[{"b":' * 63 + b'[]' + b'}]' * 63 + b'}'
    assert json_depth(loads_body(at_limit)) == 128
    for deep in (b'[' * 129 + b']' * 129, b'{"a":' + b'[{"b":' * 64 + b'[]' + b'}]' * 64 + b'}'):
        with pytest.raises(JSONTooDeep) as e:
            loads_body(deep)
        assert isinstance(e.value, orjson.JSONDecodeError)
        assert str(e.value) == "nested more than 128 levels deep"
        assert limits.parse_object(deep) is None  # the guard leaves the words to the handler
    # brackets inside strings are not nesting; the depth is counted only when there are enough
    assert loads_body(b'{"p": "' + b'[' * 500 + b'"}') == {"p": "[" * 500}


def test_the_depth_check_is_orjsons_writer_and_agrees_with_a_walk():
    """``too_deep`` lets orjson's writer find the depth (a walk in Python blocked the event
    loop for 13.5 s on 8 million arrays); it agrees with the walk at and around the limit,
    for every kind of nesting."""
    from gateway.api.common import MAX_JSON_DEPTH, json_depth, too_deep

    def nested(d, kind):
        v = 1
        for i in range(d):
            v = [v] if kind == "list" or (kind == "mixed" and i % 2) else {"k": v}
        return v
    for kind in ("list", "dict", "mixed"):
        for d in (0, 1, 127, 128, 129, 200, 254, 300):
            v = nested(d, kind)
            assert json_depth(v) == d
            assert too_deep(v) == (d > MAX_JSON_DEPTH), (kind, d)
    wide = {"a": [[]] * 1000, "b": [{"c": [1, 2, {"d": []}]}] * 1000}
    assert too_deep(wide) is False


def test_a_body_of_a_million_containers_is_refused_before_it_is_parsed():
    """Each array or object of a body is a Python object: 64 MiB of ``[]`` (a 59 KiB gzip body)
    took the gateway to 1.2 GiB for 18 s (a fresh tester's find). Past MAX_JSON_CONTAINERS
    brackets and braces (counted in the bytes) the body is 413; up to it, it is parsed."""
    from gateway.api.common import MAX_JSON_CONTAINERS, JSONTooMany, loads_body
    n = MAX_JSON_CONTAINERS - 2
    ok = b'{"model":"x","junk":[' + b"[]," * (n - 1) + b"[]]}"
    assert len(loads_body(ok)["junk"]) == n - 1 + 1
    with pytest.raises(JSONTooMany) as e:
        loads_body(b'{"model":"x","junk":[' + b"[]," * n + b"[]]}")
    assert str(e.value).startswith(f"request body too large: more than {MAX_JSON_CONTAINERS} "
                                   "JSON arrays and objects")
