"""Deliberately broken workers for fault tests (named fakes; see fake_llama_server.py)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

FAKE = Path(__file__).with_name("fake_llama_server.py")


def fake_binary(tmp_path: Path, mode: str, *, first_only: bool = True, real: str | None = None,
                extra: str = "", fakes: int = 1) -> Path:
    """A llama-server stand-in script for ``llama_server.binary``.

    ``first_only``: only the first ``fakes`` processes spawned through it are the FAKE
    (``mode``); every later spawn (the other workers, restarts) execs the real llama-server
    ``real``. Without it every spawn is the FAKE.
    """
    script = tmp_path / f"fake-llama-server-{mode}"
    fake = f"exec '{sys.executable}' '{FAKE}' --fake-mode {mode} {extra} \"$@\""
    if first_only:
        assert real is not None and fakes >= 1
        locks = [tmp_path / f"fake-{mode}.lock"] + [tmp_path / f"fake-{mode}-{i}.lock"
                                                     for i in range(1, fakes)]
        body = "".join(f"if mkdir '{lock}' 2>/dev/null; then\n  {fake}\nfi\n" for lock in locks)
        body += f"exec '{real}' \"$@\"\n"
    else:
        body = fake + "\n"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def paced_binary(tmp_path: Path, first_tps: float, other_tps: float) -> Path:
    """A llama-server stand-in script whose every spawn is the FAKE ``paced_llama_server.py``:
    the first one generates at ``first_tps`` tokens/s per sequence, every later one (the other
    workers, restarts) at ``other_tps``."""
    paced = Path(__file__).with_name("paced_llama_server.py")
    lock = tmp_path / "fake-paced-first.lock"
    run = f"exec '{sys.executable}' '{paced}' --fake-tps"
    script = tmp_path / "fake-llama-server-paced"
    script.write_text(f"#!/bin/sh\nif mkdir '{lock}' 2>/dev/null; then\n  {run} {first_tps} \"$@\"\n"
                      f"fi\n{run} {other_tps} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def hanging_binary(tmp_path: Path, real: str, model: str) -> Path:
    """A FAKE llama-server stand-in whose spawns for ``model`` (its full name, e.g.
    ``hang:latest``, as the gateway passes it to ``--alias``) hang for ever without listening;
    every other spawn execs the real llama-server ``real``."""
    script = tmp_path / "hang-or-run"
    script.write_text(f'#!/bin/sh\ncase "$*" in *{model}*) exec sleep 1000;; esac\n'
                      f'exec "{real}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def is_fake(pid: int) -> bool:
    """True when the process is the FAKE server (its command line names the fake script)."""
    try:
        return FAKE.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def exiting_binary(tmp_path: Path, real: str, *, go: Path, heal: Path) -> Path:
    """A FAKE llama-server that cannot start: every spawn waits (as "starting") until the file
    ``go`` exists, then exits with status 1 at once, so the supervisor's crash-loop guard marks
    the worker ``failed``. Once the file ``heal`` exists, spawns exec the real llama-server
    ``real`` (an admin restart then brings the worker back)."""
    script = tmp_path / "fake-llama-server-exits"
    script.write_text(
        "#!/bin/sh\n"
        f"if [ -e '{heal}' ]; then exec '{real}' \"$@\"; fi\n"
        f"while [ ! -e '{go}' ]; do sleep 0.05; done\n"
        "echo 'FAKE llama-server: exiting at once (deliberately broken worker)' >&2\n"
        "exit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def slow_start_binary(tmp_path: Path, real: str, sleep_s: float, *, first: int = 1,
                      last: int | None = None) -> tuple[Path, Path]:
    """A slow-loading stand-in for ``llama_server.binary``: spawns number ``first`` to
    ``last`` (1-based, counted over the whole gateway; ``last`` None: no end) sleep
    ``sleep_s`` seconds before they exec the real llama-server ``real``; the others exec it at
    once. Returns the script and the file that holds the number of spawns so far."""
    counter = tmp_path / "slow-start-spawns"
    script = tmp_path / "slow-start-llama-server"
    upper = "" if last is None else f" && [ $n -le {last} ]"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(cat '{counter}' 2>/dev/null || echo 0); n=$((n+1)); echo $n > '{counter}'\n"
        f"if [ $n -ge {first} ]{upper}; then sleep {sleep_s}; fi\n"
        f"exec '{real}' \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, counter


def lonely_binary(tmp_path: Path, real: str) -> Path:
    """A copy of the real llama-server ``real`` without the shared libraries of its build
    folder (not a fake: the dynamic loader refuses to start it, exit status 127)."""
    import shutil
    lonely = tmp_path / "lonely" / "llama-server"
    lonely.parent.mkdir()
    shutil.copy2(real, lonely)
    return lonely


def failing_wrapper(tmp_path: Path, line: str, status: int) -> Path:
    """A FAKE llama-server: a shell wrapper that writes ``line`` on stderr and exits with
    ``status`` whatever it is asked (``--version`` included)."""
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text(f"#!/bin/sh\necho '{line}' >&2\nexit {status}\n")
    wrapper.chmod(0o755)
    return wrapper
