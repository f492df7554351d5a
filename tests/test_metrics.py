"""GPU metrics through a named fake NVML sample (no GPU here); status table formatting."""

from prometheus_client.parser import text_string_to_metric_families

from gateway.admin_client import status_table
from gateway.app import Gateway
from gateway.config import parse_config
from gateway.metrics import GatewayMetrics
from workers.gpu import GpuStats


def fake_nvml_sample():
    """Stands in for NVML on this GPU-less machine."""
    return {0: GpuStats(0, "Fake H100", 87, 40 * 2**30, 80 * 2**30, 66, 312.5)}


def test_gpu_metrics_from_nvml_sample():
    gw = Gateway(parse_config({"models": [{"name": "demo", "path": "builtin:demo", "priority": 2}]}))
    m = GatewayMetrics(gw, gpu_stats=fake_nvml_sample)
    vals = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    lab = (("gpu", "0"), ("name", "Fake H100"))
    assert vals[("llama_gateway_gpu_utilization_percent", lab)] == 87
    assert vals[("llama_gateway_gpu_memory_used_bytes", lab)] == 40 * 2**30
    assert vals[("llama_gateway_gpu_memory_total_bytes", lab)] == 80 * 2**30
    assert vals[("llama_gateway_gpu_temperature_celsius", lab)] == 66
    assert vals[("llama_gateway_gpu_power_watts", lab)] == 312.5
    assert vals[("llama_gateway_queue_depth", (("priority", "2"),))] == 0


def test_status_table():
    st = {"workers": [{"id": "m-gpu0", "gpus": [0], "state": "ready", "detail": "", "busy": 3,
                       "slots": 4, "kv_fill": 0.25, "deferred": 1, "tokens_per_s": 812.4,
                       "speed": 1.5, "restarts": 2, "gpu": fake_nvml_sample()[0].__dict__},
                      {"id": "m-cpu0", "gpus": [], "state": "backoff", "detail": "startup timeout after 2 s",
                       "busy": 0, "slots": 2, "kv_fill": None, "deferred": None,
                       "tokens_per_s": None, "restarts": 0, "gpu": None}],
          "queue": {"depth": 5, "max_pending": 512, "by_priority": {"0": 4, "5": 1}}, "in_flight": 8}
    lines = status_table(st).splitlines()
    assert lines[1].split() == ["m-gpu0", "0", "ready", "3/4", "25%", "1", "812.4", "1.50", "87%",
                                "40.0/80.0", "2"]
    assert lines[2].split()[-5:] == ["-", "1.00", "-", "-", "0"]  # no "speed" key: 1.0
    assert lines[2].split()[:3] == ["m-cpu0", "cpu", "backoff"]
    assert "(startup timeout after 2 s)" in lines[2] and lines[2].rstrip().endswith("0")
    assert lines[3] == "queue 5/512 (prio 0: 4, prio 5: 1); in flight 8"


def test_every_supervisor_state_has_a_worker_state_series():
    """A worker in a state missing from WORKER_STATES would show 0 for every state."""
    import inspect
    import re

    from gateway.metrics import WORKER_STATES
    from workers import supervisor

    set_states = set(re.findall(r'_set_state\("([a-z]+)"', inspect.getsource(supervisor)))
    assert {"starting", "ready", "backoff", "failed", "wedged", "stopped"} <= set_states
    assert set_states <= set(WORKER_STATES) and "draining" in WORKER_STATES


def test_usage_from_a_parsed_object_and_from_worker_bytes_agree():
    """The /v1 handlers note tokens from an already parsed ``usage`` (the folded answer, a
    parsed SSE event) or from raw worker bytes; both give the access record the same counts."""
    from gateway.metrics import note_openai_usage, note_usage

    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    parsed: dict = {}
    note_usage(parsed, usage)
    raw: dict = {}
    note_openai_usage(raw, b'data: {"choices": [], "usage": {"prompt_tokens": 7, '
                           b'"completion_tokens": 3, "total_tokens": 10}}\n\n')
    assert parsed == raw == {"prompt_eval_count": 7, "eval_count": 3}
    note_usage(parsed, None)  # no usage: the counts are unknown, not kept from before
    assert parsed == {"prompt_eval_count": None, "eval_count": None}
