"""Tests for workers.demo_model: the file's contents, and (slow) that real llama-server runs it."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import gguf
import httpx
import pytest

from workers.demo_model import (
    DEMO_SHAPE,
    GPU_BENCH_SHAPE,
    SPECIAL_TOKENS,
    ModelShape,
    demo_model_path,
    ensure_demo_model,
    write_demo_model,
)
from workers.provision import cache_root, ensure_llama_server


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def demo_file(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "demo.gguf")


def test_demo_model_metadata(demo_file):
    r = gguf.GGUFReader(str(demo_file))
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "general.name") == "demo"
    assert _field(r, "llama.context_length") == 4096
    assert _field(r, "llama.embedding_length") == 64
    assert _field(r, "llama.block_count") == 2
    assert _field(r, "llama.attention.head_count") == 4
    assert _field(r, "llama.attention.head_count_kv") == 4
    assert _field(r, "llama.feed_forward_length") == 128
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.add_bos_token") is False
    template = _field(r, "tokenizer.chat_template")
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    assert demo_file.stat().st_size < 1_000_000


def test_demo_model_vocab_and_merges(demo_file):
    r = gguf.GGUFReader(str(demo_file))
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    merges = _field(r, "tokenizer.ggml.merges")
    assert len(merges) > 0
    vocab = set(tokens)
    assert len(vocab) == len(tokens), "tokens must be unique"
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert len(tokens) >= 256 + len(SPECIAL_TOKENS)
    for s in SPECIAL_TOKENS:
        assert types[tokens.index(s)] == int(gguf.TokenType.CONTROL)
    assert _field(r, "tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")
    assert _field(r, "tokenizer.ggml.bos_token_id") == tokens.index("<|endoftext|>")
    assert _field(r, "llama.vocab_size") == len(tokens)


def test_demo_model_is_deterministic(tmp_path, demo_file):
    again = write_demo_model(tmp_path / "again.gguf")
    assert again.read_bytes() == demo_file.read_bytes()
    other = write_demo_model(tmp_path / "other.gguf", seed=1, n_ctx_train=2048)
    r = gguf.GGUFReader(str(other))
    assert _field(r, "llama.context_length") == 2048
    assert other.read_bytes() != demo_file.read_bytes()


def test_ensure_demo_model_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_GATEWAY_CACHE", str(tmp_path / "cache"))
    assert demo_model_path() == cache_root() / "models" / "demo.gguf"
    p = ensure_demo_model()
    assert p == demo_model_path() and p.is_file()
    mtime = p.stat().st_mtime_ns
    assert ensure_demo_model() == p
    assert p.stat().st_mtime_ns == mtime
    assert not [f for f in p.parent.iterdir() if f.name != "demo.gguf"], "no temp files left"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen, log: Path | None = None) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-3000:] if log else "llama-server exited"
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "llama-server did not become healthy in 60 s"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a fresh machine builds llama-server first (about 4 min on 2 cores)
def test_demo_model_runs_in_llama_server(demo_file, tmp_path):
    binary = ensure_llama_server()
    port = _free_port()
    log_file = open(tmp_path / "llama-server.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "-m", str(demo_file), "--host", "127.0.0.1", "--port", str(port),
         "-np", "2", "-c", "4096", "-t", "1", "--metrics"],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            _wait_healthy(client, proc, tmp_path / "llama-server.log")

            r = client.post("/completion", json={"prompt": "hello", "n_predict": 8})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["content"]
            assert body["tokens_predicted"] >= 1

            r = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8},
            )
            assert r.status_code == 200, r.text
            chat = r.json()
            assert chat["choices"][0]["message"]["content"]
            # The ChatML template wraps the message: far more prompt tokens than "hi there" alone.
            assert chat["usage"]["prompt_tokens"] > 5

            slots = client.get("/slots").json()
            assert len(slots) == 2
            assert all(s["n_ctx"] == 2048 for s in slots)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log_file.close()


SMALL_F16 = ModelShape(n_embd=256, n_layer=3, n_head=8, n_head_kv=2, n_ff=512, dtype="f16")
SMALL_Q4 = ModelShape(n_embd=256, n_layer=2, n_head=8, n_head_kv=2, n_ff=512, dtype="q4_0")


def test_a_bigger_shape_keeps_vocab_and_template_and_stores_f16(tmp_path, demo_file):
    f = write_demo_model(tmp_path / "big.gguf", shape=SMALL_F16)
    r, demo = gguf.GGUFReader(str(f)), gguf.GGUFReader(str(demo_file))
    assert _field(r, "general.name") == "demo-256x3"
    assert _field(r, "llama.embedding_length") == 256 and _field(r, "llama.block_count") == 3
    assert _field(r, "llama.attention.head_count") == 8
    assert _field(r, "llama.attention.head_count_kv") == 2
    assert _field(r, "llama.feed_forward_length") == 512
    assert _field(r, "llama.rope.dimension_count") == 32
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert _field(r, key) == _field(demo, key)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.2.attn_k.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes["blk.0.attn_k.weight"] == (256, 64)  # ggml order: n_embd × (2 KV heads × 32)
    assert shapes["blk.0.ffn_down.weight"] == (512, 256)


def test_a_quantized_shape_stores_q4_0_and_layers_share_one_draw(tmp_path):
    r = gguf.GGUFReader(str(write_demo_model(tmp_path / "q.gguf", shape=SMALL_Q4)))
    t = {x.name: x for x in r.tensors}
    assert t["blk.1.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert tuple(int(x) for x in t["blk.1.ffn_up.weight"].shape) == (256, 512)
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert bytes(t["blk.0.ffn_up.weight"].data) == bytes(t["blk.1.ffn_up.weight"].data)
    assert bytes(t["blk.0.ffn_up.weight"].data) != bytes(t["blk.0.ffn_gate.weight"].data)


def test_shapes_that_cannot_work_are_refused(tmp_path):
    for bad in (ModelShape(n_embd=100, n_head=8), ModelShape(n_head=4, n_head_kv=3),
                ModelShape(dtype="q5_k"), ModelShape(n_embd=80, n_head=4, n_head_kv=4, dtype="q4_0")):
        with pytest.raises(ValueError, match="unusable model shape"):
            write_demo_model(tmp_path / "x.gguf", shape=bad)
    assert not list(tmp_path.iterdir())


def test_gpu_bench_shape_is_llama_3_2_1b_layers():
    assert DEMO_SHAPE.parameters() == 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 128 * 64)
    assert GPU_BENCH_SHAPE.parameters() == 973_078_528


@pytest.mark.slow
@pytest.mark.parametrize("shape", [SMALL_F16, SMALL_Q4], ids=["f16", "q4_0"])
def test_a_bigger_shape_runs_in_llama_server(tmp_path, shape):
    f = write_demo_model(tmp_path / "big.gguf", shape=shape)
    port = _free_port()
    proc = subprocess.Popen([str(ensure_llama_server()), "-m", str(f), "--host", "127.0.0.1",
                             "--port", str(port), "-np", "1", "-c", "512", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            _wait_healthy(client, proc)
            body = client.post("/completion", json={"prompt": "hello", "n_predict": 8}).json()
            assert body["tokens_predicted"] == 8 and body["content"]
            props = client.get("/props").json()
            assert props["model_path"].endswith("big.gguf")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
