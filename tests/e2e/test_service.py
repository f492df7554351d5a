"""The gateway as a service: sd_notify, /metrics, admin API and CLI, the status page."""

import concurrent.futures as cf
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, base_config, free_port, pid_alive, start_gateway
from tests.fakes import hanging_binary, slow_start_binary
from workers.provision import ensure_llama_server

pytestmark = pytest.mark.slow

ARTIFACTS = ROOT / "tests" / "artifacts"


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _stop(gw) -> None:
    pids = [w["pid"] for w in gw.workers() if w.get("pid")]
    assert gw.stop() == 0, gw.log_tail()
    assert not any(pid_alive(p) for p in pids)


def test_notify_ready_after_workers_healthy_then_watchdog(tmp_path):
    """A real NOTIFY_SOCKET owned by the test. Workers start through a deliberately slow
    wrapper (sleeps 2 s, then execs llama-server), so there is a window before READY=1."""
    wrapper, _ = slow_start_binary(tmp_path, str(ensure_llama_server()), 2)
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    cfg = base_config(free_port(), llama_server={"binary": str(wrapper), "threads": 1})
    gw = start_gateway(tmp_path, cfg, wait=False,
                       env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"})
    msgs: list[tuple[float, str, list]] = []
    ready_states = None
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                data = sock.recv(4096).decode()
            except socket.timeout:
                continue
            msgs.append((time.monotonic(), data, []))
            if "READY=1" in data.split("\n"):
                ready_states = [w["state"] for w in gw.workers()]
                break
        assert ready_states == ["ready", "ready"], msgs
        pre = [m for _, m, _ in msgs[:-1]]
        # before READY: status lines that carried worker states, none saying all ready
        assert any("STATUS=0/2 workers ready" in m for m in pre), pre
        assert not any("READY=1" in m.split("\n") for m in pre)
        # then watchdog pings every WATCHDOG_USEC/2 = 0.2 s
        pings = []
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            try:
                if sock.recv(4096).decode() == "WATCHDOG=1":
                    pings.append(time.monotonic())
            except socket.timeout:
                pass
        assert len(pings) >= 4, pings
        gw.proc.send_signal(15)
        stopping = False
        end = time.monotonic() + 30
        while time.monotonic() < end and not stopping:
            try:
                stopping = "STOPPING=1" in sock.recv(4096).decode()
            except socket.timeout:
                pass
        assert stopping
    finally:
        assert gw.stop() == 0
        sock.close()


def _recv_until_ready(sock, gw, timeout_s: float = 60) -> tuple[list[str], dict | None]:
    """Datagrams until READY=1 (that one included) and the workers' states then."""
    msgs: list[str] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            data = sock.recv(4096).decode()
        except socket.timeout:
            continue
        msgs.append(data)
        if "READY=1" in data.split("\n"):
            return msgs, {w["id"]: w for w in gw.workers()}
    return msgs, None


def _notify_socket(tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    return sock, sock_path


def test_notify_ready_once_a_hanging_worker_ended_its_first_try(tmp_path):
    """A worker that hangs while it loads (never answers ``/health``) held READY=1 until its
    crash loop ended: ``crash_loop_restarts`` × ``startup_timeout_s``, about 15 min with the
    defaults, while the unit's ``TimeoutStartSec`` is 5 min (a fresh tester's find). READY=1 now
    comes once every worker is ready or has ended its first try; the hanging one goes on being
    restarted. Its binary is a FAKE wrapper that sleeps forever for the model ``hang``."""
    wrapper = hanging_binary(tmp_path, str(ensure_llama_server()), "hang:latest")
    sock, sock_path = _notify_socket(tmp_path)
    cfg = base_config(free_port(), llama_server={
        "binary": str(wrapper), "threads": 1, "startup_timeout_s": 3,
        "restart_backoff_initial_s": 0.2, "crash_loop_restarts": 3},
        models=[{"name": "demo", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1},
                {"name": "hang", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1}])
    t0 = time.monotonic()
    gw = start_gateway(tmp_path, cfg, wait=False, env={"NOTIFY_SOCKET": str(sock_path)})
    try:
        msgs, ws = _recv_until_ready(sock, gw)
        took = time.monotonic() - t0
        assert ws is not None, msgs
        assert ws["demo-cpu0"]["state"] == "ready"
        hang = ws["hang-cpu0"]
        assert hang["state"] != "failed" and hang["restarts"] >= 1, hang  # after its 1st try
        assert 3 <= took < 9, took  # the crash loop would end after 3 tries of 3 s
        _ready_names_and_serves(gw, "hang-cpu0")
    finally:
        assert gw.stop() == 0
        sock.close()


def test_a_reload_during_start_up_sends_no_ready(tmp_path):
    """A reload (SIGHUP, the admin API) while the workers still load ended with READY=1, so
    systemd took the service as started while no worker was (a fresh tester's find). Workers
    start through a deliberately slow wrapper (2 s); the reload comes 1 s after the start.
    Workers do not inherit systemd's NOTIFY_SOCKET (sd_notify(3))."""
    wrapper, _ = slow_start_binary(tmp_path, str(ensure_llama_server()), 2, last=2)
    sock, sock_path = _notify_socket(tmp_path)
    cfg = base_config(free_port(), llama_server={"binary": str(wrapper), "threads": 1})
    gw = start_gateway(tmp_path, cfg, wait=False, env={"NOTIFY_SOCKET": str(sock_path)})
    try:
        end = time.monotonic() + 30
        while "gateway.listening" not in gw.log_path.read_text() and time.monotonic() < end:
            time.sleep(0.05)
        gw.proc.send_signal(1)  # SIGHUP: reload the same file
        msgs, ws = _recv_until_ready(sock, gw)
        assert ws is not None and {w["state"] for w in ws.values()} == {"ready"}, msgs
        assert "config.reloaded" in gw.log_path.read_text()  # the reload ran meanwhile
        assert not any(m.startswith("RELOADING=1") for m in msgs), msgs
        for w in ws.values():
            env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
            assert not any(kv.startswith(b"NOTIFY_SOCKET=") for kv in env)
        gw.proc.send_signal(1)  # after READY=1: RELOADING=1 then READY=1, as before
        got: list[str] = []
        end = time.monotonic() + 30
        while time.monotonic() < end and not any("READY=1" in m.split("\n") for m in got):
            try:
                got.append(sock.recv(4096).decode())
            except socket.timeout:
                pass
        assert any(m.startswith("RELOADING=1") for m in got), got
    finally:
        assert gw.stop() == 0
        sock.close()


def test_cuda_visible_devices_for_the_gateway_is_said_to_be_ignored(tmp_path):
    """GPUs are chosen with ``models[].gpus``: NVML ignores CUDA_VISIBLE_DEVICES and each worker
    gets its own, so an operator's setting for the whole service would be dropped without a
    word (a fresh tester's find); the gateway says so in its log, and its CPU workers run."""
    cfg = base_config(free_port())
    gw = start_gateway(tmp_path, cfg, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    try:
        events = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
        (warn,) = [e for e in events if e["event"] == "gateway.cuda_visible_devices_ignored"]
        assert warn["value"] == "2,3" and "models[].gpus" in warn["hint"]
        assert [w["state"] for w in gw.workers()] == ["ready", "ready"]
    finally:
        assert gw.stop() == 0


def test_llama_arg_variables_of_gateway_flags_are_said_to_be_ignored(tmp_path):
    """``LLAMA_ARG_API_PREFIX`` in the service's environment reached every worker, whose routes
    moved under it: none became ready, with no hint why (a fresh tester's find). Such variables
    are left out of the workers' environment, and each start says which."""
    cfg = base_config(free_port())
    cfg["models"][0].update(cpu=1, slots=1)
    gw = start_gateway(tmp_path, cfg, env={"LLAMA_ARG_API_PREFIX": "/v9"})
    try:
        events = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
        ignored = [e for e in events if e["event"] == "worker.env_ignored"]
        assert ignored and ignored[0]["names"] == ["LLAMA_ARG_API_PREFIX"], ignored
        r = httpx.post(gw.url + "/api/generate", timeout=60, json={
            "model": "demo", "prompt": "hi", "raw": True, "stream": False,
            "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
    finally:
        assert gw.stop() == 0


def test_notify_ready_with_one_model_whose_worker_gives_up(tmp_path):
    """One model fine, one whose worker llama-server refuses to start (a crash loop):
    READY=1 comes once the broken one has ended its first try. It never came, so under the
    shipped unit (Type=notify, TimeoutStartSec) systemd killed the whole gateway, the healthy
    model's serving included, and restarted it in a loop (a fresh tester's find)."""
    sock, sock_path = _notify_socket(tmp_path)
    cfg = base_config(free_port(), llama_server={"threads": 1, "restart_backoff_initial_s": 0.2,
                                                 "restart_backoff_max_s": 0.5,
                                                 "crash_loop_restarts": 3},
                      models=[{"name": "demo", "path": "builtin:demo", "slots": 1,
                               "context": 512, "cpu": 1},
                              {"name": "broken", "path": "builtin:demo", "slots": 1,
                               "context": 512, "cpu": 1, "args": ["--bogus"]}])
    gw = start_gateway(tmp_path, cfg, wait=False, env={"NOTIFY_SOCKET": str(sock_path)})
    try:
        msgs, ws = _recv_until_ready(sock, gw)
        assert ws is not None, msgs
        assert ws["demo-cpu0"]["state"] == "ready" and ws["broken-cpu0"]["state"] != "ready", ws
        _ready_names_and_serves(gw, "broken-cpu0")
    finally:
        assert gw.stop() == 0
        sock.close()


def _ready_names_and_serves(gw, failed: str) -> None:
    """``gateway.ready`` names ``failed`` (of 2 workers) and the model ``demo`` serves."""
    log = gw.log_path.read_text()
    line = next(json.loads(x) for x in log.splitlines() if '"gateway.ready"' in x)
    assert line["failed"] == [failed] and line["workers"] == 2
    r = httpx.post(gw.url + "/api/generate", timeout=30, json={
        "model": "demo", "prompt": "x", "raw": True, "stream": False,
        "options": {"num_predict": 2}})
    assert r.status_code == 200


def test_metrics_count_requests_and_tokens(gateway):
    gw = gateway
    n = 5
    req = {"model": "demo", "prompt": "x", "raw": True, "stream": False,
           "options": {"num_predict": 7}}
    for _ in range(n):
        assert httpx.post(gw.url + "/api/generate", json=req, timeout=60).status_code == 200
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200
    assert httpx.post(gw.url + "/api/generate", json={"model": "nope", "prompt": "x"}).status_code == 404
    time.sleep(2.5)  # one worker stats poll
    resp = httpx.get(gw.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    s = _samples(resp.text)
    m = (("model", "demo:latest"),)
    assert s[("llama_gateway_requests_total",
              (("endpoint", "/api/generate"), ("model", "demo:latest"), ("status", "200")))] == n
    assert s[("llama_gateway_requests_total",
              (("endpoint", "/api/generate"), ("model", ""), ("status", "404")))] == 1
    assert s[("llama_gateway_generated_tokens_total", m)] == n * 7 + 3
    # the non-streamed /v1 request too: the worker streams it (gateway/api/openai_fold.py)
    assert s[("llama_gateway_time_to_first_token_seconds_count", m)] == n + 1
    assert s[("llama_gateway_request_duration_seconds_count",
              (("endpoint", "/v1/chat/completions"), ("model", "demo:latest")))] == 1
    assert s[("llama_gateway_prompt_tokens_total", m)] >= n
    w0 = (("gpu", "cpu"), ("model", "demo:latest"), ("worker", "demo-cpu0"))
    assert s[("llama_gateway_worker_slots", w0)] == 2
    assert s[("llama_gateway_worker_slots_busy", w0)] == 0
    assert s[("llama_gateway_worker_up", w0)] == 1
    assert s[("llama_gateway_worker_state", w0[:2] + (("state", "ready"),) + w0[2:])] == 1
    assert s[("llama_gateway_worker_restarts_total", w0)] == 0
    assert s[("llama_gateway_worker_kv_fill_ratio", w0)] == 0  # idle worker
    assert s[("llama_gateway_worker_requests_deferred", w0)] == 0
    assert s[("llama_gateway_queue_depth", (("priority", "0"),))] == 0
    # in flight = inference requests only: neither this scrape nor a status poll counts
    assert s[("llama_gateway_in_flight_requests", ())] == 0
    assert gw.status()["in_flight"] == 0
    with httpx.Client(timeout=60) as c, c.stream("POST", gw.url + "/api/generate", json={
            "model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 4000}}) as st:
        lines = st.iter_lines()
        next(lines)
        during = _samples(c.get(gw.url + "/metrics").text)
        assert during[("llama_gateway_in_flight_requests", ())] == 1
        assert c.get(gw.url + "/gateway/api/workers").json()["in_flight"] == 1


def test_admin_token_drain_undrain_restart_and_cli_status(gateway_factory):
    gw = gateway_factory(admin={"token": "s3cret"})
    api = gw.url + "/gateway/api/admin/workers/demo-cpu1"
    r = httpx.post(api + "/drain")
    assert r.status_code == 401 and r.json()["error"].startswith("admin token required")
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    r = httpx.post(api + "/drain", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json() == {"error": "invalid admin token"}
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = httpx.post(gw.url + "/gateway/api/admin/workers/nope/drain",
                   headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 404
    env = {**os.environ, "LLAMA_GATEWAY_ADMIN_TOKEN": "s3cret", "LLAMA_GATEWAY_URL": gw.url}
    cli = [sys.executable, "-m", "gateway"]
    out = subprocess.run(cli + ["worker", "drain", "demo-cpu1"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # a drained worker gets no new requests: 4 concurrent requests all run on demo-cpu0
    req = {"model": "demo", "prompt": "x", "raw": True, "stream": False, "options": {"num_predict": 300}}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(httpx.post, gw.url + "/api/generate", json=req, timeout=60) for _ in range(4)]
        time.sleep(0.2)
        table = subprocess.run(cli + ["status"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert all(f.result().status_code == 200 for f in futs)
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["WORKER", "GPU", "STATE", "SLOTS"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:3]}
    assert rows["demo-cpu1"][2] == "draining" and rows["demo-cpu1"][3] == "0/2"
    assert rows["demo-cpu0"][2] == "ready"
    assert lines[3].startswith("queue ")
    # /api/ps, the one status an Ollama client sees, says so too (it said "ready")
    ps = httpx.get(gw.url + "/api/ps", timeout=10).json()["models"][0]["workers"]
    assert {w["id"]: w["state"] for w in ps} == {"demo-cpu0": "ready", "demo-cpu1": "draining"}
    log = gw.log_path.read_text()
    assert '"worker": "demo-cpu1", "event": "request.done"' not in log
    assert subprocess.run(cli + ["worker", "undrain", "demo-cpu1"], cwd=ROOT, env=env).returncode == 0
    before = {w["id"]: w for w in gw.workers()}
    assert before["demo-cpu1"]["draining"] is False
    out = subprocess.run(cli + ["worker", "restart", "demo-cpu1"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    after = {w["id"]: w for w in gw.workers()}
    assert after["demo-cpu1"]["state"] == "ready"
    assert after["demo-cpu1"]["pid"] != before["demo-cpu1"]["pid"]
    assert not pid_alive(before["demo-cpu1"]["pid"])
    assert after["demo-cpu0"]["pid"] == before["demo-cpu0"]["pid"]
    bad = subprocess.run(cli + ["worker", "drain", "demo-cpu1"], cwd=ROOT,
                         env={**env, "LLAMA_GATEWAY_ADMIN_TOKEN": "x"}, capture_output=True, text=True)
    assert bad.returncode == 1 and "HTTP 401: invalid admin token" in bad.stderr


def test_every_worker_drained_answers_503_at_once_and_frees_the_queue(gateway_factory):
    cfg = base_config(free_port(), admin={"token": "s3cret"}, queue={"timeout_s": 60})
    cfg["models"][0].update(cpu=1, slots=1)
    gw = gateway_factory(cfg)
    admin = {"Authorization": "Bearer s3cret"}
    long = {"model": "demo", "prompt": "x", "raw": True, "stream": False, "options": {"num_predict": 2000}}
    short = {"model": "demo", "prompt": "x", "raw": True, "stream": False, "options": {"num_predict": 4}}
    with cf.ThreadPoolExecutor(2) as ex:
        running = ex.submit(httpx.post, gw.url + "/api/generate", json=long, timeout=120)
        time.sleep(0.3)
        queued = ex.submit(httpx.post, gw.url + "/v1/completions", timeout=120,
                           json={"model": "demo", "prompt": "x", "max_tokens": 4})
        time.sleep(0.3)
        t0 = time.monotonic()
        assert httpx.post(gw.url + "/gateway/api/admin/workers/demo-cpu0/drain", headers=admin).status_code == 200
        r = queued.result()
        assert time.monotonic() - t0 < 5  # not the 60 s queue timeout
        assert r.status_code == 503 and "drained" in r.json()["error"]["message"]
        assert r.headers["Retry-After"]
        r = httpx.post(gw.url + "/api/generate", json=short, timeout=10)
        assert r.status_code == 503 and r.json() == {
            "error": "every worker of model 'demo:latest' is drained; please try again later"}
        assert running.result().status_code == 200  # what already ran finishes
    assert httpx.post(gw.url + "/gateway/api/admin/workers/demo-cpu0/undrain", headers=admin).status_code == 200
    assert httpx.post(gw.url + "/api/generate", json=short, timeout=30).status_code == 200


def test_access_log_one_event_per_request(gateway):
    r = httpx.post(gateway.url + "/api/generate", headers={"X-Request-ID": "rid-123", "X-Priority": "3"},
                   json={"model": "demo", "prompt": "x", "raw": True, "options": {"num_predict": 5}})
    assert r.status_code == 200 and r.headers["X-Request-ID"] == "rid-123"
    import json
    time.sleep(0.2)
    events = [json.loads(ln) for ln in gateway.log_path.read_text().splitlines()
              if ln.startswith("{") and '"rid-123"' in ln]
    done = [e for e in events if e["event"] == "request.done"]
    assert len(done) == 1
    e = done[0]
    assert e["status"] == 200 and e["model"] == "demo:latest" and e["priority"] == 3
    assert e["worker"] in ("demo-cpu0", "demo-cpu1") and e["eval_count"] == 5
    assert e["ttft_ms"] > 0 and e["queue_wait_ms"] >= 0 and e["ms"] >= e["ttft_ms"]
    # At log level info the workers write no per-request info lines (workers/process.py
    # QUIET_LOG_VERBOSITY): the variable is in each worker's environment.
    for w in gateway.workers():
        env = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert b"LLAMA_ARG_LOG_VERBOSITY=2" in env


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_status_page_renders_in_headless_chromium(gateway):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed (apt-get install -y chromium); status page not rendered")
    assert httpx.get(gateway.url + "/").text == "Ollama is running"
    page = httpx.get(gateway.url + "/gateway")
    assert page.headers["content-type"].startswith("text/html")
    assert "<script src" not in page.text and "http" not in page.text.split("<script>")[1].split("fetch(")[0]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "status_page.png"
    shot.unlink(missing_ok=True)
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--virtual-time-budget=4000", f"--user-data-dir={ARTIFACTS / 'chromium-profile'}"]
    dom = subprocess.run(common + ["--dump-dom", gateway.url + "/gateway"], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for wid in ("demo-cpu0", "demo-cpu1"):
        assert f'data-worker="{wid}"' in dom.stdout
        row = dom.stdout.split(f'data-worker="{wid}"')[1].split("</tr>")[0]
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[8] == "1", cells  # speed: unmeasured while idle, no rate shown
    assert "2/2 workers ready" in dom.stdout
    subprocess.run(common + ["--window-size=1300,500", f"--screenshot={shot}", gateway.url + "/gateway"],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 5000
    shutil.rmtree(ARTIFACTS / "chromium-profile", ignore_errors=True)


_ = Path
