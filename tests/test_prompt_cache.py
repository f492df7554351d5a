"""How many prompt tokens a worker keeps cached (gateway.prompt_cache)."""

from pathlib import Path

import pytest

from gateway.prompt_cache import (DEFAULT_CACHE_RAM_MIB, cache_ram_mib, host_cache_tokens,
                                  kv_bytes_from_gguf, kv_bytes_per_token, option,
                                  worker_cache_tokens)


def test_llama3_8b_f16_kv_is_128_kib_per_token():
    assert kv_bytes_per_token(32, 8, 128) == 131_072
    assert kv_bytes_per_token(32, 8, 128, type_k="q8_0", type_v="q8_0") == 32 * 8 * 2 * 136
    # 8 GiB default host cache of an 8B model: 65,536 tokens
    assert host_cache_tokens(DEFAULT_CACHE_RAM_MIB, 131_072) == 65_536
    assert host_cache_tokens(0, 131_072) == 0 and host_cache_tokens(8192, 0) == 0


def test_kv_bytes_from_gguf_keys_and_cache_types():
    kv = {"llama.block_count": 32, "llama.attention.head_count": 32,
          "llama.attention.head_count_kv": 8, "llama.embedding_length": 4096}
    assert kv_bytes_from_gguf(kv, "llama") == 131_072
    assert kv_bytes_from_gguf(kv, "llama", ["-ctk", "q8_0", "--cache-type-v=q8_0"]) == 69_632
    explicit = dict(kv, **{"llama.attention.key_length": 192, "llama.attention.value_length": 128})
    assert kv_bytes_from_gguf(explicit, "llama") == 32 * 8 * (192 + 128) * 2
    assert kv_bytes_from_gguf({"llama.block_count": 32}, "llama") == 0  # not enough metadata
    per_layer = dict(kv, **{"llama.attention.head_count_kv": None})  # long arrays are emptied
    assert kv_bytes_from_gguf(per_layer, "llama") == 0
    mha = {k: v for k, v in kv.items() if k != "llama.attention.head_count_kv"}
    assert kv_bytes_from_gguf(mha, "llama") == 32 * 32 * 128 * 4


def test_demo_gguf_metadata():
    from gateway.inventory import GGUFFacts
    from workers.demo_model import ensure_demo_model
    path = Path(ensure_demo_model())
    facts = GGUFFacts.read(path)
    assert kv_bytes_from_gguf(facts.kv, facts.architecture) == kv_bytes_per_token(2, 4, 16) == 512


@pytest.mark.parametrize("args,mib", [([], 8192), (["--cache-ram", "2048"], 2048),
                                      (["-cram", "0"], 0), (["--cache-ram=-1"], 8192),
                                      (["--cache-ram", "lots"], 8192)])
def test_cache_ram_from_args(args, mib):
    assert cache_ram_mib(args) == mib


def test_option_takes_the_last_value_and_worker_cache_adds_kv_cells():
    assert option(["-c", "1", "-c", "2"], "-c") == "2" and option(["-c"], "-c") is None
    assert worker_cache_tokens(32_768, [], 131_072) == 32_768 + 65_536
    assert worker_cache_tokens(32_768, ["--cache-ram", "0"], 131_072) == 32_768
