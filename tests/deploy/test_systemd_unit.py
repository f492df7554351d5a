"""deploy/llama-gateway.service passes ``systemd-analyze verify``; deploy/install.sh parses.

verify checks that ExecStart's binary exists and is executable. The installed unit points to
/opt/llama-gateway/venv/bin/llama-gateway, which does not exist on a build machine, so the
test verifies a copy whose ExecStart runs this checkout's gateway with the test's Python
(an existing executable, same arguments); every other line is verified as shipped. A copy
with a misspelt directive must fail, so the check can fail.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "llama-gateway.service"

needs_verify = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                  reason="systemd-analyze not installed")


def _copy(tmp_path: Path, text: str) -> Path:
    text = re.sub(r"^ExecStart=/opt/llama-gateway/venv/bin/llama-gateway ",
                  f"ExecStart={sys.executable} -m gateway ", text, flags=re.M)
    p = tmp_path / "llama-gateway.service"
    p.write_text(text)
    return p


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)


@needs_verify
def test_unit_verifies(tmp_path):
    text = UNIT.read_text()
    p = _copy(tmp_path, text)
    assert f"ExecStart={sys.executable} -m gateway serve" in p.read_text()
    r = _verify(p)
    assert r.returncode == 0, r.stderr
    assert "llama-gateway.service" not in r.stderr, r.stderr  # no warnings about our unit


@needs_verify
def test_verify_catches_a_broken_unit(tmp_path):
    p = _copy(tmp_path, UNIT.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    r = _verify(p)
    assert "mixd" in r.stderr  # a warning (exit 0), which test_unit_verifies treats as failure
    # and why the copy is needed: the shipped /opt path does not exist here
    (tmp_path / "as-shipped").mkdir()
    shipped = tmp_path / "as-shipped" / "llama-gateway.service"
    shipped.write_text(UNIT.read_text())
    r = _verify(shipped)
    assert r.returncode != 0 and "/opt/llama-gateway/venv/bin/llama-gateway" in r.stderr


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_unit_settings():
    d = _directives(UNIT.read_text())
    assert d["Type"] == ["notify"] and d["KillMode"] == ["mixed"]
    assert d["User"] == ["llama-gateway"]
    for k in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert d[k] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]
    assert "/var/cache/llama-gateway" in d["ReadWritePaths"][0]
    assert any("nvidia" in v for v in d["DeviceAllow"])
    assert d["WatchdogSec"] and d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    # TimeoutStopSec above the default drain time plus the worker stop grace
    cfg = parse_config({"models": [{"name": "demo", "path": "builtin:demo"}]})
    assert int(d["TimeoutStopSec"][0]) > cfg.shutdown.drain_s + cfg.llama_server.stop_grace_s
    env = (ROOT / "deploy" / "llama-gateway.env").read_text()
    assert "LLAMA_GATEWAY_CACHE=/var/cache/llama-gateway" in env
    # the documentation it names is a file install.sh puts there (it named docs/operations.md,
    # which the project does not have; a fresh tester's find)
    doc, = d["Documentation"]
    assert doc == "file:///opt/llama-gateway/README.md"
    assert 'cp -f "$SRC/README.md" "$PREFIX/"' in (ROOT / "deploy" / "install.sh").read_text()


def test_install_script_parses_and_refuses_unknown_options():
    script = ROOT / "deploy" / "install.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def test_device_allow_names_both_driver_generations():
    # /proc/devices names major 195 `nvidia-frontend` before driver 545/550 and `nvidia` +
    # `nvidiactl` since; a name not there allows nothing (systemd skips it), so with only the
    # old name the service saw no GPU on a current driver (tester H, F8)
    allowed = {v.split()[0] for v in _directives(UNIT.read_text())["DeviceAllow"]}
    assert {"char-nvidia", "char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm",
            "char-nvidia-modeset", "char-nvidia-caps"} <= allowed
    assert all(v.split()[1] == "rw" for v in _directives(UNIT.read_text())["DeviceAllow"])


def test_invalid_config_is_not_restarted_and_start_timeout_covers_a_worker_start():
    text = UNIT.read_text()
    d = _directives(text)
    # the gateway exits 2 for an invalid config (gateway/cli.py); restarting every 5 s cannot help
    assert d["RestartPreventExitStatus"] == ["2"]
    bad = ROOT / "tests" / "deploy" / "no-such-config.yaml"
    # a process of its own: the CLI configures logging, which in this process would filter
    # the debug events later tests capture
    r = subprocess.run([sys.executable, "-m", "gateway", "check-config", "-c", str(bad)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    cfg = parse_config({"models": [{"name": "demo", "path": "builtin:demo"}]})
    assert int(d["TimeoutStartSec"][0]) > cfg.llama_server.startup_timeout_s
    before = text.split("\nTimeoutStartSec=")[0].rsplit("\n\n", 1)[-1]
    assert "startup_timeout_s" in before.rsplit("KillSignal=", 1)[-1]  # said next to it


def test_unit_and_env_file_say_what_they_should():
    text = UNIT.read_text()
    # after install.sh --no-build, the build before the first start (not within TimeoutStartSec)
    assert "install-llama-server" in text and "--no-build" in text
    env = (ROOT / "deploy" / "llama-gateway.env").read_text()
    # the gateway sets each worker's CUDA_VISIBLE_DEVICES itself and counts GPUs through NVML
    assert not re.search(r"^#?\s*CUDA_VISIBLE_DEVICES=", env, flags=re.M)
    assert "gpus:" in env and "ignored" in env
