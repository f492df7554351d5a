"""KV fill and llama-server metrics parsing (shapes from llama-server's /slots and /metrics)."""

from gateway.worker_stats import kv_fill_from_slots, parse_worker_metrics


def test_kv_fill_counts_processing_slots_only():
    slots = [
        {"id": 0, "n_ctx": 1000, "is_processing": True, "n_prompt_tokens": 100,
         "next_token": [{"n_decoded": 50}]},
        {"id": 1, "n_ctx": 1000, "is_processing": False, "n_prompt_tokens": 900,
         "next_token": [{"n_decoded": 99}]},
    ]
    assert kv_fill_from_slots(slots) == 150 / 2000
    assert kv_fill_from_slots([{"id": 0}]) is None


def test_parse_worker_metrics():
    text = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1234
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""
    m = parse_worker_metrics(text)
    assert m["llamacpp:tokens_predicted_total"] == 1234 and m["llamacpp:requests_deferred"] == 3
