"""gateway.reload's systemd side: a long reload extends systemd's timeout as start-up does.

The gateway here is a FAKE stand-in (only the attributes ``Reloader.reload`` reads); the
notifications go to a real unix datagram socket. Reloads on real workers are in
tests/e2e/test_reload_shutdown.py."""

import asyncio
import socket
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter

import gateway.notify as notify
from gateway.notify import Notifier
from gateway.reload import ReloadResult, Reloader


def _fake_gateway(tmp_path, ready_sent: bool):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "n.sock"))
    s.settimeout(0.1)
    reloads = Counter("reloads", "FAKE gateway's reload counter", ["result"],
                      registry=CollectorRegistry())
    started = asyncio.Event()
    started.set()
    gw = SimpleNamespace(ready_sent=ready_sent, stopping=asyncio.Event(), started=started,
                         metrics=SimpleNamespace(reloads=reloads),
                         notifier=Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock")}),
                         fleet_status=lambda: "2/2 workers ready")
    return gw, s


def _received(s) -> list[str]:
    got = []
    try:
        while True:
            got.append(s.recv(4096).decode())
    except socket.timeout:
        return got


async def _slow_reload(self):
    await asyncio.sleep(0.35)  # a roll-out of workers that load slowly
    return ReloadResult(True, changed=["demo-gpu0"])


async def test_a_long_reload_extends_systemds_timeout(tmp_path, monkeypatch):
    """systemd times a reload (RELOADING=1 … READY=1) by TimeoutStartSec (300 s in the unit),
    and a roll-out restarts changed workers one after another, each up to startup_timeout_s
    (180 s): 8 changed workers of a model that loads in a minute outlasted it, and
    ``systemctl reload`` failed while the reload went on. EXTEND_TIMEOUT_USEC is now sent
    every EXTEND_EVERY_S while a reload runs (0.1 s here), then READY=1."""
    monkeypatch.setattr(notify, "EXTEND_EVERY_S", 0.1)
    monkeypatch.setattr(Reloader, "_reload", _slow_reload)
    gw, s = _fake_gateway(tmp_path, ready_sent=True)
    res = await Reloader(gw, "gateway.yaml").reload()
    assert res.ok and res.changed == ["demo-gpu0"]
    got = _received(s)
    assert got[0].startswith("RELOADING=1\nMONOTONIC_USEC="), got
    assert got[-1] == "READY=1\nSTATUS=2/2 workers ready", got
    extends = [m for m in got if m == f"EXTEND_TIMEOUT_USEC={int(notify.EXTEND_BY_S * 1e6)}"]
    assert len(extends) >= 2, got  # every 0.1 s of 0.35 s
    assert "STATUS=reloading" in got
    assert gw.metrics.reloads.labels("ok")._value.get() == 1
    gw.notifier.close()
    s.close()


async def test_a_reload_before_start_ups_ready_sends_nothing(tmp_path, monkeypatch):
    """Before start-up's READY=1 a reload neither says RELOADING/READY nor extends: start-up's
    own extension (Gateway._watch) covers that time."""
    monkeypatch.setattr(notify, "EXTEND_EVERY_S", 0.1)
    monkeypatch.setattr(Reloader, "_reload", _slow_reload)
    gw, s = _fake_gateway(tmp_path, ready_sent=False)
    assert (await Reloader(gw, "gateway.yaml").reload()).ok
    assert _received(s) == []
    gw.notifier.close()
    s.close()


async def test_a_reload_asked_for_before_the_fleet_started_waits_for_it(tmp_path, monkeypatch):
    """A SIGHUP during start-up (before ``Gateway.start`` built and started the fleet) ran the
    reload at once, which died of an AttributeError on the missing fleet (its task's exception
    was never retrieved). It now waits for ``Gateway.started``."""
    monkeypatch.setattr(Reloader, "_reload", _slow_reload)
    gw, s = _fake_gateway(tmp_path, ready_sent=False)
    gw.started.clear()
    task = asyncio.ensure_future(Reloader(gw, "gateway.yaml").reload())
    await asyncio.sleep(0.5)
    assert not task.done()  # _slow_reload takes 0.35 s: it has not begun
    gw.started.set()
    assert (await asyncio.wait_for(task, 5)).ok
    gw.notifier.close()
    s.close()
