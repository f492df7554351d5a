"""gateway/listen.py: binding the listening sockets first."""

import socket

import pytest

from gateway.config import ConfigError
from gateway.listen import bind_listen


def test_binds_and_listens_then_a_second_bind_is_a_clear_config_error():
    socks = bind_listen("127.0.0.1", 0)
    try:
        port = socks[0].getsockname()[1]
        c = socket.create_connection(("127.0.0.1", port), timeout=2)  # accepted by the backlog
        c.close()
        with pytest.raises(ConfigError) as e:
            bind_listen("127.0.0.1", port, "gw.yaml")
        assert str(e.value).startswith(f"gw.yaml: listen: 127.0.0.1:{port} is already in use")
    finally:
        for s in socks:
            s.close()


def test_an_address_of_another_machine_is_a_config_error():
    with pytest.raises(ConfigError, match="listen: cannot listen on 192.0.2.1:"):
        bind_listen("192.0.2.1", 0)  # TEST-NET-1: never a local address


def test_the_open_files_limit_is_raised_to_the_hard_one():
    import resource

    from gateway.listen import raise_open_files_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 300:
        pytest.skip(f"hard limit {hard}: nothing to raise to here")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert raise_open_files_limit() == (256, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_open_files_limit() == (hard, hard)  # already there: unchanged
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
