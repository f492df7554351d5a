"""No llama-server outlives the gateway (field case 14): SIGKILL of the gateway while its
workers load and while they serve; the next start on the same address is clean."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import time

import httpx
import psutil
import pytest

from workers.provision import ensure_llama_server

from tests.conftest import (base_config, free_port, llama_server_pids, orphaned, pid_alive,
                            start_gateway)

pytestmark = pytest.mark.slow


def _children_gone(pids: set[int], timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_sigkill_gateway_while_loading_and_serving_leaves_no_worker(tmp_path):
    before = llama_server_pids()
    port = free_port()
    cfg = base_config(port)
    # 1: while the workers load
    gw = start_gateway(tmp_path, cfg, wait=False)
    pids: set[int] = set()
    ws: list[dict] = []
    end = time.monotonic() + 20
    while len(pids) < 2 and time.monotonic() < end:
        ws = gw.workers()  # one snapshot: pids and states seen together (the demo loads fast)
        pids = {w["pid"] for w in ws if w["pid"]}
        time.sleep(0.01)
    assert len(pids) == 2 and any(w["state"] == "starting" for w in ws), ws
    gw.proc.kill()
    gw.proc.wait()
    assert _children_gone(pids), "llama-server survived a SIGKILLed gateway (loading)"
    # 2: next start on the same address is clean, then SIGKILL while serving
    gw = start_gateway(tmp_path, cfg)
    pids = {w["pid"] for w in gw.workers()}
    body = {"model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 3000}}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=body, timeout=60)
                for _ in range(4)]
        end = time.monotonic() + 20
        while sum(w["busy"] for w in gw.workers()) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        gw.proc.kill()
        gw.proc.wait()
        for f in futs:  # clients see a broken connection, not a hang
            with pytest.raises(httpx.HTTPError):
                f.result(timeout=30)
    assert _children_gone(pids), "llama-server survived a SIGKILLed gateway (serving)"
    gw = start_gateway(tmp_path, cfg)
    ws = gw.workers()
    assert all(w["state"] == "ready" for w in ws)
    r = httpx.post(gw.url + "/api/generate", json={**body, "stream": False,
                                                   "options": {"num_predict": 4}}, timeout=60)
    assert r.status_code == 200
    assert "gateway.stale_worker_reaped" not in gw.log_path.read_text()  # nothing was left
    gw.stop()
    assert _children_gone({w["pid"] for w in ws})
    assert orphaned(llama_server_pids() - before) == set()  # other tests' workers aside


def test_a_second_gateway_on_a_live_gateways_address_refuses_and_leaves_its_workers(
        tmp_path, gateway_factory):
    """A second ``serve`` on the address a running gateway listens on must not take that
    gateway's workers for stale ones (their pid files are in run/<host>_<port>/): it exits 2
    with a one-line reason, and the running gateway keeps its workers and keeps serving."""
    import subprocess
    import sys

    gw = gateway_factory(base_config(free_port()))
    pids = {w["pid"] for w in gw.workers()}
    r = subprocess.run([sys.executable, "-m", "gateway", "serve", "-c", str(gw.cfg_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"listen: 127.0.0.1:{gw.port} is already in use" in r.stderr
    assert "Traceback" not in r.stderr and "stale_killed" not in r.stdout + r.stderr
    assert all(pid_alive(p) for p in pids)
    assert {w["pid"] for w in gw.workers()} == pids
    body = {"model": "demo", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(gw.url + "/api/generate", json=body, timeout=60).json()["done"] is True


def _start_on_port_0(tmp_path, name: str):
    """A gateway with ``listen: 127.0.0.1:0`` (one CPU worker); returns (process, the port it
    logged in ``gateway.listening``, its log path)."""
    import json
    import subprocess
    import sys

    import yaml

    from tests.conftest import ROOT
    cfg = base_config(0, models=[{"name": "demo", "path": "builtin:demo", "slots": 1,
                                  "context": 512, "cpu": 1}])
    cfg["listen"] = "127.0.0.1:0"
    path, log = tmp_path / f"{name}.yaml", tmp_path / f"{name}.log"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "-c", str(path)], cwd=ROOT,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for line in log.read_text().splitlines():
            if '"gateway.ready"' in line:
                listening = next(json.loads(x) for x in log.read_text().splitlines()
                                 if '"gateway.listening"' in x)
                return proc, int(listening["listen"].rsplit(":", 1)[1]), log
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(log.read_text()[-3000:])


def test_port_0_gateways_keep_each_others_workers(tmp_path):
    """``listen: host:0`` keyed the run directory ``run/<host>_0``, shared by every port-0
    gateway, so a second one reaped (SIGKILL) the first one's live workers at start; and the
    port the system picked was logged nowhere (a fresh tester's find). The directory and the
    ``gateway.listening`` line now carry the bound port."""
    from workers.provision import cache_root
    first, port1, _ = _start_on_port_0(tmp_path, "first")
    try:
        ws = httpx.get(f"http://127.0.0.1:{port1}/gateway/api/workers", timeout=5).json()["workers"]
        pid1 = ws[0]["pid"]
        assert (cache_root() / "run" / f"127.0.0.1_{port1}" / "demo-cpu0.pid").exists()
        second, port2, log2 = _start_on_port_0(tmp_path, "second")
        try:
            assert port2 not in (0, port1) and pid_alive(pid1)
            assert "stale_worker_reaped" not in log2.read_text()
            r = httpx.post(f"http://127.0.0.1:{port1}/api/generate", timeout=30, json={
                "model": "demo", "prompt": "x", "raw": True, "stream": False,
                "options": {"num_predict": 2}})
            assert r.status_code == 200 and r.json()["eval_count"] == 2
        finally:
            second.terminate()
            second.wait(30)
    finally:
        first.terminate()
        first.wait(30)
    assert not pid_alive(pid1)


def _wrapped_llama_servers(wrapper_pid: int) -> set[int]:
    """The llama-server processes a wrapper script process started."""
    try:
        return {c.pid for c in psutil.Process(wrapper_pid).children(recursive=True)
                if c.name() == "llama-server"}
    except psutil.Error:
        return set()


@pytest.mark.parametrize("start", ["plain", "setsid"])
def test_a_wrapper_script_without_exec_leaves_no_llama_server(tmp_path, start):
    """``llama_server.binary`` a wrapper script that starts llama-server without ``exec`` (to
    set an environment, say): the gateway signalled only the wrapper, and its llama-server,
    with its port and (on a GPU) its memory, outlived an admin restart, the gateway's SIGTERM
    and its SIGKILL, and the next start did not recognise it (a fresh tester's find). Now the
    worker's process group is signalled and waited for, and the next start finds what a
    SIGKILLed gateway left by the worker's environment marker. A wrapper that starts it with
    ``setsid`` (out of the group) is found by that marker at every stop too (a fresh tester saw
    one loaded llama-server left per restart and per stop)."""
    wrapper = tmp_path / "wrapped-llama-server"
    tag = f"ORPHAN_TEST_{os.getpid()}_{port_tag(tmp_path)}"  # finds them below if this fails
    run = (f"'{ensure_llama_server()}' \"$@\"" if start == "plain"
           else f"setsid '{ensure_llama_server()}' \"$@\" &\nwait")
    wrapper.write_text(f"#!/bin/bash\nexport {tag}=1\n{run}\n")
    wrapper.chmod(0o755)
    port = free_port()
    cfg = base_config(port, admin={"token": "t"},
                      llama_server={"binary": str(wrapper), "threads": 1})
    cfg["models"][0].update(cpu=1, slots=1)
    seen: set[int] = set()  # every llama-server seen: ended below whatever happens
    gw = start_gateway(tmp_path, cfg)
    try:
        _wrapper_lifecycle(tmp_path, cfg, gw, seen)
    finally:
        if gw.proc.poll() is None:
            gw.proc.kill()
        for pid in seen | _tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def port_tag(tmp_path) -> str:
    return "".join(c for c in tmp_path.name if c.isalnum())


def _tagged(tag: str) -> set[int]:
    """Processes whose environment has ``tag`` (the wrapper's and its llama-server's)."""
    out = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if tag in p.environ():
                out.add(p.pid)
    return out


def _wrapper_lifecycle(tmp_path, cfg, gw, seen: set[int]) -> None:
    (w,) = gw.workers()
    (first,) = _wrapped_llama_servers(w["pid"])
    seen.add(first)
    # an admin restart: the old llama-server ends before the new one starts
    r = httpx.post(gw.url + "/gateway/api/admin/workers/demo-cpu0/restart",
                   headers={"Authorization": "Bearer t"}, timeout=60)
    assert r.status_code == 200, r.text
    assert not pid_alive(first), "the wrapper's llama-server outlived a restart"
    (w,) = gw.workers()
    (second,) = _wrapped_llama_servers(w["pid"])
    seen.add(second)
    # SIGKILL of the gateway: the kernel's parent-death signal reaches the wrapper only
    gw.proc.kill()
    gw.proc.wait()
    time.sleep(0.5)
    assert pid_alive(second)  # the orphan this test is about; the next start must end it
    gw = start_gateway(tmp_path, cfg)
    try:
        _after_sigkill(gw, second, seen)
    finally:
        if gw.proc.poll() is None:
            gw.proc.kill()


def _after_sigkill(gw, second: int, seen: set[int]) -> None:
    assert _children_gone({second}), "the next start left the orphan running"
    assert f'"pid": {second}' in gw.log_path.read_text()  # gateway.stale_worker_reaped
    (w,) = gw.workers()
    (third,) = _wrapped_llama_servers(w["pid"])
    seen.add(third)
    # SIGTERM of the gateway: every process of the worker ends
    assert gw.stop() == 0
    assert _children_gone({third}), "the wrapper's llama-server outlived the gateway's stop"


def test_a_wrapper_that_detaches_llama_server_and_exits_leaves_none_behind(tmp_path):
    """A wrapper that starts llama-server detached (``setsid … &``) and exits: the gateway saw
    its worker exit, restarted it, and the detached server lived on, one more per restart (a
    fresh tester's find: 5 in 60 s). What a worker's process leaves when it exits is ended
    (by its group and the worker's environment marker), so at most one runs at a time, and
    none after the gateway's stop."""
    tag = f"DETACH_TEST_{os.getpid()}_{port_tag(tmp_path)}"
    wrapper = tmp_path / "detaching-llama-server"
    wrapper.write_text(f"#!/bin/bash\nexport {tag}=1\n"
                       f"setsid '{ensure_llama_server()}' \"$@\" &\nsleep 2\nexit 0\n")
    wrapper.chmod(0o755)
    cfg = base_config(free_port(), llama_server={
        "binary": str(wrapper), "threads": 1, "restart_backoff_initial_s": 0.5})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = start_gateway(tmp_path, cfg, wait=False)
    try:
        most = 0
        end = time.monotonic() + 15  # several exits and restarts
        while time.monotonic() < end:
            most = max(most, len([p for p in _tagged(tag) if p in llama_server_pids()]))
            time.sleep(0.2)
        assert most <= 1, most
        assert '"worker.leftovers_killed"' in gw.log_path.read_text()
        assert gw.stop() == 0
        assert _children_gone(_tagged(tag) & llama_server_pids()), "left after the stop"
    finally:
        if gw.proc.poll() is None:
            gw.proc.kill()
        for pid in _tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
