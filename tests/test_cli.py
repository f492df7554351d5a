"""gateway/cli.py: files the config names but the gateway cannot use are refused with a
key-path message and exit status 2, by ``check-config`` and by ``serve`` alike (no traceback)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a GGUF file\n")
    return p


@pytest.mark.parametrize("verb", ["check-config", "serve"])
def test_model_path_that_is_not_gguf(tmp_path, not_gguf, verb):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"listen: 127.0.0.1:0\nmodels:\n  - name: m\n    path: {not_gguf}\n    cpu: 1\n")
    r = run(verb, "-c", str(cfg))
    assert r.returncode == 2, r.stderr
    assert f"{cfg}: models[0].path: not a readable GGUF file: {not_gguf}" in r.stderr
    assert "Traceback" not in r.stderr
    # words an operator can act on, not numpy's reshape error (a fresh tester's find)
    assert "(not a GGUF file: it does not begin with the GGUF magic (first bytes b'this', " \
        "24 bytes in all))" in r.stderr, r.stderr


@pytest.mark.parametrize("verb", ["check-config", "serve"])
def test_missing_llama_server_binary(tmp_path, verb):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: 127.0.0.1:0\nllama_server:\n  binary: /nonexistent/llama-server\n"
                   "models:\n  - name: m\n    path: builtin:demo\n    cpu: 1\n")
    r = run(verb, "-c", str(cfg))
    assert r.returncode == 2, r.stderr
    assert f"{cfg}: llama_server.binary:" in r.stderr and "/nonexistent/llama-server" in r.stderr
    assert "Traceback" not in r.stderr


def test_check_config_runs_the_binary(tmp_path):
    """A llama-server copied without its shared libraries exists and is executable, so
    check-config printed the plan and every worker start then failed (exit 127); it now runs
    ``--version`` and names the loader's error. A wrapper that fails says its own last line;
    the real binary passes."""
    from tests.fakes import failing_wrapper, lonely_binary
    from workers.provision import ensure_llama_server
    lonely = lonely_binary(tmp_path, str(ensure_llama_server()))
    wrapper = failing_wrapper(tmp_path, "wrapper: /opt/llama is not mounted", 3)
    cfg = tmp_path / "g.yaml"

    def check(binary):
        cfg.write_text(f"listen: 127.0.0.1:0\nllama_server: {{binary: {binary}}}\n"
                       "models:\n  - {name: m, path: builtin:demo, cpu: 1}\n")
        return run("check-config", "-c", str(cfg))

    r = check(lonely)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert f"{cfg}: llama_server.binary: {lonely} does not run: `--version` ended with " \
        in r.stderr and "error while loading shared libraries" in r.stderr, r.stderr
    assert "(exit status 127)" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = check(wrapper)
    assert r.returncode == 2 and (f"{wrapper} does not run: `--version` ended with wrapper: "
                                  "/opt/llama is not mounted (exit status 3)") in r.stderr, r.stderr
    r = check(ensure_llama_server())
    assert r.returncode == 0 and r.stdout.startswith("m-cpu0\t"), (r.stdout, r.stderr)


def test_simulate_takes_a_calibration_file_as_profile(tmp_path):
    prof = tmp_path / "cal.json"
    prof.write_text('{"profile": {"name": "cal", "prefill_tps": 20000, "decode_s1": 0.0002, '
                    '"batch_slope": 0.4, "attn_s_per_token": 1e-6}}')
    r = run("simulate", "--gpus", "1", "--duration", "25", "--profile", str(prof))
    assert r.returncode == 0, r.stderr
    assert "| round_robin |" in r.stdout


def test_simulate_refuses_an_unknown_profile():
    r = run("simulate", "--gpus", "1", "--duration", "1", "--profile", "no-such-gpu")
    assert r.returncode == 2
    assert "unknown profile 'no-such-gpu'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,msg", [
    (("--gpus", "0"), "--gpus must be comma-separated whole numbers of GPUs from 1 to 1024, "
                      "e.g. 4,8; got '0'"),
    (("--gpus", "-1"), "got '-1'"), (("--gpus", "abc"), "got 'abc'"), (("--gpus", "4,"), "got '4,'"),
    (("--gpus", "2", "--duration", "20"), "--duration must be at least 25 simulated seconds "
                                          "(runs are measured after up to 20 s of warm-up), got 20"),
    (("--duration", "nan"), "got nan"),
    (("--gpus", "1", "--duration", "1e300"), "--duration must be at most 3600 simulated seconds"),
])
def test_simulate_refuses_bad_fleet_sizes_and_durations(args, msg):
    """Each was a traceback (NoWorkers, ValueError, ZeroDivisionError; a fresh tester's find)."""
    r = run("simulate", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("llama-gateway simulate: ") and msg in r.stderr, r.stderr


def test_demo_model_to_a_path_it_cannot_write_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    target = "/proc/x.gguf" if os.geteuid() == 0 else str(ro / "x.gguf")  # root writes anywhere else
    r = run("demo-model", "--path", target)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"llama-gateway demo-model: cannot write {target}: "), r.stderr


def test_check_config_prints_the_per_slot_context_the_model_allows(tmp_path):
    """llama-server caps each slot's context at the model's training context (the GGUF's
    ``<arch>.context_length``): check-config prints that effective context and says so."""
    from workers.demo_model import write_demo_model

    gguf = write_demo_model(tmp_path / "m.gguf", n_ctx_train=2048)
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"listen: 127.0.0.1:0\nmodels:\n"
                   f"  - {{name: big, path: {gguf}, cpu: 1, slots: 2, context: 4096}}\n"
                   f"  - {{name: fits, path: {gguf}, cpu: 1, slots: 2, context: 1024}}\n")
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 0, r.stderr
    rows = dict(line.split("\t", 1) for line in r.stdout.splitlines())
    assert rows["big-cpu0"].endswith(
        "slots=2\tcontext/slot=2048 (capped from 4096: the model's training context)")
    assert rows["fits-cpu0"].endswith("slots=2\tcontext/slot=1024")


def test_demo_model_with_a_longer_training_context(tmp_path):
    """``demo-model --context-length`` writes a demo GGUF trained for that many tokens, which
    check-config then allows per slot (the README's way to try long prompts)."""
    gguf = tmp_path / "long.gguf"
    r = run("demo-model", "--path", str(gguf), "--context-length", "16384")
    assert r.returncode == 0 and r.stdout.strip() == str(gguf), r.stderr
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"listen: 127.0.0.1:0\nmodels:\n"
                   f"  - {{name: long, path: {gguf}, cpu: 1, slots: 1, context: 16384}}\n")
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 0 and r.stdout.strip().endswith("slots=1\tcontext/slot=16384"), r
    for value in ("0", "99999999999"):
        bad = run("demo-model", "--path", str(tmp_path / "x.gguf"), "--context-length", value)
        assert bad.returncode == 2 and "must be 16 to 2147483647" in bad.stderr, bad.stderr
    no_path = run("demo-model", "--context-length", "64")
    assert no_path.returncode == 2 and "needs --path" in no_path.stderr


@pytest.mark.parametrize("keep", [1000, 30000, 200000, -432])
def test_check_config_refuses_a_cut_short_gguf_in_one_line(tmp_path, keep):
    """gguf's reader raised IndexError on a file cut after 1,000 bytes: a traceback and exit 1
    (a 500 on reload; a fresh tester's find). Cut in its header or in its tensor data, the
    file is now said to be cut short; numpy's "cannot reshape array of size 3908 into shape
    (559,64)" was all another tester got."""
    from workers.demo_model import write_demo_model
    whole = write_demo_model(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f'models:\n  - {{name: demo, path: "{cut}", cpu: 1}}\n')
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    size = len(whole[:keep])
    assert (f"models[0].path: not a readable GGUF file: {cut} (the file is cut short: it has "
            f"{size:,} bytes and its GGUF header describes data up to byte ") in r.stderr, r.stderr
    assert "(an interrupted download or copy?))" in r.stderr and "reshape" not in r.stderr


def test_check_config_names_gpus_it_cannot_find_in_one_line(tmp_path):
    """``gpus: [0]`` on a machine without an NVIDIA GPU: the plan's ConfigError was a traceback
    and exit 1 from check-config (serve said it in one line; a fresh tester's find)."""
    from workers.gpu import detect_gpus
    if detect_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: 127.0.0.1:0\nmodels:\n  - {name: m, path: builtin:demo, gpus: [0]}\n")
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{cfg}: models[0].gpus: no NVIDIA GPU detected, got gpus: [0]" in r.stderr


def test_check_config_names_a_model_that_gets_no_worker(tmp_path):
    """A model the plan gives no worker (``gpus: auto``, no GPU, ``cpu_fallback: 0``) was left
    out of check-config's output without a word (a fresh tester's find); it now has a line
    saying what serve answers its requests."""
    from workers.gpu import detect_gpus
    if detect_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: 127.0.0.1:0\nmodels:\n  - {name: gpuonly, path: builtin:demo, cpu_fallback: 0}\n"
                   "  - {name: demo, path: builtin:demo, cpu: 1}\n")
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("demo-cpu0\tmodel=demo:latest\t")
    assert lines[1] == ("-\tmodel=gpuonly:latest\tno worker: model 'gpuonly:latest' has no worker "
                        "on this machine: its config plans none (gpus: auto found no NVIDIA GPU "
                        "and cpu_fallback is 0); change the config and reload")


def test_serve_refuses_a_cache_where_no_run_directory_can_be_made(tmp_path):
    """With ``$LLAMA_GATEWAY_CACHE`` under a regular file the workers' pid files cannot be
    written: each start attempt left a running llama-server behind, untracked, one per
    backoff (a fresh tester's find). serve now refuses to start, in one line, exit 2."""
    from workers.demo_model import write_demo_model
    from workers.provision import ensure_llama_server
    gguf = write_demo_model(tmp_path / "m.gguf")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"listen: 127.0.0.1:0\nllama_server: {{binary: {ensure_llama_server()}}}\n"
                   f"models:\n  - {{name: m, path: {gguf}, cpu: 1}}\n")
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "-c", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LLAMA_GATEWAY_CACHE": str(blocker / "cache")})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot create the workers' run directory {blocker}/cache/run/127.0.0.1_" in r.stderr
    assert "Not a directory" in r.stderr and "worker.spawned" not in r.stderr


def test_serve_with_gpus_it_cannot_find_leaves_no_run_directory(tmp_path):
    """``gpus: [0]`` on a machine without an NVIDIA GPU: serve refuses in one line, and the
    run directory it made for the workers' pid files (none started) is removed again; one
    empty directory per refused start was left behind."""
    from workers.demo_model import write_demo_model
    from workers.gpu import detect_gpus
    from workers.provision import ensure_llama_server
    if detect_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    gguf = write_demo_model(tmp_path / "m.gguf")
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"listen: 127.0.0.1:0\nllama_server: {{binary: {ensure_llama_server()}}}\n"
                   f"models:\n  - {{name: m, path: {gguf}, gpus: [0]}}\n")
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "-c", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LLAMA_GATEWAY_CACHE": str(cache)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{cfg}: models[0].gpus: no NVIDIA GPU detected, got gpus: [0]" in r.stderr
    assert (cache / "run").is_dir() and list((cache / "run").iterdir()) == []


def test_simulate_png_without_matplotlib_is_refused_before_the_runs(tmp_path):
    """The plot needs the ``bench`` extra; without it the whole simulation ran and then ended
    in a traceback (a fresh tester's find)."""
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    r = run("simulate", "--gpus", "1", "--duration", "25", "--png", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert r.stderr == "llama-gateway simulate: --png needs matplotlib: pip install " \
                       "'llama-gateway[bench]'\n"


@pytest.mark.parametrize("args,msg", [
    (("--slots", "1"), "--slots must be at least 2 (the decode fit needs two batch sizes)"),
    (("--slots", "0"), "--slots must be at least 2"),
    (("--repeats", "0"), "--repeats must be at least 1"),
    (("--context", "0"), "--context must be at least 16 tokens"),
    (("--context", "300000000"), "--slots × --context is 2,400,000,000 tokens, more than "
                                 "llama-server's -c takes (2147483647)"),
    # no GPU: "no NVIDIA GPU found (NVML)"; on a GPU machine: "NVML finds GPUs 0"
    (("--gpu", "99"), "--gpu 99: "),
    (("--binary", "{file}"), "--binary is not an executable file: {file}"),
    (("--model", "{file}"), "--model is not a readable GGUF file: {file} ("),
    (("--out", "{file}/x.json"), "--out cannot be written: {file}/x.json ({file} is not a directory)")])
def test_calibrate_refuses_bad_arguments_before_starting_a_server(tmp_path, args, msg):
    """Each started llama-server and then failed with a traceback, or after minutes of
    measuring (a fresh tester's find). ``{file}``: a regular file that is not a GGUF."""
    f = tmp_path / "file"
    f.write_text("not a model")
    r = run("calibrate", *(a.format(file=f) for a in args), timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # besides log events (JSON lines; --gpu logs that NVML is unavailable), one line: the error
    said = [ln for ln in r.stderr.splitlines() if not ln.startswith("{")]
    assert len(said) == 1 and said[0].startswith("llama-gateway calibrate: " + msg.format(file=f)), r.stderr
    assert "worker.spawned" not in r.stderr


def test_demo_model_under_a_regular_file_says_so(tmp_path):
    """``mkdir`` of a parent that is a file raised "File exists" (a fresh tester's find)."""
    f = tmp_path / "file"
    f.write_text("x")
    r = run("demo-model", "--path", str(f / "x.gguf"))
    assert r.returncode == 1, r.stderr
    assert r.stderr == f"llama-gateway demo-model: cannot write {f}/x.gguf: {f} is not a directory\n"


def test_demo_model_to_an_existing_folder_is_refused(tmp_path):
    """It printed the folder as the model path, exit 0 (a fresh tester's find)."""
    r = run("demo-model", "--path", str(tmp_path))
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == f"llama-gateway demo-model: cannot write {tmp_path}: Is a directory\n"


def test_demo_model_over_an_existing_file_that_is_not_gguf_is_refused(tmp_path):
    """"Write it if missing" found another file there and printed it as the model, exit 0 (a
    fresh tester's find: a YAML file). An existing demo model is still found, and --force
    overwrites the other file."""
    other = tmp_path / "ok.yaml"
    other.write_text("listen: 127.0.0.1:0\n")
    r = run("demo-model", "--path", str(other))
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == (f"llama-gateway demo-model: {other} exists and is not a GGUF file; "
                        "--force overwrites it\n")
    assert other.read_text() == "listen: 127.0.0.1:0\n"
    forced = run("demo-model", "--path", str(other), "--force")
    assert forced.returncode == 0 and other.read_bytes()[:4] == b"GGUF"
    again = run("demo-model", "--path", str(other))
    assert again.returncode == 0 and again.stdout == f"{other}\n"


@pytest.mark.slow
def test_calibrate_says_why_its_llama_server_did_not_start(tmp_path):
    """A llama-server that exits before it is ready (here: a binary that is a llama-server
    given an argument it refuses, through a wrapper) was a Python traceback without
    llama-server's reason (a fresh tester's find); it is one line with the server's own
    error, exit status 1, and no file."""
    from workers.provision import ensure_llama_server
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec '{ensure_llama_server()}' \"$@\" --no-such-flag\n")
    wrapper.chmod(0o755)
    out = tmp_path / "cal.json"
    r = run("calibrate", "--binary", str(wrapper), "--out", str(out), timeout=60)
    said = [ln for ln in r.stderr.splitlines() if not ln.startswith("{")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert said == ["llama-gateway calibrate: llama-server exited with status 1 before it was "
                    "ready: error: invalid argument: --no-such-flag"], r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_calibrate_stopped_by_sigterm_leaves_no_llama_server_and_no_file(tmp_path):
    """SIGTERM to calibrate (a timeout, a cancelled job) left its llama-server running under
    PID 1, and the up-front write check left an empty profile behind (a fresh tester's find)."""
    import signal
    import time

    import psutil
    out = tmp_path / "cal.json"
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "calibrate", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = None
    end = time.monotonic() + 60
    while child is None and time.monotonic() < end:
        kids = [c for c in psutil.Process(proc.pid).children(recursive=True)
                if c.name() == "llama-server"]
        child = kids[0] if kids else None
        time.sleep(0.1)
    assert child is not None, "calibrate started no llama-server"
    assert not out.exists()  # checked writable, not left there
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert psutil.wait_procs([child], timeout=10)[1] == [], "its llama-server outlived it"
    assert not out.exists()


def test_check_config_shows_np_and_c_from_args(tmp_path):
    """``-np`` / ``-c`` in args override the plan (the gateway reads them back from /slots);
    check-config printed the plan's slots and context instead (a fresh tester's find)."""
    cfg = tmp_path / "g.yaml"
    cfg.write_text("listen: 127.0.0.1:0\nmodels:\n"
                   "  - {name: npo, path: builtin:demo, cpu: 1, slots: 3, context: 1024, args: [-np, 1]}\n"
                   "  - {name: c2, path: builtin:demo, cpu: 1, slots: 2, context: 512, args: [--ctx-size, 2048]}\n"
                   "  - {name: plain, path: builtin:demo, cpu: 1, slots: 2, context: 1024}\n")
    r = run("check-config", "-c", str(cfg))
    assert r.returncode == 0, r.stderr
    rows = dict(line.split("\t", 1) for line in r.stdout.splitlines())
    assert rows["npo-cpu0"].endswith("slots=1\tcontext/slot=3072 (set by -np/-c in args)")
    assert rows["c2-cpu0"].endswith("slots=2\tcontext/slot=1024 (set by -np/-c in args)")
    assert rows["plain-cpu0"].endswith("slots=2\tcontext/slot=1024")
