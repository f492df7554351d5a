"""gateway/worker_stats.py: status/metrics numbers derived from one telemetry sample
(shapes from llama-server's /slots and /metrics)."""

from gateway.worker_stats import WorkerStatsView, stats_from_sample
from workers.telemetry import Progress, Sample, build_load, parse_metrics, parse_slots

METRICS = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1234
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""


def sample(at=10.0, progress=None, decoded=50):
    # This llama-server build counts decoded tokens in n_prompt_tokens too (checked live).
    slots = parse_slots([
        {"id": 0, "n_ctx": 1000, "is_processing": True, "n_prompt_tokens": 100 + decoded,
         "n_prompt_tokens_processed": 100, "next_token": [{"n_decoded": decoded}]},
        {"id": 1, "n_ctx": 1000, "is_processing": False, "n_prompt_tokens": 900,
         "next_token": [{"n_decoded": 99}]},
    ])
    metrics = parse_metrics(METRICS)
    return Sample(at, slots, metrics, build_load(at, slots, metrics, progress or Progress()))


def test_kv_fill_counts_busy_slots_only_and_deferred_from_metrics():
    st = stats_from_sample(sample())
    assert st.kv_fill == 150 / 2000
    assert st.deferred == 3 and st.sampled_at == 10.0


def test_unknown_without_sample():
    st = stats_from_sample(None)
    assert (st.kv_fill, st.deferred, st.tokens_per_s) == (None, None, None)
    view = WorkerStatsView(lambda wid: None)
    assert view.get("w0").kv_fill is None


def test_tokens_per_second_from_progress_between_samples():
    p = Progress()
    assert stats_from_sample(sample(at=10.0, progress=p)).tokens_per_s == 0.0
    later = sample(at=12.0, progress=p, decoded=250)  # 200 more tokens decoded in 2 s
    assert stats_from_sample(later).tokens_per_s == 100.0
