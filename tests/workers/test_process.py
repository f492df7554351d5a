"""workers/process.py: the launch command line, environment, and worker log routing."""

import asyncio
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from workers.process import QUIET_LOG_VERBOSITY, LaunchSpec, WorkerProcess, reap_stale_workers
from workers.provision import ensure_llama_server


def spec(**kw):
    base = dict(worker_id="m-gpu1", binary=Path("/bin/true"), model_path=Path("/m.gguf"),
                alias="m:latest", gpus=(1, 3), slots=4, context_per_slot=2048)
    base.update(kw)
    return LaunchSpec(**base)


def test_argv_pins_slots_context_metrics_and_no_key():
    argv = spec(extra_args=["--flash-attn", "on"]).argv(5555)
    assert argv[argv.index("-np") + 1] == "4"
    assert argv[argv.index("-c") + 1] == str(4 * 2048)
    assert "--metrics" in argv and argv[argv.index("--port") + 1] == "5555"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[-2:] == ["--flash-attn", "on"]
    assert not any("key" in a for a in argv)  # the key never appears on the command line


def test_env_pins_gpus_and_carries_key():
    env = spec().env("sekrit")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert env["LLAMA_API_KEY"] == "sekrit"
    assert spec(gpus=()).env("k")["CUDA_VISIBLE_DEVICES"] == ""


def test_env_numbers_gpus_as_nvml_does_whatever_the_environment_says(monkeypatch):
    """The config's GPU indices are NVML's (PCI bus order); CUDA's default order is fastest
    first, so without CUDA_DEVICE_ORDER a mixed box ran worker "gpu0" on another card."""
    assert spec().env("k")["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    assert spec().env("k")["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_gpu_label_names_gpus_or_cpu():
    assert spec().gpu_label == "1,3" and spec(gpus=(0,)).gpu_label == "0"
    assert spec(gpus=()).gpu_label == "cpu"


def test_env_turns_idle_slot_caching_off_unless_the_operator_set_it(monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_CACHE_IDLE_SLOTS", raising=False)
    assert spec().env("k")["LLAMA_ARG_CACHE_IDLE_SLOTS"] == "0"
    monkeypatch.setenv("LLAMA_ARG_CACHE_IDLE_SLOTS", "1")
    assert spec().env("k")["LLAMA_ARG_CACHE_IDLE_SLOTS"] == "1"


def test_env_sets_log_verbosity_when_given_unless_the_operator_set_it(monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    assert "LLAMA_ARG_LOG_VERBOSITY" not in spec().env("k")
    assert spec(log_verbosity=QUIET_LOG_VERBOSITY).env("k")["LLAMA_ARG_LOG_VERBOSITY"] == "2"
    # an operator's -lv in args: no variable beside it (llama-server would warn at every start
    # that the variable is overwritten by the command line; a fresh tester saw that warning)
    assert "LLAMA_ARG_LOG_VERBOSITY" not in spec(
        log_verbosity=QUIET_LOG_VERBOSITY, extra_args=["-lv", "4"]).env("k")
    monkeypatch.setenv("LLAMA_ARG_LOG_VERBOSITY", "4")
    assert spec(log_verbosity=QUIET_LOG_VERBOSITY).env("k")["LLAMA_ARG_LOG_VERBOSITY"] == "4"


def test_operator_verbosity_is_a_verbosity_flag_in_args_or_the_variable(monkeypatch):
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    assert not spec(extra_args=["--alias", "x", "-t", "4"]).operator_verbosity
    assert all(spec(extra_args=[flag, "4"]).operator_verbosity
               for flag in ("-lv", "--verbosity", "--log-verbosity"))
    assert spec(extra_args=["-v"]).operator_verbosity
    monkeypatch.setenv("LLAMA_ARG_LOG_VERBOSITY", "4")
    assert spec().operator_verbosity


def _run_on_missing_model(tmp_path, s: LaunchSpec) -> list[dict]:
    """Start a real llama-server on a model file that does not exist (it exits at once); the
    events logged meanwhile. Checks the pid file exists while it runs and is gone after."""
    async def run():
        p = WorkerProcess(s, state_dir=tmp_path / "run")
        with capture_logs() as logs:
            await p.start()
            assert (tmp_path / "run" / "m-gpu1.pid").exists()
            rc = await asyncio.wait_for(p.wait(), 30)
        return rc, logs

    rc, logs = asyncio.run(run())
    assert rc != 0
    assert not (tmp_path / "run" / "m-gpu1.pid").exists()
    return logs


def _info_lines(logs: list[dict]) -> list[dict]:
    """The ``worker.output`` events of llama-server's info ('I') lines."""
    return [e for e in logs if e["event"] == "worker.output" and e["line"].split(" ")[1:2] == ["I"]]


@pytest.mark.slow
@pytest.mark.parametrize("verbosity", [None, QUIET_LOG_VERBOSITY])
def test_worker_errors_reach_the_log_as_errors(tmp_path, monkeypatch, verbosity):
    """A real llama-server on a missing model exits; its 'E' lines are logged at error level,
    also at the quiet verbosity, which leaves out its info ('I') lines; without it (gateway
    at debug) the info lines are logged at debug."""
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    logs = _run_on_missing_model(tmp_path, spec(
        binary=ensure_llama_server(), model_path=tmp_path / "missing.gguf", gpus=(),
        log_verbosity=verbosity))
    errors = [e for e in logs if e["event"] == "worker.output" and e["log_level"] == "error"]
    assert any("failed to load model" in e["line"] for e in errors), logs[-5:]
    info = _info_lines(logs)
    assert (len(info) == 0) == (verbosity == QUIET_LOG_VERBOSITY), info[:3]
    assert all(e["log_level"] == "debug" for e in info), info[:3]


@pytest.mark.slow
@pytest.mark.parametrize("bad", [["--bogus-flag"], ["--flash-attn=on"], ["-c", "abc"]])
def test_worker_command_line_errors_reach_the_log_as_errors(tmp_path, monkeypatch, bad):
    """llama-server's argument parser writes its fatal error without a level prefix
    (``error: invalid argument: --bogus-flag``); it is logged at error level at the quiet
    verbosity the gateway uses below debug, not dropped at debug (a fresh tester's find)."""
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    logs = _run_on_missing_model(tmp_path, spec(
        binary=ensure_llama_server(), model_path=tmp_path / "missing.gguf", gpus=(),
        log_verbosity=QUIET_LOG_VERBOSITY, extra_args=bad))
    errors = [e["line"] for e in logs if e["event"] == "worker.output"
              and e["log_level"] == "error"]
    assert any(x.startswith("error") and ("argument" in x) for x in errors), logs[-5:]


@pytest.mark.slow
@pytest.mark.parametrize("bad,first", [
    ([], "gguf_init_from_file: failed to open GGUF file "),
    (["--bogus-flag"], "error: invalid argument: --bogus-flag")])
def test_first_error_line_is_kept_as_the_reason(tmp_path, monkeypatch, bad, first):
    """The first error line a real llama-server writes, without its timestamp and level
    letter, is kept (``first_error``) for the supervisor's "exited during startup" reason: the
    most specific one (the lines after it repeat it less precisely: "failed to load model",
    "exiting due to model loading error")."""
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)

    async def run():
        p = WorkerProcess(spec(binary=ensure_llama_server(), model_path=tmp_path / "missing.gguf",
                               gpus=(), log_verbosity=QUIET_LOG_VERBOSITY, extra_args=bad),
                          state_dir=tmp_path / "run")
        await p.start()
        await asyncio.wait_for(p.wait(), 30)
        return p.first_error

    got = asyncio.run(run())
    assert got is not None and got.startswith(first), got


@pytest.mark.slow
def test_a_pid_file_that_cannot_be_written_stops_the_process_it_was_for(tmp_path):
    """``start`` raises OSError (the supervisor's "spawn failed", then a retry) and the
    process it spawned is killed and reaped: one llama-server per retry was left running,
    untracked (a fresh tester's find: an unwritable cache)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")

    async def run():
        p = WorkerProcess(spec(binary=ensure_llama_server(), model_path=tmp_path / "missing.gguf",
                               gpus=()), state_dir=blocker / "run")
        with pytest.raises(OSError):
            await p.start()
        return p

    p = asyncio.run(run())
    assert p.pid is not None and p.returncode is not None  # spawned, then killed and reaped


@pytest.mark.slow
@pytest.mark.parametrize("how", ["args", "env"])
def test_operator_verbosity_logs_worker_info_lines_at_info(tmp_path, monkeypatch, how):
    """The gateway below debug starts workers quiet; an operator who raised the worker's
    verbosity (``-lv 4`` in the model's args, or ``LLAMA_ARG_LOG_VERBOSITY=4`` in the
    gateway's environment) gets its info lines, and at info, not only at gateway debug."""
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    if how == "env":
        monkeypatch.setenv("LLAMA_ARG_LOG_VERBOSITY", "4")
    logs = _run_on_missing_model(tmp_path, spec(
        binary=ensure_llama_server(), model_path=tmp_path / "missing.gguf", gpus=(),
        log_verbosity=QUIET_LOG_VERBOSITY, extra_args=["-lv", "4"] if how == "args" else []))
    info = _info_lines(logs)
    assert info and all(e["log_level"] == "info" for e in info), info[:3]
    # the gateway's quiet default is not passed beside the operator's -lv (llama-server warns
    # that the variable "will be overwritten by command line argument" when both are given)
    assert not [e for e in logs if "overwritten" in str(e.get("line", ""))], logs[:5]


def test_reap_stale_workers_kills_only_matching_binary(tmp_path):
    """A pid file from an earlier gateway: the process is killed only if /proc/PID/exe still
    is the recorded binary (here `sleep`, standing in for a surviving worker)."""
    import shutil
    import subprocess

    sleep_bin = Path(shutil.which("sleep")).resolve()
    victim = subprocess.Popen([str(sleep_bin), "60"])
    other = subprocess.Popen([str(sleep_bin), "60"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.pid").write_text(f"{victim.pid}\n{sleep_bin}\n")
    (run / "b.pid").write_text(f"{other.pid}\n/usr/bin/not-this-binary\n")
    try:
        killed = reap_stale_workers(run)
        assert killed == [victim.pid]
        assert victim.wait(5) == -9
        assert other.poll() is None
        assert not list(run.glob("*.pid"))
    finally:
        other.kill()
        other.wait()
        victim.kill()


def test_reap_stale_workers_leaves_another_gateways_worker_on_a_reused_pid(tmp_path):
    """A recorded pid now belongs to a worker of another gateway (same binary; pids get
    reused): its environment names the other gateway's state directory, so it is left running
    (a fresh tester killed one so); one that names this directory is killed, and so is a
    marked process no pid file names (a wrapper script's llama-server)."""
    import os
    import shutil
    import subprocess

    from workers.process import WORKER_MARKER_ENV

    sleep_bin = Path(shutil.which("sleep")).resolve()
    run, other_run = tmp_path / "run" / "127.0.0.1_1", tmp_path / "run" / "127.0.0.1_2"
    run.mkdir(parents=True)

    def marked(state_dir):
        env = {**os.environ, WORKER_MARKER_ENV: f"{state_dir.resolve()}/m-cpu0"}
        return subprocess.Popen([str(sleep_bin), "60"], env=env)
    others, ours, orphan = marked(other_run), marked(run), marked(run)
    (run / "a.pid").write_text(f"{others.pid}\n{sleep_bin}\n")
    (run / "b.pid").write_text(f"{ours.pid}\n{sleep_bin}\n")
    try:
        killed = reap_stale_workers(run)
        assert sorted(killed) == sorted([ours.pid, orphan.pid])
        assert ours.wait(5) == -9 and orphan.wait(5) == -9
        assert others.poll() is None
    finally:
        for p in (others, ours, orphan):
            p.kill()
            p.wait()


def test_env_leaves_out_the_variables_of_flags_the_gateway_owns(monkeypatch):
    """``LLAMA_ARG_API_PREFIX`` in the gateway's environment moved every worker's routes, and
    none became ready (a fresh tester's find); the router mode's and the model-fetching ones
    would replace the model. Other ``LLAMA_ARG_*`` settings pass."""
    monkeypatch.setenv("LLAMA_ARG_API_PREFIX", "/v9")
    monkeypatch.setenv("LLAMA_ARG_MODELS_DIR", "/models")
    monkeypatch.setenv("LLAMA_ARG_HF_REPO", "someone/model")
    monkeypatch.setenv("LLAMA_ARG_N_GPU_LAYERS", "99")
    env = spec().env("k")
    assert not {"LLAMA_ARG_API_PREFIX", "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_HF_REPO"} & set(env)
    assert env["LLAMA_ARG_N_GPU_LAYERS"] == "99"


def test_env_turns_cpu_flash_attention_off_unless_the_operator_chose(monkeypatch):
    """CPU workers get LLAMA_ARG_FLASH_ATTN=off; GPU workers, an operator's -fa, a quantized V
    cache (-ctv in args or LLAMA_ARG_CACHE_TYPE_V) and an operator's own variable are left
    alone."""
    monkeypatch.delenv("LLAMA_ARG_FLASH_ATTN", raising=False)
    monkeypatch.delenv("LLAMA_ARG_CACHE_TYPE_V", raising=False)
    assert spec(gpus=()).env("k")["LLAMA_ARG_FLASH_ATTN"] == "off"
    assert "LLAMA_ARG_FLASH_ATTN" not in spec(gpus=(0,)).env("k")
    for args in (["-fa", "on"], ["--flash-attn", "auto"], ["-ctv", "q8_0"],
                 ["--cache-type-v", "q4_0"]):
        assert "LLAMA_ARG_FLASH_ATTN" not in spec(gpus=(), extra_args=args).env("k"), args
    monkeypatch.setenv("LLAMA_ARG_CACHE_TYPE_V", "q8_0")
    assert "LLAMA_ARG_FLASH_ATTN" not in spec(gpus=()).env("k")
    monkeypatch.delenv("LLAMA_ARG_CACHE_TYPE_V")
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "on")
    assert spec(gpus=()).env("k")["LLAMA_ARG_FLASH_ATTN"] == "on"


@pytest.mark.slow
@pytest.mark.parametrize("args, enabled", [([], False), (["-ctv", "f16"], True)])
def test_real_cpu_worker_flash_attention(tmp_path, monkeypatch, args, enabled):
    """A real CPU llama-server on the demo model runs with flash attention disabled by default;
    with ``-ctv`` in its args the choice is llama-server's (``auto``: enabled on CPU). A
    quantized V cache cannot be shown here: its block size (32) does not divide the demo
    model's head size (16), so the ``-ctv`` case uses f16."""
    from workers.demo_model import ensure_demo_model
    monkeypatch.delenv("LLAMA_ARG_FLASH_ATTN", raising=False)
    monkeypatch.delenv("LLAMA_ARG_CACHE_TYPE_V", raising=False)
    monkeypatch.delenv("LLAMA_ARG_LOG_VERBOSITY", raising=False)
    s = spec(binary=ensure_llama_server(), model_path=ensure_demo_model(), gpus=(), slots=1,
             context_per_slot=512, threads=1, extra_args=["-lv", "4"] + args)

    async def run():
        p = WorkerProcess(s, state_dir=tmp_path / "run")
        with capture_logs() as logs:
            await p.start()
            try:
                for _ in range(300):
                    lines = [e.get("line", "") for e in logs if e["event"] == "worker.output"]
                    if any("listening on" in x or "exiting" in x for x in lines):
                        break
                    await asyncio.sleep(0.1)
            finally:
                await p.stop()
        return [e.get("line", "") for e in logs if e["event"] == "worker.output"]

    lines = asyncio.run(run())
    assert any("listening on" in x for x in lines), lines[-5:]
    # at -lv 4: "llama_context: flash_attn = disabled" (off) or "= auto" followed by
    # "resolve_fused_ops: Flash Attention enabled"
    fa = [x for x in lines if "flash_attn" in x.lower() or "flash attention" in x.lower()]
    assert any(x.rstrip().endswith("= disabled") for x in fa) == (not enabled), fa
    assert any("Flash Attention enabled" in x for x in fa) == enabled, fa


# A FAKE worker binary whose SIGTERM handler never returns on the first signal and exits on
# the second, as llama-server's does when the signal lands while its main thread holds the
# task queue's lock (server_queue::terminate; tools/server/server.cpp signal_handler).
HANGS_ON_TERM = """
import os, signal, sys, time
hit = []
def on_term(sig, frame):
    if hit:
        os._exit(1)
    hit.append(1)
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGTERM, {handler})
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _stop_fake(tmp_path, handler: str, grace_s: float):
    script = tmp_path / "fake-worker"
    script.write_text(f"#!{sys.executable}\n" + HANGS_ON_TERM.format(handler=handler))
    script.chmod(0o755)

    async def run():
        p = WorkerProcess(spec(binary=script, gpus=()))
        await p.start()
        await asyncio.sleep(1.0)  # the handler is set before "ready"; Python starts in ~50 ms
        with capture_logs() as logs:
            t0 = time.monotonic()
            rc = await p.stop(grace_s)
            return rc, time.monotonic() - t0, [e["event"] for e in logs]

    return asyncio.run(run())


def test_a_worker_whose_shutdown_hangs_gets_a_second_sigterm(tmp_path):
    """llama-server's SIGTERM handler can wait for good (1 restart in 6 whose drain ran out,
    here); its second SIGTERM exits at once. The worker stopped in 1.5 s with status 1, not
    after the whole grace and a SIGKILL."""
    rc, took, events = _stop_fake(tmp_path, "on_term", grace_s=10)
    assert rc == 1 and 1.4 < took < 4, (rc, took)
    assert "worker.stop_second_signal" in events and "worker.stop_timeout" not in events


def test_a_worker_that_ignores_sigterm_is_killed_at_the_end_of_the_grace(tmp_path):
    rc, took, events = _stop_fake(tmp_path, "signal.SIG_IGN", grace_s=2)
    assert rc == -9 and 1.9 < took < 5, (rc, took)
    assert events.count("worker.stop_timeout") == 1, events


def test_crash_lines_without_a_prefix_are_errors():
    """The dynamic loader's error, a ggml assertion and a C++ exception end a worker without
    llama-server's log prefix: they are its error (the start-up reason), where its start-up
    failure said only "status 127" or "-6" (a fresh tester's find)."""
    from workers.process import error_text
    for line in ("/opt/x/llama-server: error while loading shared libraries: libllama-server-impl"
                 ".so: cannot open shared object file: No such file or directory",
                 "/src/ggml/src/ggml.c:3354: GGML_ASSERT(ggml_can_mul_mat(a, b)) failed",
                 "terminate called after throwing an instance of 'std::runtime_error'"):
        assert error_text(line) == line
    assert error_text("0.00.009.380 I main: loading model") is None
    assert error_text("build: 1 (0c1e570) with cc") is None


@pytest.mark.slow
def test_a_binary_without_its_libraries_names_the_loaders_error(tmp_path):
    """llama-server copied out of its build folder without its shared libraries exits 127;
    the start-up reason names the loader's line (a fresh tester's find: the cause was nowhere
    in the log), and a wrapper's own last line is the reason when it writes no error line."""
    from tests.fakes import failing_wrapper, lonely_binary
    lonely = lonely_binary(tmp_path, str(ensure_llama_server()))
    wrapper = failing_wrapper(tmp_path, "wrapper: the model share is not mounted", 3)

    async def run(binary):
        p = WorkerProcess(spec(binary=binary, model_path=tmp_path / "missing.gguf", gpus=()),
                          state_dir=tmp_path / "run")
        await p.start()
        status = await asyncio.wait_for(p.wait(), 30)  # its output read to the end
        return status, p.first_error or p.last_plain

    status, said = asyncio.run(run(lonely))
    assert status == 127 and "error while loading shared libraries" in said, said
    status, said = asyncio.run(run(wrapper))
    assert status == 3 and said == "wrapper: the model share is not mounted", said
