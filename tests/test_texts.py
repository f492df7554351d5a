"""Unit test of gateway.texts.header_text: header bytes that are not UTF-8 shown as ``\\xNN``."""

from gateway.texts import header_text


def test_header_text_escapes_bytes_that_are_not_utf8():
    latin1 = b"caf\xe9.com".decode("utf-8", "surrogateescape")  # as aiohttp's parser gives it
    assert header_text(latin1) == r"caf\xe9.com"
    assert header_text(latin1).encode("utf-8")  # no surrogate left: encodes as UTF-8
    assert header_text("bücher.de") == "bücher.de"  # valid UTF-8 is kept
    assert header_text("localhost:11434") == "localhost:11434"
