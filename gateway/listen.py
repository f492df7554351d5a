"""The gateway's listening sockets, bound first thing at start.

Binding before anything else means a second ``serve`` on an address a running gateway already
listens on stops at once with a clear error, before it reaps "stale" workers: the pid files of
``run/<host>_<port>/`` belong to the gateway that owns that address, so they are stale only once
this process owns it (field case 14; a fresh tester saw a second start ``kill -9`` a live
gateway's workers and then die with a traceback). The sockets are handed to aiohttp
(``web.SockSite``) once the app is built; connections that arrive meanwhile wait in the backlog.
"""

from __future__ import annotations

import errno
import resource
import socket

from gateway.config import ConfigError

BACKLOG = 128


def address(host: str, port: int) -> str:
    """``host:port`` as ``listen`` writes it (an IPv6 host in brackets: ``[::1]:11434``)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listen(host: str, port: int, source: str = "<config>") -> list[socket.socket]:
    """Listening TCP sockets for every address ``host`` resolves to (as asyncio's
    ``create_server`` would bind them: ``SO_REUSEADDR``, IPv6 sockets ``IPV6_V6ONLY``).

    Raises:
        ConfigError: ``listen: 127.0.0.1:11434 is already in use …`` when another process
            listens there; ``listen: …: <OS error>`` when the address cannot be bound or
            resolved.
    """
    where = address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ConfigError(f"listen: cannot resolve {where}: {e}", source) from None
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(family, type_, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(BACKLOG)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"listen: {where} is already in use (another llama-gateway, Ollama "
                              f"or other server listens there); stop it or choose another "
                              f"address", source) from None
        raise ConfigError(f"listen: cannot listen on {where}: {e.strerror or e}", source) from None
    return socks


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to its hard limit, as
    servers that hold a connection per client do; returns (before, after). Each client
    connection, worker stream and probe is a descriptor: at the common shell default of 1,024
    idle client connections used them up, and the gateway could not open a socket to its own
    workers (a fresh tester's find). The deploy unit sets ``LimitNOFILE=65536`` itself."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard
