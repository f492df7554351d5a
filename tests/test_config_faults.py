"""Config sections added for faults and access: defaults, key-path errors, gateway.yaml."""

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

M = [{"name": "demo", "path": "builtin:demo"}]


def test_defaults_match_gateway_yaml():
    d = parse_config({"models": M})
    y = load_config(Path(__file__).resolve().parents[1] / "gateway.yaml")
    for section in ("timeouts", "limits", "auth", "http"):
        assert getattr(d, section) == getattr(y, section), section
    for k in ("liveness_interval_s", "liveness_timeout_s", "wedge_after_stalls", "leaked_slot_s",
              "crash_loop_restarts", "crash_loop_window_s", "failed_retry_s"):
        assert getattr(d.llama_server, k) == getattr(y.llama_server, k), k
    assert d.timeouts.inter_token_s == 60 and d.timeouts.header_read_s == 30
    assert d.limits.max_body_bytes == 64 * 2**20 and d.auth.keys == [] and d.http.cors_origins == []
    assert d.llama_server.crash_loop_restarts == 5 and d.llama_server.liveness_timeout_s == 5
    assert d.llama_server.leaked_slot_s == 60
    assert parse_config({"models": M, "llama_server": {"leaked_slot_s": 0}}).llama_server \
        .leaked_slot_s == 0  # off


def test_errors_name_key_paths():
    with pytest.raises(ConfigError) as e:
        parse_config({"models": M, "timeouts": {"inter_token_s": 0},
                      "limits": {"max_messages": "many", "max_body": 1},
                      "llama_server": {"crash_loop_window_s": -1, "leaked_slot_s": "1m"},
                      "http": {"cors_origins": "http://x"}})
    text = str(e.value)
    assert "timeouts.inter_token_s: expected a positive number, got 0" in text
    assert 'limits.max_messages: expected a positive integer, got "many"' in text
    assert 'limits.max_body: unknown key (did you mean "max_body_bytes"?)' in text
    assert "llama_server.crash_loop_window_s: expected a positive number, got -1" in text
    assert 'llama_server.leaked_slot_s: expected a number >= 0, got "1m"' in text
    assert "http.cors_origins: expected a list of origins" in text


def test_api_key_missing_name_or_digest_says_what_it_is():
    """An API key's ``name`` is a label, not a model name (a tester read "expected a model
    name" for it); a missing ``sha256`` says where the digest comes from."""
    for keys, text in (([{"sha256": "a" * 64}], 'auth.keys[0].name: required key is missing '
                                                '(expected a label for logs, like "webui")'),
                       ([{"name": "webui"}], "auth.keys[0].sha256: required key is missing "
                                             "(expected the key's SHA-256 hex digest")):
        with pytest.raises(ConfigError) as e:
            parse_config({"models": [{"name": "demo", "path": "builtin:demo"}], "auth": {"keys": keys}})
        assert text in str(e.value), str(e.value)


def test_settings_that_cannot_apply_are_errors_not_ignored():
    """``slots_per_gpu`` on a model of CPU workers was ignored without a word, and a ``-np`` /
    ``-c`` in ``args`` that is not a whole number passed check-config, then no worker could
    start (a fresh tester's finds). So did ``--parallel=3``, which llama-server refuses as an
    invalid argument while check-config read the 3. Whole numbers, as ``-np 2``, still pass."""
    with pytest.raises(ConfigError) as e:
        parse_config({"models": [
            {"name": "a", "path": "builtin:demo", "cpu": 1, "slots_per_gpu": {0: 8}},
            {"name": "b", "path": "builtin:demo", "cpu": 1,
             "args": ["-np", "abc", "-c=12x", "--parallel"]}]})
    text = str(e.value)
    assert "models[0].slots_per_gpu: applies to GPU workers, but this model runs 1 CPU " \
           "worker(s) (cpu: 1); set their slots with slots" in text
    assert 'models[1].args[0]: -np takes a whole number, got "abc"' in text
    assert "models[1].args[2]: llama-server takes a flag and its value as two items: '-c', " \
           "'12x' (it refuses '-c=12x' as an invalid argument)" in text
    assert "models[1].args[3]: --parallel takes a whole number, got null" in text
    with pytest.raises(ConfigError) as e:
        parse_config({"models": M, "llama_server": {"extra_args": ["--ctx-size", "big"]}})
    assert 'llama_server.extra_args[0]: --ctx-size takes a whole number, got "big"' in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config({"models": M, "llama_server": {"extra_args": ["--parallel=3", "-fa", "on",
                                                                   "--override-kv",
                                                                   "a.b=int:1"]}})
    assert str(e.value).splitlines() == [
        "<config>: llama_server.extra_args[0]: llama-server takes a flag and its value as two items: "
        "'--parallel', '3' (it refuses '--parallel=3' as an invalid argument)"]
    # an item before any flag: llama-server takes no positional argument ("invalid argument:
    # 5" at every start after check-config passed it; a fresh tester's find)
    for args in ([5], ["model.gguf", "-np", "2"]):
        with pytest.raises(ConfigError) as e:
            parse_config({"models": [{"name": "e", "path": "builtin:demo", "cpu": 1,
                                      "args": args}]})
        assert str(e.value).splitlines() == [
            f"<config>: models[0].args[0]: llama-server takes flags (and their values after "
            f"them), got {str(args[0])!r} before any flag"]
    ok = parse_config({"models": [{"name": "c", "path": "builtin:demo", "cpu": 1,
                                   "args": ["-np", "2", "-c", "1000", "--override-kv",
                                            "tokenizer.ggml.add_bos_token=bool:false"]},
                                  {"name": "d", "path": "builtin:demo", "slots_per_gpu": {0: 8}}]})
    assert ok.models[0].args[:4] == ["-np", "2", "-c", "1000"] and ok.models[1].slots_per_gpu == {0: 8}
