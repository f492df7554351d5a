"""Client side of the gateway's status and admin API (``llama-gateway status|worker|reload``).

Talks HTTP (httpx) to a running gateway: ``--url`` or ``$LLAMA_GATEWAY_URL`` (default
``http://127.0.0.1:11434``); admin verbs send ``--token`` or ``$LLAMA_GATEWAY_ADMIN_TOKEN``.
"""

from __future__ import annotations

import os

import httpx

DEFAULT_URL = "http://127.0.0.1:11434"


class AdminError(Exception):
    """The gateway answered an error (message from its ``{"error": ...}``) or was unreachable."""


def _url(url: str | None) -> str:
    """The gateway's base URL: ``url``, ``$LLAMA_GATEWAY_URL`` or the default; ``host:port``
    without a scheme means http (as ``OLLAMA_HOST`` does; it was an httpx error)."""
    u = (url or os.environ.get("LLAMA_GATEWAY_URL") or DEFAULT_URL).rstrip("/")
    return u if "://" in u else "http://" + u


def _call(method: str, url: str, token: str | None = None, timeout: float = 10) -> dict:
    headers = {}
    tok = token or os.environ.get("LLAMA_GATEWAY_ADMIN_TOKEN")
    if tok:
        headers["Authorization"] = f"Bearer {tok}"
    try:
        r = httpx.request(method, url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise AdminError(f"{url}: {e}") from None
    try:
        body = r.json()
    except ValueError:
        raise AdminError(f"{url}: HTTP {r.status_code}: {r.text[:200]}") from None
    if r.status_code >= 400:
        raise AdminError(f"HTTP {r.status_code}: {body.get('error', body)}")
    return body


def fetch_status(url: str | None = None, token: str | None = None) -> dict:
    """``GET /gateway/api/workers``; open unless ``auth.keys`` is set, then it needs the admin
    token (or an admin key) from ``token`` or ``$LLAMA_GATEWAY_ADMIN_TOKEN``."""
    return _call("GET", _url(url) + "/gateway/api/workers", token)


def worker_action(action: str, worker: str, url: str | None = None, token: str | None = None,
                  timeout: float = 600) -> dict:
    """``action`` in drain|undrain|restart. Restart waits until the worker is ready again."""
    return _call("POST", f"{_url(url)}/gateway/api/admin/workers/{worker}/{action}", token, timeout)


def reload(url: str | None = None, token: str | None = None, timeout: float = 900) -> dict:
    return _call("POST", _url(url) + "/gateway/api/admin/reload", token, timeout)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _gib(b) -> str:
    return f"{b / 2**30:.1f}"


def status_table(st: dict) -> str:
    """One row per worker (its GPU): state, slots busy/total, KV fill, queue, tokens/s, the
    relative speed the scheduler uses, GPU util and memory, restarts; then one line with queue
    and in-flight totals."""
    head = ["WORKER", "GPU", "STATE", "SLOTS", "KV", "DEFERRED", "TOK/S", "SPEED", "GPU UTIL",
            "GPU MEM GiB", "RESTARTS"]
    rows = [head]
    for w in st["workers"]:
        g = w.get("gpu")
        rows.append([
            w["id"], "+".join(map(str, w["gpus"])) or "cpu",
            w["state"] + (f" ({w['detail']})" if w.get("detail") else ""),
            f"{w['busy']}/{w['slots']}", _pct(w.get("kv_fill")),
            "-" if w.get("deferred") is None else str(w["deferred"]),
            "-" if w.get("tokens_per_s") is None else f"{w['tokens_per_s']:.1f}",
            f"{w.get('speed', 1.0):.2f}",
            f"{g['util_percent']}%" if g else "-",
            f"{_gib(g['memory_used_bytes'])}/{_gib(g['memory_total_bytes'])}" if g else "-",
            str(w["restarts"]),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    q = st["queue"]
    by = ", ".join(f"prio {k}: {v}" for k, v in q.get("by_priority", {}).items())
    lines.append(f"queue {q['depth']}/{q['max_pending']}" + (f" ({by})" if by else "")
                 + f"; in flight {st.get('in_flight', 0)}"
                 + ("; SHUTTING DOWN" if st.get("shutting_down") else ""))
    return "\n".join(lines) + "\n"
