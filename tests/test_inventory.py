"""The model file's digest for ``/api/tags`` / ``/api/ps`` (gateway/inventory.py): hashed in a
background thread, never on the event loop (a fresh tester saw a 1 GiB model's first
``/api/tags`` block every request for 1.7 s)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import pytest

from gateway import inventory
from gateway.inventory import ModelEntry, provisional_digest


@pytest.fixture
def slow_hash(monkeypatch, tmp_path):
    """The file hash takes until ``release`` is set (the digest cache is a fresh file)."""
    release = threading.Event()
    real = inventory._sha256

    def slow(path: Path) -> str:
        release.wait(10)
        return real(path)

    monkeypatch.setattr(inventory, "_sha256", slow)
    monkeypatch.setattr(inventory, "_digest_cache_file", lambda: tmp_path / "digests.json")
    return release


def test_a_digest_still_being_hashed_does_not_block_the_loop(tmp_path, slow_hash):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    e = ModelEntry(name="m:latest", path=f)

    async def main():
        ticks = []

        async def ticker():  # the event loop keeps running other work meanwhile
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        first = await e.digest_soon(0.3)
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        again = await e.digest_soon(0.3)  # a later listing does not wait again
        assert again == first and time.monotonic() - t1 < 0.1
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        slow_hash.set()
        for _ in range(100):  # the thread finishes: the file's own hash from then on
            if e._digest is not None:
                break
            await asyncio.sleep(0.02)
        second = await e.digest_soon(0.3)
        t.cancel()
        return first, waited, gaps, second

    first, waited, gaps, second = asyncio.run(main())
    assert first == provisional_digest(f) != second
    assert 0.25 <= waited < 1.0 and max(gaps) < 0.2, (waited, max(gaps))
    assert second == hashlib.sha256(b"abc").hexdigest()


def test_the_provisional_digest_is_stable_until_the_file_changes(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    d = provisional_digest(f)
    assert d == provisional_digest(f) and len(d) == 64
    f.write_bytes(b"abcd")
    assert provisional_digest(f) != d
    assert len(provisional_digest(tmp_path / "gone.gguf")) == 64  # no stat: still an id


def test_an_unreadable_file_gets_the_provisional_digest_and_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.setattr(inventory, "_digest_cache_file", lambda: tmp_path / "digests.json")
    f = tmp_path / "m.gguf"
    e = ModelEntry(name="m:latest", path=f)  # no file yet: the hash fails
    assert asyncio.run(e.digest_soon(1.0)) == provisional_digest(f)
    f.write_bytes(b"abc")
    for _ in range(50):
        got = asyncio.run(e.digest_soon(1.0))
        if got == hashlib.sha256(b"abc").hexdigest():
            break
        time.sleep(0.02)
    assert got == hashlib.sha256(b"abc").hexdigest()


def test_fewest_tokens_a_text_can_take_from_the_longest_vocabulary_piece(tmp_path):
    """``GGUFFacts.min_tokens``: bytes over the longest piece, for a tokenizer that keeps every
    byte (the demo model's byte-level BPE: its longest piece is 13 bytes); unknown (0) for one
    that normalises text (WordPiece ``bert`` here: a GGUF whose tokenizer model says so)."""
    import gguf

    from workers.demo_model import ensure_demo_model
    facts = inventory.GGUFFacts.read(ensure_demo_model())
    assert facts.max_token_bytes == 13
    assert [facts.min_tokens(n) for n in (0, 1, 13, 14, 26, 27)] == [0, 1, 1, 2, 2, 3]
    path = tmp_path / "wpm.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "hello", "##world"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    wpm = inventory.GGUFFacts.read(path)
    assert wpm.n_vocab == 3 and wpm.max_token_bytes == 0 and wpm.min_tokens(10**6) == 0


def test_capabilities_are_a_new_list_each_time():
    """The answer is remembered per template; callers still get a list of their own."""
    caps = inventory.capabilities(embeddings=False, template="{{ tools }} <think>",
                                  has_fim=True, vision=False)
    assert caps == ["completion", "tools", "insert", "thinking"]
    caps.append("vision")
    assert inventory.capabilities(embeddings=False, template="{{ tools }} <think>",
                                  has_fim=True, vision=False) == ["completion", "tools", "insert",
                                                                  "thinking"]
    assert inventory.capabilities(embeddings=True, template="", has_fim=False,
                                  vision=False) == ["embedding"]
