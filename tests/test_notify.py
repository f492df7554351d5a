"""gateway.notify against a real unix datagram socket."""

import asyncio
import os
import socket

from gateway.notify import Notifier, fleet_status


def _sock(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "n.sock"))
    s.settimeout(1)
    return s


def test_messages_and_status_dedup(tmp_path):
    s = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")})
    n.status("1/2 workers ready")
    n.status("1/2 workers ready")  # unchanged: not sent again
    n.ready("2/2 workers ready")
    n.reloading()
    n.stopping()
    got = [s.recv(4096).decode() for _ in range(4)]
    assert got[0] == "STATUS=1/2 workers ready"
    assert got[1] == "READY=1\nSTATUS=2/2 workers ready"
    assert got[2].startswith("RELOADING=1\nMONOTONIC_USEC=") and int(got[2].split("=")[-1]) > 0
    assert got[3] == "STOPPING=1\nSTATUS=stopping"
    n.close()


def test_disabled_without_socket_and_watchdog_pid_respected():
    assert not Notifier({}).enabled and Notifier({}).send(READY=1) is False
    assert Notifier({"WATCHDOG_USEC": "2000000"}).watchdog_interval_s == 1.0
    other = Notifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval_s is None


async def test_watchdog_pings(tmp_path):
    s = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "100000"})
    n.start_watchdog()
    await asyncio.sleep(0.28)
    n.close()
    s.setblocking(False)
    pings = []
    try:
        while True:
            pings.append(s.recv(100))
    except BlockingIOError:
        pass
    assert pings and set(pings) == {b"WATCHDOG=1"} and 4 <= len(pings) <= 7


def test_send_failure_is_not_raised(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert n.send(READY=1) is False


def test_fleet_status():
    assert fleet_status({"a": "ready", "b": "starting"}) == "1/2 workers ready; b: starting"
    assert fleet_status({"a": "ready"}) == "1/1 workers ready"


async def test_extending_tells_systemd_while_a_long_start_step_runs(tmp_path):
    """A llama-server build before READY=1 can outlast the unit's TimeoutStartSec: while it runs
    the start timeout is extended (EXTEND_TIMEOUT_USEC, systemd >= 236) with a STATUS line."""
    s = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")})

    async def step():
        await asyncio.sleep(0.35)
        return "built"

    assert await n.extending(step(), "building llama-server", every_s=0.1, by_s=60) == "built"
    got = []
    s.settimeout(0.1)
    try:
        while True:
            got.append(s.recv(4096).decode())
    except socket.timeout:
        pass
    assert got[0] == "STATUS=building llama-server"  # once: unchanged status lines are not resent
    extends = [m for m in got if m == "EXTEND_TIMEOUT_USEC=60000000"]
    assert len(extends) >= 2 and len(got) == 1 + len(extends), got  # every 0.1 s of 0.35 s
    assert await n.extending(asyncio.sleep(0, "quick"), "x", every_s=0.1) == "quick"
    n.close()
