"""deploy/install.sh run in a sandbox: every path overridden, SYSTEMCTL=true, a throwaway
service user.

Most tests use a stub PYTHON: its ``-m venv`` makes a "venv" whose python runs the system
python (so the script's version and path checks see a real interpreter) except for ``-m pip``,
which it only logs, and whose ``llama-gateway`` logs each call (user, $LLAMA_GATEWAY_CACHE,
arguments) and answers ``--version`` / ``check-config`` / ``install-llama-server`` at once. So
they need no network and no build and take about a second each. One slow test installs the
checkout for real with the system python.

The sandbox is a directory under /tmp that the service user can traverse (pytest's tmp_path
lies under /tmp/pytest-of-root, mode 0700, where the service user could not run anything).
Everything that runs the script needs root (the script refuses otherwise) and skips without
it; the throwaway user is removed at the end.
"""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.deploy.test_systemd_unit import _directives

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "install.sh"

is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not is_root or not all(shutil.which(c) for c in ("runuser", "useradd", "userdel")),
    reason="install.sh runs as root (with runuser, useradd)")


def _system_python() -> str | None:
    """A python outside /root and /home that any user may run (the stubs exec it)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        real = os.path.realpath(p) if p else ""
        if real and os.access(real, os.X_OK) and not real.startswith(("/root/", "/home/")):
            return real
    return None


SYSTEM_PYTHON = _system_python()


def _run(env: dict, *args: str, timeout: float = 60, umask: int = 0o022
         ) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}
    return subprocess.run(["bash", str(SCRIPT), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=timeout, cwd="/",
                          preexec_fn=lambda: os.umask(umask))


@pytest.fixture(scope="module")
def service_user():
    if not is_root:
        pytest.skip("needs root")
    name = "lgdt" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                    "--shell", "/usr/sbin/nologin", name], check=True)
    yield name
    subprocess.run(["userdel", name], check=False)


class Sandbox:
    def __init__(self, root: Path, user: str):
        self.root = root
        self.user = user
        self.stub = root / "stub"
        self.log = root / "log" / "calls"
        self.prefix, self.conf, self.cache, self.state, self.units = (
            root / "opt", root / "etc", root / "cache", root / "state", root / "unit")
        (root / "log").mkdir()
        (root / "log").chmod(0o1777)
        self.log.touch()
        self.log.chmod(0o666)
        self.stub.mkdir()
        py = SYSTEM_PYTHON
        self._script("python", f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && echo "home = /usr/bin" > "$3/pyvenv.cfg"
  install -m 0755 {self.stub}/venv-python "$3/bin/python"
  install -m 0755 {self.stub}/llama-gateway "$3/bin/llama-gateway"
  echo "venv $3" >> {self.log}; exit 0
fi
if [ "$1" = -c ] && [ -f {self.stub}/fake-base ]; then echo 3.11; cat {self.stub}/fake-base; exit 0; fi
exec {py} "$@"
""")
        self._script("venv-python", f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "pip ${{*:3}}" >> {self.log}; exit 0; fi
exec {py} "$@"
""")
        self._script("llama-gateway", f"""#!/bin/bash
c="${{LLAMA_GATEWAY_CACHE-unset}}"
echo "$(id -un) cache=$c cache_exists=$([ -d "$c" ] && echo yes || echo no) $*" >> {self.log}
case "$1" in
  --version) echo "llama-gateway 0.0 (stub)" ;;
  check-config)
    echo '{{"event": "gpu.nvml_unavailable", "stub": "a log line"}}' >&2
    printf 'demo-cpu0\\tmodel=demo:latest\\n'
    if [ -f {self.stub}/check-config-fails ]; then
      echo "models[0].path: not a readable GGUF file (stub)" >&2; exit 2
    fi ;;
  install-llama-server) echo /stub/llama-server ;;
esac
""")

    def _script(self, name: str, text: str) -> None:
        p = self.stub / name
        p.write_text(text)
        p.chmod(0o755)

    def env(self, **over: str) -> dict:
        e = {"PREFIX": str(self.prefix), "CONF_DIR": str(self.conf), "CACHE_DIR": str(self.cache),
             "STATE_DIR": str(self.state), "UNIT_DIR": str(self.units), "SYSTEMCTL": "true",
             "SERVICE_USER": self.user, "PYTHON": str(self.stub / "python")}
        e.update(over)
        return e

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def private_dir(self) -> Path:
        """A directory only root can enter, as /root is."""
        d = self.root / "private"
        d.mkdir(exist_ok=True)
        d.chmod(0o700)
        return d


@pytest.fixture
def sandbox(service_user):
    if SYSTEM_PYTHON is None:
        pytest.skip("no system python3 outside /root and /home")
    root = Path(tempfile.mkdtemp(prefix="lg-deploy-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield Sandbox(root, service_user)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# --- options -------------------------------------------------------------------------------

def _run_unprivileged(*args: str) -> subprocess.CompletedProcess:
    """The script with options that must be answered before it does anything, run as nobody
    when the test runs as root: a script that wrongly went on to install would stop at its
    root check instead of installing into the real /opt, /etc (as the old script did with
    --purge alone). A copy, so that nobody can read it wherever the checkout is."""
    if not is_root:
        return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)
    if not shutil.which("runuser"):
        pytest.skip("as root, needs runuser to run the script as nobody")
    d = Path(tempfile.mkdtemp(prefix="lg-deploy-opt-", dir="/tmp"))
    try:
        d.chmod(0o755)
        shutil.copy(SCRIPT, d / "install.sh")
        (d / "install.sh").chmod(0o644)
        return subprocess.run(["runuser", "-u", "nobody", "--", "bash", str(d / "install.sh"),
                               *args], capture_output=True, text=True, cwd="/")
    finally:
        shutil.rmtree(d)


def test_help_prints_the_usage_block_only():
    r = _run_unprivileged("--help")
    assert r.returncode == 0
    assert "set -euo pipefail" not in r.stdout and "SRC=" not in r.stdout
    assert "--no-build" in r.stdout
    assert "unit and venv" not in r.stdout  # --uninstall removes no more than it says
    assert "$PREFIX/README.md" in r.stdout and "$PREFIX/venv" in r.stdout
    for var in ("PREFIX=", "CONF_DIR=", "CACHE_DIR=", "STATE_DIR=", "UNIT_DIR=", "SERVICE_USER=",
                "SYSTEMCTL=", "PYTHON="):
        assert var in r.stdout
    assert "PYTHON=/usr/bin/python3" in r.stdout
    assert not r.stdout.lstrip().startswith("#")


def test_purge_without_uninstall_is_refused():
    r = _run_unprivileged("--purge")
    assert r.returncode == 2 and "--purge goes with --uninstall" in r.stderr


# --- install -------------------------------------------------------------------------------

@needs_root
def test_install_checks_config_as_the_service_user_with_its_cache(sandbox):
    s = sandbox
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    check = [c for c in s.calls() if " check-config " in c]
    assert check, s.calls()
    # as the service will run it: its user, its cache (already there), quietly
    assert check[0].startswith(f"{s.user} cache={s.cache} cache_exists=yes check-config -c "
                               f"{s.conf}/gateway.yaml"), check
    assert "gpu.nvml_unavailable" not in r.stdout + r.stderr
    assert "demo-cpu0" not in r.stdout + r.stderr
    assert f"checked {s.conf}/gateway.yaml as {s.user}" in r.stdout
    # --version as the service user too (it can reach the venv)
    assert any(c.startswith(f"{s.user} ") and c.endswith(" --version") for c in s.calls())


@needs_root
def test_check_config_failure_is_shown_and_stops_the_install(sandbox):
    s = sandbox
    (s.stub / "check-config-fails").touch()
    r = _run(s.env(), "--no-build")
    assert r.returncode != 0
    assert "not a readable GGUF file (stub)" in r.stderr
    assert "does not pass check-config" in r.stderr
    assert not (s.units / "llama-gateway.service").exists()


@needs_root
def test_config_and_env_file_are_0640_root_service_group(sandbox):
    s = sandbox
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    gid = int(subprocess.run(["id", "-g", s.user], capture_output=True, text=True).stdout)
    for name in ("gateway.yaml", "llama-gateway.env"):
        st = (s.conf / name).stat()
        assert (_mode(s.conf / name), st.st_uid, st.st_gid) == (0o640, 0, gid), name
    assert 'listen: "127.0.0.1:11434"' in (s.conf / "gateway.yaml").read_text()
    assert f"LLAMA_GATEWAY_CACHE={s.cache}\n" in (s.conf / "llama-gateway.env").read_text()
    for d in (s.cache, s.state):
        st = d.stat()
        assert (_mode(d), st.st_gid) == (0o750, gid)


@needs_root
def test_a_strict_umask_still_gives_the_service_user_a_usable_install(sandbox):
    s = sandbox
    r = _run(s.env(), "--no-build", umask=0o077)
    assert r.returncode == 0, r.stderr
    assert _mode(s.prefix) == 0o755 and _mode(s.conf) == 0o755
    assert _mode(s.prefix / "README.md") == 0o644


@needs_root
def test_an_operators_config_keeps_its_content_and_mode(sandbox):
    s = sandbox
    s.conf.mkdir()
    own = s.conf / "gateway.yaml"
    own.write_text("models:\n  - {name: demo, path: 'builtin:demo'}\n")
    own.chmod(0o644)
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    assert _mode(own) == 0o644 and own.stat().st_uid == 0
    assert own.read_text() == "models:\n  - {name: demo, path: 'builtin:demo'}\n"
    assert f"wrote {own}" not in r.stdout


@needs_root
def test_no_build_ends_with_the_build_command(sandbox):
    s = sandbox
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1].strip()
    assert last == (f"runuser -u {s.user} -- env LLAMA_GATEWAY_CACHE={s.cache} "
                    f"{s.prefix}/venv/bin/llama-gateway install-llama-server")
    assert not [c for c in s.calls() if "install-llama-server" in c]
    # without --no-build: built as the service user in its cache, and no such line
    r = _run(s.env())
    assert r.returncode == 0, r.stderr
    build = [c for c in s.calls() if "install-llama-server" in c]
    assert build == [f"{s.user} cache={s.cache} cache_exists=yes install-llama-server"]
    assert "runuser" not in r.stdout


@needs_root
def test_unit_paths_and_cache_state_directories_outside_var(sandbox):
    s = sandbox
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    unit = (s.units / "llama-gateway.service").read_text()
    d = _directives(unit)
    # systemd would create (and chown) /var/cache/llama-gateway for a cache elsewhere
    assert "CacheDirectory" not in d and "StateDirectory" not in d
    assert d["ReadWritePaths"] == [f"{s.cache} {s.state}"]
    assert d["ExecStart"] == [f"{s.prefix}/venv/bin/llama-gateway serve -c {s.conf}/gateway.yaml"]
    assert d["User"] == [s.user]
    # the comment's build command, for this install
    assert (f"runuser -u {s.user} -- env LLAMA_GATEWAY_CACHE={s.cache} \\\n"
            f"#     {s.prefix}/venv/bin/llama-gateway install-llama-server") in unit
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", str(s.units / "llama-gateway.service")],
                           capture_output=True, text=True)
        assert v.returncode == 0 and "llama-gateway.service" not in v.stderr, v.stderr


@needs_root
def test_unit_cache_state_directories_follow_paths_under_var(sandbox):
    s = sandbox
    tag = "lgdt-" + uuid.uuid4().hex[:8]
    cache, state = Path("/var/cache", tag, "llama-gateway"), Path("/var/lib", tag, "llama-gateway")
    try:
        r = _run(s.env(CACHE_DIR=str(cache), STATE_DIR=str(state)), "--no-build")
        assert r.returncode == 0, r.stderr
        d = _directives((s.units / "llama-gateway.service").read_text())
        assert d["CacheDirectory"] == [f"{tag}/llama-gateway"]
        assert d["StateDirectory"] == [f"{tag}/llama-gateway"]
        assert d["ReadWritePaths"] == [f"{cache} {state}"]
    finally:
        shutil.rmtree(Path("/var/cache", tag), ignore_errors=True)
        shutil.rmtree(Path("/var/lib", tag), ignore_errors=True)


# --- the venv's python ---------------------------------------------------------------------

@needs_root
def test_refuses_a_python_the_service_user_cannot_run(sandbox):
    s = sandbox
    hidden = s.private_dir() / "python"
    shutil.copy2(s.stub / "python", hidden)
    r = _run(s.env(PYTHON=str(hidden)), "--no-build")
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot run PYTHON=" in err[0] and "PYTHON=/usr/bin/python3" in err[0]
    assert not (s.prefix / "venv").exists()


@needs_root
def test_refuses_a_python_that_protecthome_hides(sandbox):
    s = sandbox  # e.g. pyenv's, as root's python3: its interpreter lives under /root
    (s.stub / "fake-base").write_text("/root/.pyenv/versions/3.11.7/bin/python3.11\n")
    r = _run(s.env(), "--no-build")
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "ProtectHome" in err[0] and "PYTHON=/usr/bin/python3" in err[0]
    assert not s.prefix.exists() and not s.conf.exists()  # refused before making anything


def _old_venv(s: Sandbox, python_text: str | None = None, link_to: Path | None = None) -> None:
    b = s.prefix / "venv" / "bin"
    b.mkdir(parents=True)
    (s.prefix / "venv" / "pyvenv.cfg").write_text("home = /somewhere/else\n")
    if link_to is not None:
        (b / "python").symlink_to(link_to)
    else:
        (b / "python").write_text(python_text)
        (b / "python").chmod(0o755)


@needs_root
def test_recreates_a_venv_the_service_user_cannot_run(sandbox):
    s = sandbox  # made before from a python under /root (0700): root runs it, the user cannot
    old_py = s.private_dir() / "python3"
    shutil.copy2(s.stub / "venv-python", old_py)
    _old_venv(s, link_to=old_py)
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    assert f"recreating {s.prefix}/venv: {s.user} cannot run its python" in r.stdout
    assert f"venv {s.prefix}/venv" in s.calls()
    assert not (s.prefix / "venv" / "bin" / "python").is_symlink()


@needs_root
def test_recreates_a_venv_of_another_python(sandbox):
    s = sandbox  # e.g. the system python moved from 3.9 to 3.11 under it
    _old_venv(s, python_text="#!/bin/sh\necho 3.9; echo /usr/bin/python3.9\n")
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    assert f"recreating {s.prefix}/venv: its python is not PYTHON=" in r.stdout
    assert f"venv {s.prefix}/venv" in s.calls()


@needs_root
def test_keeps_a_good_venv(sandbox):
    s = sandbox
    assert _run(s.env(), "--no-build").returncode == 0
    r = _run(s.env(), "--no-build")
    assert r.returncode == 0, r.stderr
    assert "recreating" not in r.stdout
    assert [c for c in s.calls() if c.startswith("venv ")] == [f"venv {s.prefix}/venv"]
    assert sum(c.startswith("pip install -q --upgrade /") for c in s.calls()) == 2  # upgraded


# --- uninstall -----------------------------------------------------------------------------

@needs_root
def test_uninstall_removes_only_what_install_put_in_prefix(sandbox):
    s = sandbox
    assert _run(s.env(), "--no-build").returncode == 0
    (s.prefix / "bin").mkdir()
    (s.prefix / "bin" / "other-tool").write_text("another program\n")
    r = _run(s.env(), "--uninstall")
    assert r.returncode == 0, r.stderr
    assert (s.prefix / "bin" / "other-tool").read_text() == "another program\n"
    assert not (s.prefix / "venv").exists() and not (s.prefix / "README.md").exists()
    assert not (s.units / "llama-gateway.service").exists()
    assert f"kept {s.prefix} (not empty)" in r.stdout
    assert (s.conf / "gateway.yaml").exists() and s.cache.exists()  # no --purge


@needs_root
def test_purge_removes_only_what_install_put_in_conf_cache_state(sandbox):
    s = sandbox
    cache, state = s.root / "var-cache" / "llama-gateway", s.root / "shared-state"
    assert _run(s.env(CACHE_DIR=str(cache), STATE_DIR=str(state)), "--no-build").returncode == 0
    (s.conf / "other.conf").write_text("someone else's\n")
    (state / "keep-me").write_text("x\n")
    r = _run(s.env(CACHE_DIR=str(cache), STATE_DIR=str(state)), "--uninstall", "--purge")
    assert r.returncode == 0, r.stderr
    assert (s.conf / "other.conf").read_text() == "someone else's\n"
    assert not (s.conf / "gateway.yaml").exists() and not (s.conf / "llama-gateway.env").exists()
    assert f"kept {s.conf} (not empty)" in r.stdout
    assert not cache.exists() and f"removed {cache}" in r.stdout  # the service's own
    assert (state / "keep-me").exists() and f"kept {state} (not named llama-gateway" in r.stdout
    assert not s.prefix.exists()  # held only what install put there


@needs_root
def test_uninstall_reports_only_what_it_removed(sandbox):
    s = sandbox
    r = _run(s.env(SERVICE_USER="lgdt-nobody"), "--uninstall", "--purge")
    assert r.returncode == 0, r.stderr
    assert "removed" not in r.stdout, r.stdout
    assert not s.prefix.exists() and not s.conf.exists()


# --- for real ------------------------------------------------------------------------------

@needs_root
@pytest.mark.slow
def test_real_install_with_the_system_python(sandbox):
    """The checkout pip-installed into a venv of the system python; check-config run for real
    as the service user: a model file the service user cannot read stops the install."""
    s = sandbox
    env = s.env(PYTHON=SYSTEM_PYTHON)
    s.conf.mkdir()
    from workers.demo_model import write_demo_model
    model = write_demo_model(s.private_dir() / "model.gguf")  # a GGUF root reads, the user not
    (s.conf / "gateway.yaml").write_text(
        f'listen: "127.0.0.1:11434"\nmodels:\n  - {{name: m, path: {model}, cpu: 1}}\n')
    r = _run(env, "--no-build", timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "invalid config" in r.stderr and f"models[0].path: " in r.stderr, r.stderr[-800:]
    assert f"{model}\n" in r.stderr and "does not pass check-config as" in r.stderr
    (s.conf / "gateway.yaml").write_text('models:\n  - {name: demo, path: "builtin:demo", cpu: 1}\n')
    r = _run(env, "--no-build", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed llama-gateway" in r.stdout
    v = subprocess.run(["runuser", "-u", s.user, "--", f"{s.prefix}/venv/bin/llama-gateway",
                        "--version"], capture_output=True, text=True, cwd="/")
    assert v.returncode == 0 and v.stdout.strip() in r.stdout
    r = _run(env, "--uninstall", "--purge")
    assert r.returncode == 0, r.stderr
    assert not s.prefix.exists() and (s.conf / "gateway.yaml").exists() is False
    assert s.cache.exists()  # "cache" is not named llama-gateway: kept, and said so
    assert f"kept {s.cache} (not named llama-gateway" in r.stdout
