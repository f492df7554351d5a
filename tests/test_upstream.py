"""Unit test of gateway.upstream's settings: one path (``Upstream.configure``) takes the limits
of a config, at start and on reload (the request paths are covered end to end in tests/e2e)."""

import time

from gateway.admission import Admission
from gateway.config import parse_config
from gateway.scheduling import Dispatcher
from gateway.upstream import Upstream


def _config(first_byte_s, request_s, inter_token_s, client_write_s, write_buffer_bytes,
            spare_connections=True):
    return parse_config({
        "models": [{"name": "demo", "path": "builtin:demo"}],
        "timeouts": {"first_byte_s": first_byte_s, "request_s": request_s,
                     "inter_token_s": inter_token_s, "client_write_s": client_write_s},
        "limits": {"write_buffer_bytes": write_buffer_bytes},
        "llama_server": {"spare_connections": spare_connections}})


def _limits(up: Upstream) -> tuple:
    wd = up.watchdog
    return (up.first_byte_s, up.request_s, wd.first_byte_s, wd.inter_token_s,
            wd.client_write_s, wd.write_buffer_bytes)


def test_limits_come_from_the_config_at_start_and_on_reload():
    up = Upstream(Admission(Dispatcher(time.monotonic)), lambda worker_id: None,
                  _config(5, 50, 2, 3, 4096, spare_connections=False))
    assert _limits(up) == (5, 50, 5, 2, 3, 4096)
    assert up.spares is None and up.watchdog.tick_s == 0.5
    up.configure(_config(0.4, 40, 8, 9, 8192))  # a reload
    assert _limits(up) == (0.4, 40, 0.4, 8, 9, 8192)
    assert up.watchdog.tick_s == 0.1  # the watchdog ticks for the new first-byte limit
    assert up.spares is None  # fixed for the client's life (a restart-only setting)
