"""Unit tests for gateway.config: loading, error messages, worker planning and plan diffs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from gateway.config import (
    ConfigError,
    GatewayConfig,
    WorkerPlan,
    diff_plans,
    fingerprint,
    load_config,
    parse_config,
    plan_workers,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO / "gateway.yaml"


def base(**model) -> dict:
    m = {"name": "demo", "path": "builtin:demo"}
    m.update(model)
    return {"models": [m]}


def errors_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(data)
    return ei.value.errors


# ---------------------------------------------------------------- default file


def test_default_yaml_loads():
    cfg = load_config(DEFAULT_YAML)
    assert isinstance(cfg, GatewayConfig)
    assert cfg.listen == "127.0.0.1:11434"
    assert (cfg.host, cfg.port) == ("127.0.0.1", 11434)
    assert cfg.llama_server.threads == 1
    (m,) = cfg.models
    assert m.name == "demo" and m.full_name == "demo:latest"
    assert m.is_builtin and m.path == "builtin:demo"
    assert (m.slots, m.context, m.gpus, m.cpu_fallback) == (2, 2048, "auto", 2)
    plans = plan_workers(cfg, [])
    assert [p.id for p in plans] == ["demo-cpu0", "demo-cpu1"]
    assert all(p.is_cpu and p.total_context == 4096 for p in plans)


def test_defaults():
    cfg = parse_config(base())
    assert cfg.llama_server.binary is None
    assert cfg.llama_server.backend == "auto"
    assert cfg.llama_server.startup_timeout_s == 180
    assert cfg.queue.max_pending == 512 and cfg.queue.retry_after_s == 2
    assert cfg.timeouts.first_byte_s == 300 and cfg.timeouts.request_s == 3600
    assert cfg.generation.num_predict_default == -1
    assert cfg.log.level == "info" and cfg.log.format == "auto"
    m = cfg.models[0]
    assert (m.slots, m.context, m.cpu, m.cpu_fallback, m.priority) == (4, 4096, None, 1, 0)
    assert m.aliases == [] and m.args == [] and m.slots_per_gpu == {} and m.embeddings is False


def test_frozen():
    cfg = parse_config(base())
    with pytest.raises(Exception):
        cfg.listen = "0.0.0.0:1"  # type: ignore[misc]
    with pytest.raises(Exception):
        cfg.models[0].slots = 9  # type: ignore[misc]


def test_null_section_means_defaults():
    cfg = parse_config({**base(), "queue": None})
    assert cfg.queue.max_pending == 512


# ---------------------------------------------------------------- error messages


def test_error_slots_four():
    assert errors_of(base(slots="four")) == ['models[0].slots: expected a positive integer, got "four"']


def test_error_args_that_the_gateway_sets_itself():
    """A ``--port`` in args won over the gateway's (llama-server takes the last): the worker
    never answered where the gateway looked, and a reload waited ``startup_timeout_s`` for it
    (a fresh tester's find). ``-np`` and ``-c`` stay the operator's to set."""
    why = ("is set by the gateway on every worker (it picks the host, port, API key, model and "
           "alias, and reads /slots over plain HTTP at the root path); remove it")
    assert errors_of({**base(args=["-np", "2", "--port", "1234", "--alias=x"]),
                      "llama_server": {"extra_args": ["--api-key", "k", "-m", "m.gguf"]}}) == [
        f"llama_server.extra_args[0]: --api-key {why}",
        f"llama_server.extra_args[2]: -m {why}",
        f"models[0].args[2]: --port {why}",
        f"models[0].args[4]: --alias {why}"]
    ok = parse_config(base(args=["-np", "2", "-c", "8192", "--cache-ram", 512]))
    assert ok.models[0].args == ["-np", "2", "-c", "8192", "--cache-ram", "512"]


def test_error_priority_outside_the_classes():
    """Priority classes are bounded (±1000): a class too large for a float broke the queue."""
    assert errors_of(base(priority=10 ** 20)) == [
        "models[0].priority: expected an integer from -1000 to 1000, got 100000000000000000000"]
    assert errors_of(base(priority=None)) == [
        "models[0].priority: expected an integer from -1000 to 1000, got null"]
    assert parse_config(base(priority=-1000)).models[0].priority == -1000


def test_error_key_for_a_model_that_is_not_configured():
    """A typo in an API key's ``models`` gave a key that could use nothing (a fresh tester's
    find); names and aliases, in Ollama's long forms too, are found."""
    key = {"name": "k", "sha256": "0" * 64}
    cfg = {**base(aliases=["d"]), "auth": {"keys": [{**key, "models": ["demo", "nosuch", "*"]}]}}
    assert errors_of(cfg) == ['auth.keys[0].models[1]: no model or alias named "nosuch" in models']
    ok = {**base(aliases=["d"]), "auth": {"keys": [{**key, "models": ["d", "library/demo:latest"]}]}}
    assert parse_config(ok).auth.keys[0].models == ["d", "library/demo:latest"]


def test_error_listen():
    assert errors_of({**base(), "listen": "nope"}) == ['listen: expected "host:port", got "nope"']


def test_error_max_pending():
    assert errors_of({**base(), "queue": {"max_pending": -1}}) == [
        "queue.max_pending: expected a non-negative integer, got -1"
    ]


def test_error_models_null():
    assert errors_of({"models": None}) == ["models: expected a list of models, got null"]


def test_error_models_empty_and_missing():
    assert errors_of({"models": []}) == ["models: expected at least one model, got []"]
    (err,) = errors_of({})
    assert err.startswith("models: required key is missing")


def test_unknown_key_suggestion():
    assert errors_of(base(slotz=4)) == ['models[0].slotz: unknown key (did you mean "slots"?)']
    assert errors_of({**base(), "queu": {}}) == ['queu: unknown key (did you mean "queue"?)']
    (err,) = errors_of({**base(), "llama_server": {"zzzz": 1}})
    assert err.startswith("llama_server.zzzz: unknown key (expected one of: binary, backend")


def test_bool_is_not_int():
    assert errors_of(base(slots=True)) == ["models[0].slots: expected a positive integer, got true"]
    assert errors_of(base(priority=False)) == [
        "models[0].priority: expected an integer from -1000 to 1000, got false"]
    assert errors_of({**base(), "queue": {"timeout_s": True}}) == [
        "queue.timeout_s: expected a positive number, got true"
    ]


def test_other_type_errors():
    assert errors_of({**base(), "log": {"level": "loud"}}) == [
        'log.level: expected one of "debug", "info", "warning", "error", got "loud"'
    ]
    assert errors_of(base(embeddings="yes")) == ['models[0].embeddings: expected true or false, got "yes"']
    assert errors_of(base(args=["-c", True])) == [
        'models[0].args[1]: expected a string, got true (YAML reads an unquoted on, off, yes, no, '
        'true or false as a boolean: quote it, e.g. "on")']
    assert errors_of(base(args=["-c", None])) == ["models[0].args[1]: expected a string, got null"]
    assert parse_config(base(args=["-c", 4096])).models[0].args == ["-c", "4096"]
    assert errors_of({"models": ["demo"]}) == ['models[0]: expected a mapping, got "demo"']
    assert errors_of(base(name="bad name")) == [
        'models[0].name: expected a model name like "demo", "demo:latest" or "ns/demo:7b", got "bad name"'
    ]
    assert errors_of(base(slots="four", context=0)) == [
        'models[0].slots: expected a positive integer, got "four"',
        "models[0].context: expected a positive integer, got 0",
    ]


def test_a_number_yaml_read_as_text_is_named_as_such():
    """PyYAML (YAML 1.1) reads ``1e-3`` (no dot) and quoted numbers as strings: the error says
    so and how to write the number, instead of a bare "got \"1e-3\"" (found by a tester)."""
    data = yaml.safe_load("models: [{name: demo, path: 'builtin:demo'}]\n"
                          "scheduler: {prefill_weight: 1e-3, kv_weight: '0.5'}")
    assert errors_of(data) == [
        'scheduler.kv_weight: expected a number >= 0, got the text "0.5" (YAML reads a quoted '
        "number, and an exponent without a dot such as 1e-3, as text: write the number unquoted, "
        "e.g. 10, 0.001 or 1.0e-3)",
        'scheduler.prefill_weight: expected a number >= 0, got the text "1e-3" (YAML reads a '
        "quoted number, and an exponent without a dot such as 1e-3, as text: write the number "
        "unquoted, e.g. 10, 0.001 or 1.0e-3)",
    ]
    assert parse_config(yaml.safe_load("models: [{name: demo, path: 'builtin:demo'}]\n"
                                       "scheduler: {prefill_weight: 1.0e-3}")
                        ).scheduler.prefill_weight == 0.001
    # "inf" is text too, but no way of writing it is accepted: no hint
    assert errors_of(yaml.safe_load("models: [{name: demo, path: 'builtin:demo'}]\n"
                                    "scheduler: {kv_weight: inf}")) == [
        'scheduler.kv_weight: expected a number >= 0, got "inf"']


def test_str_prefixed_with_source(tmp_path):
    p = tmp_path / "gw.yaml"
    p.write_text("models:\n  - name: demo\n    path: builtin:demo\n    slots: four\n    slotz: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value).splitlines() == [
        f'{p}: models[0].slots: expected a positive integer, got "four"',
        f'{p}: models[0].slotz: unknown key (did you mean "slots"?)',
    ]


def test_missing_file_and_yaml_syntax(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "nope.yaml")
    assert ei.value.errors == ["file not found"]
    p = tmp_path / "bad.yaml"
    p.write_text("models:\n  - name: demo\n   path: x\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.errors[0].startswith("line 3, column ")
    assert "invalid YAML" in ei.value.errors[0]


def test_yaml_duplicate_key(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("models:\n  - name: demo\n    path: builtin:demo\n    slots: 2\n    slots: 3\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.errors == ['line 5, column 5: invalid YAML: duplicate key "slots"']


def test_listen_variants():
    cfg = parse_config({**base(), "listen": "[::1]:8080"})
    assert (cfg.host, cfg.port) == ("::1", 8080)
    cfg = parse_config({**base(), "listen": "0.0.0.0:0"})
    assert cfg.port == 0
    (err,) = errors_of({**base(), "listen": "h:70000"})
    assert err.startswith('listen: expected "host:port" with a port')
    assert errors_of({**base(), "listen": 11434}) == ['listen: expected "host:port", got 11434']


# ---------------------------------------------------------------- names and paths


def test_names_and_duplicates():
    m = parse_config(base(name="ns/demo:7b")).models[0]
    assert m.full_name == "ns/demo:7b"
    data = {
        "models": [
            {"name": "demo", "path": "builtin:demo"},
            {"name": "Demo:latest", "path": "builtin:demo"},
        ]
    }
    assert errors_of(data) == [
        'models[1].name: duplicate model name "Demo:latest" (already used by models[0].name)'
    ]
    # Ollama's default host and namespace name the same model (a request for either reaches it)
    data = {"models": [{"name": "demo", "path": "builtin:demo"},
                       {"name": "other", "path": "builtin:demo",
                        "aliases": ["registry.ollama.ai/library/demo"]}]}
    assert errors_of(data) == ['models[1].aliases[0]: duplicate model name '
                               '"registry.ollama.ai/library/demo:latest" (already used by models[0].name)']
    data = {
        "models": [
            {"name": "demo", "path": "builtin:demo", "aliases": ["tiny"]},
            {"name": "other", "path": "builtin:demo", "aliases": ["tiny:latest"]},
        ]
    }
    assert errors_of(data) == [
        'models[1].aliases[0]: duplicate model name "tiny:latest" (already used by models[0].aliases[0])'
    ]


def test_find_model():
    cfg = parse_config(base(aliases=["tiny"]))
    assert cfg.find_model("DEMO") is cfg.models[0]
    assert cfg.find_model("tiny:latest") is cfg.models[0]
    assert cfg.find_model("demo:7b") is None


def test_builtin_vs_missing_file(tmp_path):
    assert parse_config(base()).models[0].is_builtin
    missing = tmp_path / "y.gguf"
    assert errors_of(base(path=str(missing))) == [f"models[0].path: file not found: {missing}"]
    real = tmp_path / "m.gguf"
    real.write_bytes(b"GGUF")
    m = parse_config(base(path=str(real))).models[0]
    assert not m.is_builtin and m.path == str(real)
    (err,) = errors_of(base(path="builtin:nope"))
    assert err.startswith('models[0].path: unknown builtin model "nope"')


def test_relative_path_resolved_against_config_dir(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    p = tmp_path / "gw.yaml"
    p.write_text("models:\n  - name: m\n    path: m.gguf\n")
    assert load_config(p).models[0].path == str(tmp_path / "m.gguf")


def test_cpu_and_gpus_conflict_and_gpu_groups():
    (err,) = errors_of(base(cpu=2, gpus=[0]))
    assert err.startswith("models[0].cpu: cannot be combined with gpus")
    (err,) = errors_of(base(gpus=[[0, 1], [1, 2]]))
    assert err.startswith("models[0].gpus[1][0]: GPU 1 is already used by gpus[0][1]")
    (err,) = errors_of(base(gpus=[0, -1]))
    assert err == "models[0].gpus[1]: expected a GPU index (a non-negative integer), got -1"
    assert errors_of(base(slots_per_gpu={0: 0})) == ["models[0].slots_per_gpu[0]: expected a positive integer, got 0"]


# ---------------------------------------------------------------- plan_workers


def ids(plans: list[WorkerPlan]) -> list[str]:
    return [p.id for p in plans]


def test_plan_auto_with_gpus():
    cfg = parse_config(base(slots=3, context=1000))
    plans = plan_workers(cfg, [0, 1, 2, 3])
    assert ids(plans) == ["demo-gpu0", "demo-gpu1", "demo-gpu2", "demo-gpu3"]
    assert plans[2] == WorkerPlan("demo-gpu2", "demo:latest", (2,), 3, 1000)
    assert plans[0].total_context == 3000 and not plans[0].is_cpu


def test_plan_auto_without_gpus_uses_cpu_fallback():
    plans = plan_workers(parse_config(base(cpu_fallback=3)), [])
    assert ids(plans) == ["demo-cpu0", "demo-cpu1", "demo-cpu2"]
    assert all(p.is_cpu and p.gpus == () for p in plans)
    assert plan_workers(parse_config(base(cpu_fallback=0)), []) == []


def test_plan_explicit_groups_and_names():
    cfg = parse_config(base(name="ns/demo:7b", gpus=[[0, 1], [2, 3]]))
    plans = plan_workers(cfg, [0, 1, 2, 3])
    assert ids(plans) == ["ns_demo-7b-gpu0+1", "ns_demo-7b-gpu2+3"]
    assert plans[1].gpus == (2, 3) and plans[1].model == "ns/demo:7b"
    plans = plan_workers(parse_config(base(gpus=[1, 3])), [0, 1, 2, 3])
    assert ids(plans) == ["demo-gpu1", "demo-gpu3"]


def test_plan_slots_per_gpu_override():
    cfg = parse_config(base(slots=4, slots_per_gpu={0: 8, 2: 6}))
    assert [p.slots for p in plan_workers(cfg, [0, 1])] == [8, 4]
    cfg = parse_config(base(slots=4, slots_per_gpu={2: 6}, gpus=[[2, 3], [0, 1]]))
    assert [p.slots for p in plan_workers(cfg, [0, 1, 2, 3])] == [6, 4]


def test_plan_cpu_n():
    cfg = parse_config(base(cpu=2))
    plans = plan_workers(cfg, [0, 1])
    assert ids(plans) == ["demo-cpu0", "demo-cpu1"]
    assert all(p.is_cpu for p in plans)


def test_plan_missing_gpu():
    cfg = parse_config(base(gpus=[0, 3]))
    with pytest.raises(ConfigError) as ei:
        plan_workers(cfg, [0, 1])
    assert ei.value.errors == ["models[0].gpus: GPU 3 not found (found: 0, 1)"]
    with pytest.raises(ConfigError) as ei:
        plan_workers(cfg, [])
    assert "no NVIDIA GPU detected" in ei.value.errors[0]


# ---------------------------------------------------------------- diff_plans


def test_diff_plans(tmp_path):
    data = {
        "models": [
            {"name": "demo", "path": "builtin:demo", "slots": 2},
            {"name": "other", "path": "builtin:demo", "cpu": 2},
        ]
    }
    old_cfg = parse_config(data)
    old = plan_workers(old_cfg, [0, 1])

    same = diff_plans(old, plan_workers(old_cfg, [0, 1]), old_cfg, old_cfg)
    assert ids(same.unchanged) == ids(old) and not same.has_changes

    d2 = copy.deepcopy(data)
    d2["models"][0]["slots"] = 3  # every demo worker changes
    d2["models"][1]["cpu"] = 1  # other-cpu1 goes away, other-cpu0 stays
    d2["models"].append({"name": "new", "path": "builtin:demo", "cpu": 1})
    new_cfg = parse_config(d2)
    new = plan_workers(new_cfg, [0, 1])
    diff = diff_plans(old, new, old_cfg, new_cfg)
    assert ids(diff.changed) == ["demo-gpu0", "demo-gpu1"]
    assert ids(diff.unchanged) == ["other-cpu0"]
    assert ids(diff.added) == ["new-cpu0"]
    assert ids(diff.removed) == ["other-cpu1"]
    assert diff.changed[0].slots == 3


def test_diff_plans_model_settings_count(tmp_path):
    f = tmp_path / "a.gguf"
    f.write_bytes(b"GGUF")
    old_cfg = parse_config(base(cpu=1))
    new_cfg = parse_config(base(cpu=1, path=str(f)))
    old, new = plan_workers(old_cfg, []), plan_workers(new_cfg, [])
    assert old == new
    assert ids(diff_plans(old, new, old_cfg, new_cfg).changed) == ["demo-cpu0"]
    args_cfg = parse_config(base(cpu=1, args=["--foo"]))
    assert ids(diff_plans(old, new, old_cfg, args_cfg).changed) == ["demo-cpu0"]
    ls_cfg = parse_config({**base(cpu=1), "llama_server": {"extra_args": ["-x"]}})
    assert ids(diff_plans(old, new, old_cfg, ls_cfg).changed) == ["demo-cpu0"]
    thr_cfg = parse_config({**base(cpu=1), "llama_server": {"threads": 3}})
    assert ids(diff_plans(old, new, old_cfg, thr_cfg).changed) == ["demo-cpu0"]


def test_diff_plans_compares_contexts_after_the_training_context_cap():
    """A reload between two contexts above the model's training context starts the same
    command line (``-c`` is slots x the capped context): nothing restarts. Below the cap, or
    with the training context unknown, a new context is a change."""
    def diff(before: int, after: int, trained: dict | None):
        old_cfg = parse_config(base(cpu=1, context=before))
        new_cfg = parse_config(base(cpu=1, context=after))
        return diff_plans(plan_workers(old_cfg, []), plan_workers(new_cfg, []), old_cfg, new_cfg,
                          trained=trained)

    trained = {"demo:latest": 2048}
    assert ids(diff(4096, 8192, trained).unchanged) == ["demo-cpu0"]
    assert ids(diff(2048, 8192, trained).unchanged) == ["demo-cpu0"]
    assert ids(diff(1024, 8192, trained).changed) == ["demo-cpu0"]  # 1,024 -> 2,048 per slot
    assert ids(diff(1024, 1536, trained).changed) == ["demo-cpu0"]
    assert ids(diff(4096, 8192, None).changed) == ["demo-cpu0"]  # unknown: not capped
    assert ids(diff(4096, 8192, {"demo:latest": 0}).changed) == ["demo-cpu0"]
    # the process's own record (the fleet's ``launched``) is compared the same way
    cfg = parse_config(base(cpu=1, context=4096))
    (plan,) = plan_workers(cfg, [])
    assert fingerprint(plan, cfg, 2048) == fingerprint(
        plan_workers(parse_config(base(cpu=1, context=8192)), [])[0],
        parse_config(base(cpu=1, context=8192)), 2048)


def test_worker_id_clash():
    data = {"models": [{"name": "demo:7b", "path": "builtin:demo"}, {"name": "demo-7b", "path": "builtin:demo"}]}
    (err,) = errors_of(data)
    assert err.startswith('models[1].name: worker ids "demo-7b" would clash with those of models[0]')


def test_shutdown_and_admin_sections():
    from gateway.config import ConfigError, parse_config
    base = {"models": [{"name": "demo", "path": "builtin:demo"}]}
    c = parse_config(base)
    assert c.shutdown.drain_s == 30.0 and c.admin.token is None
    c = parse_config({**base, "shutdown": {"drain_s": 5}, "admin": {"token": "~tok"}})
    assert c.shutdown.drain_s == 5.0 and c.admin.token == "~tok"  # a token is not a path
    for bad, msg in [({"shutdown": {"drain_s": 0}}, "shutdown.drain_s: expected a positive number, got 0"),
                     ({"admin": {"token": ""}}, "admin.token: expected a non-empty string or null"),
                     ({"shutdown": {"drain": 1}}, 'shutdown.drain: unknown key (did you mean "drain_s"?)')]:
        with pytest.raises(ConfigError) as e:
            parse_config({**base, **bad})
        assert msg in str(e.value)


def test_auth_metrics_public():
    base = {"models": [{"name": "demo", "path": "builtin:demo"}]}
    assert parse_config(base).auth.metrics_public is False
    assert parse_config({**base, "auth": {"metrics_public": True}}).auth.metrics_public is True
    assert errors_of({**base, "auth": {"metrics_public": "yes"}}) == [
        'auth.metrics_public: expected true or false, got "yes"']
    assert errors_of({**base, "auth": {"metrics_publik": True}}) == [
        'auth.metrics_publik: unknown key (did you mean "metrics_public"?)']


def test_affinity_wait_settings():
    """Delay scheduling is off by default; its settings are numbers >= 0 and reach the scorer
    that Fleet.apply_scheduler builds (at start and on reload)."""
    import time
    from types import SimpleNamespace

    from gateway.fleet import Fleet
    from gateway.scheduling import Dispatcher
    from gateway.speed import SpeedBoard
    base = "models: [{name: demo, path: 'builtin:demo'}]\n"
    sc = parse_config(yaml.safe_load(base)).scheduler
    assert (sc.affinity_wait_ms_per_1k_tokens, sc.affinity_wait_max_s) == (0.0, 1.0)
    sc = parse_config(yaml.safe_load(base + "scheduler: {affinity_wait_ms_per_1k_tokens: 125, "
                                            "affinity_wait_max_s: 0.5}")).scheduler
    fleet = SimpleNamespace(admission=SimpleNamespace(dispatcher=Dispatcher(time.monotonic)),
                            pollers={}, speeds=SpeedBoard(), _apply_speeds=lambda speeds: None)
    Fleet.apply_scheduler(fleet, sc)
    scorer = fleet.admission.dispatcher.scorer
    assert (scorer.wait_s_per_token, scorer.wait_max_s) == (125 / 1e6, 0.5)
    assert errors_of(yaml.safe_load(base + "scheduler: {affinity_wait_ms_per_1k_tokens: -1}")) == [
        "scheduler.affinity_wait_ms_per_1k_tokens: expected a number >= 0, got -1"]


def test_context_times_slots_must_fit_llama_servers_int():
    """llama-server reads -c with std::stoi: a config past it was accepted (check-config printed
    a capped context) and its workers exited at start (a fresh tester's find)."""
    assert errors_of(base(slots=2, context=3_000_000_000)) == [
        "models[0].context: slots × context is 2 × 3000000000 = 6000000000 tokens, more than "
        "llama-server's -c takes (2147483647)"]
    assert parse_config(base(slots=1, context=2**31 - 1)).models[0].context == 2**31 - 1


def test_slots_past_llama_cpps_sequence_limit_are_refused():
    """llama.cpp refuses more than 256 sequences per context: a worker with ``slots: 1000``
    passed check-config and exited at start (``n_seq_max must be <= 256``; this session's
    find, checked on the pinned llama-server, which at ``-np 100000`` aborts making threads)."""
    msg = ("{n} slots per worker is more than llama.cpp's 256 sequences per context "
           "(LLAMA_MAX_SEQ; its workers exit at start: n_seq_max must be <= 256)")
    assert errors_of(base(slots=257, context=512)) == ["models[0].slots: " + msg.format(n=257)]
    assert errors_of(base(slots_per_gpu={1: 300}, context=512)) == [
        "models[0].slots_per_gpu: " + msg.format(n=300)]
    assert errors_of(base(args=["-np", "1000"], context=512)) == [
        "models[0].args: -np 1000 is more than llama.cpp's 256 sequences per context "
        "(LLAMA_MAX_SEQ; its workers exit at start)"]
    assert parse_config(base(slots=256, context=512)).models[0].slots == 256


def test_polling_intervals_have_a_floor():
    """``poll_interval_s: 1e-9`` passed check-config, and the gateway would poll each worker
    without pause; the floor is 10 ms."""
    for section, key in (("scheduler", "poll_interval_s"), ("llama_server", "health_interval_s"),
                         ("llama_server", "liveness_interval_s")):
        data = {**base(), section: {key: 0.001}}
        assert errors_of(data) == [
            f"{section}.{key}: expected a number of seconds of at least 0.01 (10 ms), got 0.001"]
        data[section][key] = 0.01
        assert getattr(getattr(parse_config(data), section), key) == 0.01


def test_restart_backoff_may_not_start_above_its_maximum():
    """An initial restart delay above the maximum passed check-config (a fresh tester's find)."""
    assert errors_of({**base(), "llama_server": {"restart_backoff_initial_s": 60}}) == [
        "llama_server.restart_backoff_initial_s: 60 s is more than restart_backoff_max_s "
        "(30 s), the most a restart delay grows to"]
    assert parse_config({**base(), "llama_server": {"restart_backoff_initial_s": 30}})
