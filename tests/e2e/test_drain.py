"""gateway/drain.py: what a client on an idle keep-alive connection sees after SIGTERM.

README "Signals": idle keep-alive connections are closed at SIGTERM, so a client's next request
on one sees the connection closed (and retries on a new one, which is refused); it must not wait
for the drain to end.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import base_config, free_port, start_gateway

pytestmark = pytest.mark.slow


def _get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_idle_keep_alive_connection_is_closed_at_sigterm(tmp_path):
    cfg = base_config(free_port(), shutdown={"drain_s": 8})
    cfg["models"][0].update(slots=1, cpu=1)
    gw = start_gateway(tmp_path, cfg)
    idle = socket.create_connection(("127.0.0.1", gw.port))
    idle.settimeout(5)
    assert _get(idle, "/api/version").startswith(b"HTTP/1.1 200")
    done = {}

    def long_stream():  # keeps the gateway draining for seconds after SIGTERM
        with httpx.stream("POST", gw.url + "/api/generate", timeout=60, json={
                "model": "demo", "prompt": "x", "raw": True,
                "options": {"num_predict": 3500}}) as r:
            done["lines"] = sum(1 for ln in r.iter_lines() if ln)

    th = threading.Thread(target=long_stream)
    th.start()
    time.sleep(0.5)
    gw.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    t0 = time.monotonic()
    try:
        idle.sendall(b'POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}')
        answer = idle.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        answer = b""
    waited = time.monotonic() - t0
    # closed (no bytes) or a 503 with Connection: close; within a second, not after the drain
    assert answer == b"" or (answer.startswith(b"HTTP/1.1 503")
                             and b"connection: close" in answer.lower()), answer[:200]
    assert waited < 1.0, waited
    assert gw.proc.poll() is None  # still draining the long stream
    th.join(30)
    assert gw.proc.wait(30) == 0 and done.get("lines", 0) > 1
