"""32-bit clamping and penalty windows of a generation body (gateway/api/worker_ints.py)."""

from __future__ import annotations

import pytest

from gateway.api.worker_ints import INT32_MAX, INT32_MIN, bound


@pytest.mark.parametrize("key", ["n_predict", "max_tokens", "max_completion_tokens"])
def test_budgets_past_32_bits_mean_no_limit(key):
    for v, want in ((2 ** 32, INT32_MAX), (2 ** 32 + 1, INT32_MAX), (2 ** 63 - 1, INT32_MAX),
                    (-(2 ** 40), -1), (INT32_MAX, INT32_MAX), (-1, -1), (16, 16)):
        body = {key: v}
        bound(body, 2048)
        assert body == {key: want}, (v, body)


def test_other_32_bit_fields_are_clamped_not_wrapped():
    body = {"top_k": 2 ** 32 + 1, "n_keep": -(2 ** 33), "n_probs": 5, "seed": 2 ** 40,
            "temperature": 1e12, "min_keep": True}
    bound(body, 2048)
    # seed is llama-server's uint32 (wraps as in Ollama), floats and booleans are not ints here
    assert body == {"top_k": INT32_MAX, "n_keep": INT32_MIN, "n_probs": 5, "seed": 2 ** 40,
                    "temperature": 1e12, "min_keep": True}


def test_penalty_windows_are_capped_at_the_slot_context():
    body = {"repeat_last_n": 1_000_000_000, "dry_penalty_last_n": 5000}
    bound(body, 2048)
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048}
    body = {"repeat_last_n": -1, "dry_penalty_last_n": -1}  # Ollama: the whole context
    bound(body, 2048)
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048}  # its 400 for -1
    body = {"repeat_last_n": 64, "dry_penalty_last_n": 0}
    bound(body, 2048)
    assert body == {"repeat_last_n": 64, "dry_penalty_last_n": 0}
    body = {"repeat_last_n": 1_000_000_000}
    bound(body, 0)  # no context known yet: left for llama-server
    assert body == {"repeat_last_n": 1_000_000_000}
    body = {"repeat_last_n": -5}  # llama-server's own 400
    bound(body, 2048)
    assert body == {"repeat_last_n": -5}


def test_numbers_written_as_floats_are_bounded_too():
    """``repeat_last_n: 1e9`` (a JSON float) got past the integers-only cap and wedged a worker;
    ``top_k: 4294967297.0`` reached it wrapped to 0 (a fresh tester's finds). llama-server
    truncates a float read into an int; so does the gateway, then bounds it."""
    body = {"repeat_last_n": 1e9, "dry_penalty_last_n": 4096.0, "top_k": 4294967297.0,
            "n_probs": 2.7, "n_predict": -1e12, "min_keep": float("inf"), "n_keep": -1.0}
    bound(body, 2048)
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048, "top_k": INT32_MAX,
                    "n_probs": 2, "n_predict": -1, "min_keep": INT32_MAX, "n_keep": -1}
    assert all(type(v) is int for v in body.values())
