"""Unit tests of the Ollama request/response mapping (no workers needed)."""

import math
from pathlib import Path

import pytest

from gateway.api.embeddings import normalize
from gateway.api.errors import ApiError
from gateway.api.ollama_mapping import (
    CONTEXT_OVERFLOW_MESSAGE,
    StreamState,
    format_fields,
    map_options,
    parse_go_duration,
    parse_keep_alive,
    parse_logprobs,
    parse_think,
    tool_call_out,
)
from gateway.inventory import Inventory, ModelEntry, cached_sha256, capabilities, full_name


def test_every_sampling_option_sent_with_ollama_defaults():
    out = map_options(None, num_predict_default=-1, num_predict_max=None)
    assert out == {"n_keep": 4, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
                   "repeat_last_n": 64, "temperature": 0.8, "repeat_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "n_predict": -1}


def test_options_override_and_rename():
    opts = {"num_predict": 7, "temperature": 0, "top_k": 3, "top_p": 0.5, "min_p": 0.1,
            "typical_p": 0.7, "repeat_last_n": 8, "repeat_penalty": 1.2, "presence_penalty": 0.3,
            "frequency_penalty": 0.4, "seed": 42, "stop": ["x", "y"], "num_keep": 2}
    out = map_options(opts, num_predict_default=-1, num_predict_max=None)
    assert out == {"n_predict": 7, "temperature": 0.0, "top_k": 3, "top_p": 0.5, "min_p": 0.1,
                   "typical_p": 0.7, "repeat_last_n": 8, "repeat_penalty": 1.2,
                   "presence_penalty": 0.3, "frequency_penalty": 0.4, "seed": 42,
                   "stop": ["x", "y"], "n_keep": 2}


def test_num_predict_default_and_cap():
    assert map_options({}, num_predict_default=64, num_predict_max=None)["n_predict"] == 64
    assert map_options({"num_predict": 500}, num_predict_default=-1, num_predict_max=100)["n_predict"] == 100
    assert map_options({"num_predict": -1}, num_predict_default=-1, num_predict_max=100)["n_predict"] == 100
    assert map_options({"num_predict": 5}, num_predict_default=-1, num_predict_max=100)["n_predict"] == 5


def test_num_predict_0_is_no_limit_as_in_ollamas_runners():
    """Ollama stops only at ``numPredict > 0 && numPredicted >= numPredict``; llama-server made
    1 token of n_predict 0 (a fresh tester's find)."""
    assert map_options({"num_predict": 0}, num_predict_default=64, num_predict_max=None)["n_predict"] == -1
    assert map_options({"num_predict": 0}, num_predict_default=-1, num_predict_max=100)["n_predict"] == 100


def test_unknown_options_ignored_and_reported():
    ignored = []
    out = map_options({"mirostat": 0, "tfs_z": 1.0, "num_ctx": 4096, "top_k": None},
                      num_predict_default=-1, num_predict_max=None, ignored=ignored)
    assert sorted(ignored) == ["mirostat", "tfs_z"]
    assert "mirostat" not in out and "num_ctx" not in out and out["top_k"] == 40


@pytest.mark.parametrize("opts,msg", [
    ({"top_k": "a"}, 'option "top_k" must be of type integer'),
    ({"temperature": True}, 'option "temperature" must be of type float'),
    ({"stop": [1]}, 'option "stop" must be of type array of strings'),
    ({"stop": "a"}, 'option "stop" must be of type array of strings'),  # as Ollama: no string
])
def test_wrong_option_type_is_400(opts, msg):
    with pytest.raises(ApiError) as e:
        map_options(opts, num_predict_default=-1, num_predict_max=None)
    assert (e.value.status, e.value.message) == (400, msg)


@pytest.mark.parametrize("text,secs", [("5m", 300), ("1h30m", 5400), ("0", 0), ("-1s", -1),
                                       ("1.5s", 1.5), ("300ms", 0.3), ("2h45m30s", 9930),
                                       (".5s", 0.5), ("5.s", 5), ("2562047h", 2562047 * 3600)])
def test_go_durations(text, secs):
    assert parse_go_duration(text) == pytest.approx(secs)


def test_keep_alive_values():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(60) == 60.0 and parse_keep_alive(-1) == -1.0
    assert parse_keep_alive("10m") == 600.0
    for bad in ("5 min", "abc", True, [1], {"a": 1}):
        with pytest.raises(ApiError) as e:
            parse_keep_alive(bad)
        assert e.value.status == 400 and "keep_alive" in e.value.message
    # Go's own words for a number without a unit (it said "invalid duration"; a fresh tester's
    # find); "0" needs none
    with pytest.raises(ApiError) as e:
        parse_keep_alive("10")
    assert e.value.message == 'invalid keep_alive: time: missing unit in duration "10"'
    assert parse_keep_alive("0") == 0.0
    # whole seconds for numbers (Ollama: int(t) * time.Second) and whole nanoseconds for
    # strings (Go's Duration), so 0.5 and "0.1ns" are 0: unload (a tester's find)
    assert (parse_keep_alive(0.5), parse_keep_alive(1.7), parse_keep_alive(-0.5)) == (0, 1, -0.5)
    assert parse_keep_alive("0.1ns") == 0 and parse_keep_alive("1.5ns") == 1e-9
    # past Go's int64 nanoseconds (2562047h47m16.854775807s) ParseDuration refuses it, and so
    # Ollama does; a negative one too (forever is any negative, not an overflow)
    for long in ("9999999h", "2562048h", "-9999999h", "."):
        with pytest.raises(ApiError) as e:
            parse_keep_alive(long)
        assert e.value.message == f'invalid keep_alive: time: invalid duration "{long}"'


def test_think_values():
    assert parse_think(True) is True and parse_think(False) is False and parse_think(None) is None
    for lvl in ("low", "medium", "high", "max"):
        assert parse_think(lvl) == lvl
    for bad in ("maybe", 1, ["x"]):
        with pytest.raises(ApiError) as e:
            parse_think(bad)
        assert e.value.status == 400 and e.value.message.startswith("invalid think value")


def test_top_logprobs_bounds():
    assert parse_logprobs({"logprobs": True, "top_logprobs": 20}) == (True, 20)
    assert parse_logprobs({}) == (False, 0)
    for bad in (21, -1, "3"):
        with pytest.raises(ApiError) as e:
            parse_logprobs({"top_logprobs": bad})
        assert e.value.message == "top_logprobs must be between 0 and 20"


def test_format_mapping():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert format_fields("json", chat=True) == {"response_format": {"type": "json_object"}}
    assert format_fields("json", chat=False) == {"json_schema": {}}
    assert format_fields(schema, chat=False) == {"json_schema": schema}
    assert format_fields(schema, chat=True)["response_format"]["json_schema"]["schema"] == schema
    assert format_fields(None, chat=True) == {} and format_fields("", chat=False) == {}
    with pytest.raises(ApiError) as e:
        format_fields("yaml", chat=True)
    assert e.value.message.startswith('invalid format: "yaml"; expected "json"')


def test_streamed_tool_call_fragments_become_object_arguments():
    st = StreamState(t_start_ns=0)
    for frag in ({"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"ci'}},
                 {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}):
        st.fold_chat({"choices": [{"delta": {"tool_calls": [frag]}, "finish_reason": None}]})
    st.fold_chat({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert st.done_reason == "stop"
    assert tool_call_out(0, st.tool_calls[0]) == {
        "id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}
    assert tool_call_out(0, {"name": "f", "arguments": "[1]"})["function"]["arguments"] == {"_raw": "[1]"}


def test_stop_type_gives_done_reason():
    for stop_type, reason in (("limit", "length"), ("eos", "stop"), ("word", "stop")):
        st = StreamState(t_start_ns=0)
        st.fold_completion({"content": "", "stop": True, "stop_type": stop_type, "timings": {}})
        assert st.done_reason == reason


def test_overflow_event_becomes_ollama_400_text():
    st = StreamState(t_start_ns=0)
    st.fold_chat({"error": {"code": 400, "type": "exceed_context_size_error", "message": "too long"}})
    assert (st.error, st.error_status) == (CONTEXT_OVERFLOW_MESSAGE, 400)


def test_error_events_that_are_the_requests_fault_are_400_on_ollama_routes():
    """A grammar dead end came as a 500 on /api while /v1 answered it 400 (a fresh tester's
    find); a 500 that is not the request's fault stays 500."""
    dead_end = "got exception: Unexpected empty grammar stack after accepting piece: x"
    for fold in ("fold_chat", "fold_completion"):
        st = StreamState(t_start_ns=0)
        getattr(st, fold)({"error": {"code": 500, "message": dead_end, "type": "server_error"}})
        assert st.error_status == 400 and st.error.endswith("llama-server: " + dead_end)
        st = StreamState(t_start_ns=0)
        getattr(st, fold)({"error": {"code": 500, "message": "got exception: out of memory"}})
        assert (st.error, st.error_status) == ("got exception: out of memory", 500)


def test_metrics_are_integer_ns_from_worker_timings():
    st = StreamState(t_start_ns=1)
    st.t_loaded_ns = 2
    st.fold_completion({"stop": True, "stop_type": "limit", "timings": {
        "prompt_n": 10, "cache_n": 3, "prompt_ms": 1.5, "predicted_n": 5, "predicted_ms": 2.25}})
    m = st.metrics()
    assert m["prompt_eval_count"] == 13 and m["eval_count"] == 5
    assert m["prompt_eval_duration"] == 1_500_000 and m["eval_duration"] == 2_250_000
    assert all(isinstance(v, int) and v > 0 for v in m.values())


def test_capabilities_from_template_vocab_and_config():
    assert capabilities(embeddings=True, template="tools", has_fim=True, vision=True) == ["embedding"]
    assert capabilities(embeddings=False, template="", has_fim=False, vision=False) == ["completion"]
    assert capabilities(embeddings=False, template="{% if tools %}<think>", has_fim=True,
                        vision=True) == ["completion", "tools", "insert", "vision", "thinking"]


def test_names_resolve_like_ollama():
    assert full_name("demo") == "demo:latest" and full_name("ns/demo:7b") == "ns/demo:7b"
    inv = Inventory([ModelEntry("demo:latest", Path("d"), aliases=("ns/other:7b",))])
    demo = inv.entries[0]
    # Ollama's default host and namespace (types/model/name.go), any case, and an alias
    for name in ("demo", "DEMO:latest", "library/demo", "registry.ollama.ai/library/demo",
                 "registry.ollama.ai/library/demo:latest", "ns/other:7b", "NS/Other:7B"):
        assert inv.resolve(name) is demo, name
    # a namespace other than library keeps it, with or without the default host
    assert inv.resolve("registry.ollama.ai/ns/other:7b") is demo
    for name in ("demo:7b", "registry.ollama.ai/demo", "other/demo", "library/ns/other:7b",
                 "registry.ollama.ai/ns/other", "example.com/library/demo", "", None):
        assert inv.resolve(name) is None, name


def test_digest_cached_by_path_size_mtime(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    cache = tmp_path / "digests.json"
    d1 = cached_sha256(f, cache)
    assert d1 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert d1 in cache.read_text()
    # A cached entry is used as is: prove it by planting a value for the same key.
    import json
    data = json.loads(cache.read_text())
    key = next(iter(data))
    data[key] = "planted"
    cache.write_text(json.dumps(data))
    assert cached_sha256(f, cache) == "planted"
    f.write_bytes(b"abcd")  # size changes: rehashed
    assert cached_sha256(f, cache) == "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"


def test_normalize_and_dimensions():
    v = normalize([3.0, 4.0, 12.0])
    assert math.isclose(sum(x * x for x in v), 1.0)
    w = normalize([3.0, 4.0, 12.0], dimensions=2)
    assert w == pytest.approx([0.6, 0.8])
    assert normalize([0.0, 0.0]) == [0.0, 0.0]


@pytest.mark.parametrize("opts", [{"num_predict": 1e30}, {"seed": 18446744073709551616},
                                  {"top_k": -1e30}, {"num_keep": 2 ** 63}])
def test_integer_options_beyond_64_bits_are_400(opts):
    """New-user finding: these gave 500 (orjson 'Integer exceeds 64-bit range')."""
    with pytest.raises(ApiError) as e:
        map_options(opts, num_predict_default=-1, num_predict_max=None)
    assert e.value.status == 400
    assert e.value.message == f'option "{next(iter(opts))}" is out of range for a 64-bit integer'
