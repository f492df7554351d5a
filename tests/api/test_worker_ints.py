"""32-bit clamping and penalty windows of a generation body (gateway/api/worker_ints.py)."""

from __future__ import annotations

import pytest

from gateway.api.worker_ints import INT32_MAX, INT32_MIN, bound


@pytest.mark.parametrize("key", ["n_predict", "max_tokens", "max_completion_tokens"])
def test_budgets_past_32_bits_mean_no_limit(key):
    for v, want in ((2 ** 32, INT32_MAX), (2 ** 32 + 1, INT32_MAX), (2 ** 63 - 1, INT32_MAX),
                    (-(2 ** 40), -1), (INT32_MAX, INT32_MAX), (-1, -1), (16, 16)):
        body = {key: v}
        bound(body, 0)  # no context known: only the 32-bit clamping
        assert body == {key: want}, (v, body)


def test_other_32_bit_fields_are_clamped_not_wrapped():
    body = {"top_k": 2 ** 32 + 1, "n_keep": -(2 ** 33), "n_probs": 5, "seed": 2 ** 40,
            "temperature": 1e12, "min_keep": True}
    bound(body, 0)
    # seed is llama-server's uint32 (wraps as in Ollama), floats and booleans are not ints here
    assert body == {"top_k": INT32_MAX, "n_keep": INT32_MIN, "n_probs": 5, "seed": 2 ** 40,
                    "temperature": 1e12, "min_keep": True}


def test_penalty_windows_are_capped_at_the_slot_context():
    body = {"repeat_last_n": 1_000_000_000, "dry_penalty_last_n": 5000, "n_predict": 8}
    bound(body, 2048)
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048, "n_predict": 8}
    body = {"repeat_last_n": -1, "dry_penalty_last_n": -1, "n_predict": 8}  # Ollama: the
    bound(body, 2048)                                                        # whole context
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048, "n_predict": 8}
    body = {"repeat_last_n": 64, "dry_penalty_last_n": 0, "n_predict": 8}
    bound(body, 2048)
    assert body == {"repeat_last_n": 64, "dry_penalty_last_n": 0, "n_predict": 8}
    body = {"repeat_last_n": 1_000_000_000}
    bound(body, 0)  # no context known yet: left for llama-server
    assert body == {"repeat_last_n": 1_000_000_000}
    body = {"repeat_last_n": -5, "n_predict": 8}  # llama-server's own 400
    bound(body, 2048)
    assert body == {"repeat_last_n": -5, "n_predict": 8}


@pytest.mark.parametrize("key", ["n_predict", "max_tokens", "max_completion_tokens"])
def test_a_budget_is_at_most_ten_slot_contexts(key):
    """As Ollama's runner caps num_predict (10 × num_ctx): with llama-server's
    --context-shift an unbounded generation never ended."""
    for v, want in ((-1, 2560), (-2, 2560), (2 ** 40, 2560), (2561, 2560), (2560, 2560),
                    (100, 100), (0, 0)):
        body = {key: v}
        bound(body, 256)
        assert body == {key: want}, (v, body)


def test_a_body_without_a_budget_gets_one():
    body = {"prompt": "x"}
    bound(body, 256)
    assert body == {"prompt": "x", "n_predict": 2560}
    body = {"prompt": "x", "max_tokens": None}  # null: llama-server's default, unbounded
    bound(body, 256)
    assert body["n_predict"] == 2560
    body = {"prompt": "x"}
    bound(body, 0)  # no context known yet
    assert body == {"prompt": "x"}


def test_numbers_written_as_floats_are_bounded_too():
    """``repeat_last_n: 1e9`` (a JSON float) got past the integers-only cap and wedged a worker;
    ``top_k: 4294967297.0`` reached it wrapped to 0 (a fresh tester's finds). llama-server
    truncates a float read into an int; so does the gateway, then bounds it."""
    body = {"repeat_last_n": 1e9, "dry_penalty_last_n": 4096.0, "top_k": 4294967297.0,
            "n_probs": 2.7, "n_predict": -1e12, "min_keep": float("inf"), "n_keep": -1.0}
    bound(body, 2048)
    assert body == {"repeat_last_n": 2048, "dry_penalty_last_n": 2048, "top_k": INT32_MAX,
                    "n_probs": 2, "n_predict": 20480, "min_keep": INT32_MAX, "n_keep": -1}
    assert all(type(v) is int for v in body.values())
