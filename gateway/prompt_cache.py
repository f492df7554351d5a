"""How many prompt tokens one llama-server worker keeps cached (pure; no I/O).

A worker keeps prompts in two places:

- its slots' KV cells: each idle slot still holds its last prompt and answer (``cache_prompt``),
  at most ``-c`` tokens in all (VRAM);
- the host-memory prompt cache (llama.cpp PR #16391, ``--cache-ram N`` MiB, default 8192 in the
  pinned build's ``llama-server --help``; ``0`` disables it, ``-1`` removes the limit). Prompts
  evicted from a slot (and, with ``--cache-idle-slots``, the default, every idle slot's prompt)
  are copied there as whole-sequence KV state and copied back into a slot when a new prompt
  shares enough of them (tools/server/server-context.cpp ``get_available_slot``,
  server-task.cpp ``server_prompt_cache``). The cache evicts oldest first by bytes; its token
  limit (``-c`` by default) is raised to whatever fits the byte limit
  (``server_prompt_cache::update``), so it holds about ``cache_ram × 2**20 / kv_bytes_per_token``
  tokens.

KV bytes per token = layers × KV heads × (K dims × K type bytes + V dims × V type bytes): for
Llama 3 8B with the default f16 cache, 32 × 8 × (128 × 2 + 128 × 2) = 131,072 bytes. The host
cache's entries are that state and little else: ggml-org/llama.cpp#25740 measured llama-server's
memory growing by 144.6 KiB per cached token for Qwen3-8B, whose KV takes 144 KiB per token.
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_CACHE_RAM_MIB = 8192
"""``--cache-ram`` default of the pinned build (``llama-server --help``), MiB."""

# Bytes per element of llama.cpp KV cache types (ggml type traits: block bytes / block size,
# e.g. q8_0 stores 32 values in 34 bytes).
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32,
                    "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}


def kv_bytes_per_token(n_layer: int, n_head_kv: int, k_dim: int, v_dim: int | None = None,
                       type_k: str = "f16", type_v: str = "f16") -> int:
    """KV-cache bytes one token occupies (all layers, K and V). Dims are per head."""
    v_dim = k_dim if v_dim is None else v_dim
    per_head = k_dim * CACHE_TYPE_BYTES.get(type_k, 2.0) + v_dim * CACHE_TYPE_BYTES.get(type_v, 2.0)
    return int(round(n_layer * n_head_kv * per_head))


def option(args: Sequence[str], *names: str) -> str | None:
    """Value of the last ``--name V`` / ``--name=V`` among ``args`` (llama-server options), or None."""
    val = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                val = args[i + 1]
            elif a.startswith(n + "="):
                val = a[len(n) + 1:]
    return val


def kv_bytes_from_gguf(kv: dict, arch: str, args: Sequence[str] = ()) -> int:
    """KV bytes per token of a model from its GGUF key/values (``<arch>.block_count``,
    ``.attention.head_count_kv``, ``.attention.key_length`` / ``value_length`` or
    ``embedding_length / head_count``) and the cache types in ``args`` (``-ctk`` / ``-ctv``,
    default f16). 0 when the metadata does not say (e.g. per-layer KV head counts, which the
    inventory keeps only as an emptied long array)."""
    def num(key):
        v = kv.get(f"{arch}.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    n_layer, n_head = num("block_count"), num("attention.head_count")
    # absent: as many KV heads as heads; present but not one number (per-layer): unknown
    n_head_kv = num("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in kv else n_head
    embd = num("embedding_length")
    k_dim = num("attention.key_length") or (embd // n_head if embd and n_head else None)
    v_dim = num("attention.value_length") or k_dim
    if not (n_layer and n_head_kv and k_dim):
        return 0
    return kv_bytes_per_token(n_layer, n_head_kv, k_dim, v_dim,
                              option(args, "-ctk", "--cache-type-k") or "f16",
                              option(args, "-ctv", "--cache-type-v") or "f16")


def cache_ram_mib(args: Sequence[str] = ()) -> int:
    """Host prompt-cache limit (MiB) that ``args`` give llama-server: ``--cache-ram`` / ``-cram``,
    else the default. "No limit" (-1) is counted as the default: the gateway cannot know how much
    host memory the worker will really use for it."""
    v = option(args, "--cache-ram", "-cram")
    try:
        mib = int(v) if v is not None else DEFAULT_CACHE_RAM_MIB
    except ValueError:
        return DEFAULT_CACHE_RAM_MIB
    return DEFAULT_CACHE_RAM_MIB if mib < 0 else mib


def host_cache_tokens(ram_mib: int, kv_bytes: int) -> int:
    """Tokens a host prompt cache of ``ram_mib`` MiB holds at ``kv_bytes`` per token (0 if unknown)."""
    return ram_mib * 2**20 // kv_bytes if kv_bytes > 0 and ram_mib > 0 else 0


def worker_cache_tokens(kv_capacity: int, args: Sequence[str], kv_bytes: int) -> int:
    """Prompt tokens a worker can keep cached: its KV cells (``-c``) plus its host prompt cache."""
    return kv_capacity + host_cache_tokens(cache_ram_mib(args), kv_bytes)
