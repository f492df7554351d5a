"""Who may use the gateway: API keys, per-key limits, Host check, CORS.

* API keys (config ``auth.keys``) are stored as SHA-256 hex digests only; a client sends the key
  as ``Authorization: Bearer <key>`` (what the ``ollama`` and ``openai`` clients send when given
  a key/headers). No keys configured = no authentication (as Ollama).
* Per key: allowed models, a default priority class, a concurrency cap and a per-minute rate
  (token bucket whose burst equals the rate).
* Host check (DNS rebinding): while listening on loopback, a ``Host`` header that is not local
  gets 403. Same rules as Ollama's ``allowedHostsMiddleware``/``allowedHost`` (server/routes.go):
  an IP that is loopback, private or unspecified, ``localhost``, this machine's hostname, or a
  name ending in ``.localhost``, ``.local`` or ``.internal``.
* Origins (CORS), as Ollama (server/routes.go: gin-contrib/cors with ``envconfig.AllowedOrigins``
  and browser extensions allowed): a request whose ``Origin`` is neither its own origin (the
  ``Host`` it was sent to) nor an allowed one gets 403, whatever its method, so a web page
  cannot make the gateway generate with a "simple" request that needs no preflight. Allowed:
  :data:`DEFAULT_ORIGINS` (local pages on any port, desktop apps, editors' webviews, browser
  extensions) plus ``http.cors_origins`` (``*`` inside an entry matches any text; ``"*"`` alone
  allows every origin); allowed cross-origin responses carry ``Access-Control-Allow-Origin``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from functools import lru_cache

from gateway.config import ApiKeyConfig, GatewayConfig, normalize_model_name


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key's UTF-8 bytes (the form stored in ``auth.keys[].sha256``)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random key (``lgw-`` + 32 url-safe characters, 192 bits)."""
    return "lgw-" + secrets.token_urlsafe(24)


@dataclass(eq=False)
class KeyState:
    """One configured key and its live counters.

    Attributes:
        cfg: the key's configuration.
        models: normalized full names the key may use, or None for all.
        in_flight: requests of this key being served now.
        tokens / t_refill: the rate limiter's token bucket (requests) and its last refill (s).
    """

    cfg: ApiKeyConfig
    models: frozenset[str] | None
    in_flight: int = 0
    tokens: float = 0.0
    t_refill: float = field(default_factory=time.monotonic)

    def allows_model(self, full_name: str) -> bool:
        return self.models is None or normalize_model_name(full_name) in self.models

    def take_token(self, now: float) -> float:
        """Consume one request of the per-minute budget. Returns 0 when allowed, else the
        seconds until the next request would be."""
        rate = self.cfg.rate_per_minute
        if rate is None:
            return 0.0
        per_s = rate / 60.0
        self.tokens = min(float(rate), self.tokens + max(0.0, now - self.t_refill) * per_s)
        self.t_refill = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / per_s


#: Environment variable that may carry the admin token instead of ``admin.token``.
ADMIN_TOKEN_ENV = "LLAMA_GATEWAY_ADMIN_TOKEN"


def admin_token(config: GatewayConfig) -> str | None:
    """The configured admin token (``admin.token``, else ``$LLAMA_GATEWAY_ADMIN_TOKEN``)."""
    return config.admin.token or os.environ.get(ADMIN_TOKEN_ENV) or None


def is_admin_token(authorization: str | None, config: GatewayConfig) -> bool:
    """Whether ``Authorization: Bearer <token>`` carries the admin token (constant-time)."""
    expected = admin_token(config)
    if not expected or not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[7:].strip().encode(), expected.encode())


class KeyRing:
    """Lookup of presented keys. ``enabled`` is False when no key is configured."""

    def __init__(self, config: GatewayConfig):
        self.by_hash: dict[str, KeyState] = {}
        for k in config.auth.keys:
            models = None
            if "*" not in k.models:
                names = set()
                for pattern in k.models:
                    m = config.find_model(pattern)
                    names.add(normalize_model_name(m.full_name if m else pattern))
                models = frozenset(names)
            st = KeyState(k, models, tokens=float(k.rate_per_minute or 0))
            self.by_hash[k.sha256] = st

    def carry_over(self, old: "KeyRing") -> None:
        """After a reload: a key that is still configured keeps its state object (in-flight
        count, rate bucket), so requests running across the reload are counted once; removed
        keys stop working at once."""
        for h, st in list(self.by_hash.items()):
            prev = old.by_hash.get(h)
            if prev is not None:
                prev.cfg, prev.models = st.cfg, st.models
                self.by_hash[h] = prev

    @property
    def enabled(self) -> bool:
        return bool(self.by_hash)

    def lookup(self, authorization: str | None) -> KeyState | None:
        """The key of an ``Authorization: Bearer <key>`` header, or None if missing/unknown."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.by_hash.get(hash_key(token.strip()))


# ---- Host header check (Ollama allowedHostsMiddleware) ----------------------------------------

def _is_loopback_listen(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _split_host(host_header: str) -> str:
    h = host_header.strip()
    if h.startswith("["):  # [::1]:port, [fe80::1%25eth0]:port (RFC 6874 zone), [fe80::1%eth0]
        inner = h[1:h.find("]")] if "]" in h else h
        return inner.split("%", 1)[0]
    if h.count(":") == 1:
        return h.rsplit(":", 1)[0]
    return h


#: Go's ``netip.Addr.IsPrivate`` (RFC 1918 and RFC 4193), which Ollama's Host check uses;
#: Python's ``is_private`` also takes link-local, documentation and other reserved ranges.
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in
                      ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


def _own_addresses() -> frozenset[str]:
    """The addresses of this machine's network interfaces (psutil), without IPv6 zones."""
    try:
        import psutil
        return frozenset(a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values()
                         for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    except Exception:  # no psutil support here: only the address classes below count
        return frozenset()


@lru_cache(maxsize=512)
def allowed_host(host_header: str | None) -> bool:
    """True when a ``Host`` header names this machine, by the rules of Ollama's
    ``allowedHostsMiddleware`` (server/routes.go): an IP literal that is loopback, private
    (RFC 1918 / RFC 4193, as Go's ``IsPrivate``), unspecified or one of this machine's own
    addresses; ``localhost``, the machine's hostname, or a name under ``.localhost``,
    ``.local`` or ``.internal``. Link-local and other addresses are refused.

    Memoised per header value (a client sends the same one on every request; parsing it as an
    IP address cost ~40 µs per request on the 2-core development machine)."""
    host = _split_host(host_header or "").lower()
    if host in ("", "localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return (ip.is_loopback or ip.is_unspecified
                or any(ip.version == n.version and ip in n for n in _PRIVATE_NETS)
                or str(ip) in _own_addresses())
    if host == socket.gethostname().lower():
        return True
    return any(host.endswith("." + tld) for tld in ("localhost", "local", "internal"))


class HostCheck:
    """Whether the Host header must be checked for this listener (loopback only)."""

    def __init__(self, config: GatewayConfig):
        self.active = config.http.check_host and _is_loopback_listen(config.host)

    def ok(self, host_header: str | None) -> bool:
        return not self.active or allowed_host(host_header)


# ---- CORS -----------------------------------------------------------------------------------

CORS_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS, HEAD"  # gin-contrib/cors DefaultConfig
# Ollama's AllowHeaders (the first five, then its OpenAI-compatibility headers: ``OpenAI-Beta``
# and the ``x-stainless-*`` headers the OpenAI SDKs send) and the gateway's own; a preflight
# also gets back whatever other header names it asked for (``Access-Control-Request-Headers``),
# so a new SDK header does not break browser clients.
CORS_HEADERS = ("Authorization, Content-Type, User-Agent, Accept, X-Requested-With, OpenAI-Beta, "
                "X-Request-ID, X-Priority")
_CORS_HEADER_SET = frozenset(n.strip().lower() for n in CORS_HEADERS.split(","))
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an RFC 9110 token

# Origins Ollama allows without OLLAMA_ORIGINS (envconfig.AllowedOrigins: localhost, 127.0.0.1
# and 0.0.0.0 over http and https, with any port or none; app://, file://, tauri://,
# vscode-webview://, vscode-file://) and the browser-extension schemes gin-contrib/cors adds
# for AllowBrowserExtensions (config.go ExtensionSchemas), which Ollama sets.
DEFAULT_ORIGINS: tuple[str, ...] = tuple(
    f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
    for scheme in ("http", "https") for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
    "chrome-extension://*", "safari-extension://*", "moz-extension://*",
    "ms-browser-extension://*")


class Cors:
    """Which ``Origin`` values may use the gateway (module doc): :data:`DEFAULT_ORIGINS` plus
    ``http.cors_origins``, and always a request's own origin. Matching ignores case; ``*`` in a
    pattern matches any run of characters."""

    def __init__(self, config: GatewayConfig):
        extra = tuple(config.http.cors_origins)
        self.any = "*" in extra
        patterns = [p.lower() for p in DEFAULT_ORIGINS + extra if p != "*"]
        self._exact = frozenset(p for p in patterns if "*" not in p)
        wild = [".*".join(map(re.escape, p.split("*"))) for p in patterns if "*" in p]
        self._wild = re.compile("|".join(wild)) if wild else None

    def allow(self, origin: str | None, host: str = "") -> str | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin`` (``"*"`` when every origin
        is allowed, else the origin itself), or None: no Origin, or one not allowed. ``host``:
        the request's ``Host``; ``http(s)://<host>`` is the request's own origin."""
        if not origin:
            return None
        if self.any:
            return "*"
        o = origin.lower()
        if o in self._exact or (self._wild is not None and self._wild.fullmatch(o)):
            return origin
        if host and o in (f"http://{host.lower()}", f"https://{host.lower()}"):
            return origin
        return None

    def refused(self, origin: str | None, host: str) -> bool:
        """True for a request that carries an ``Origin`` that is not allowed (answer 403)."""
        return bool(origin) and self.allow(origin, host) is None

    def headers(self, origin: str | None, preflight: bool, host: str = "",
                requested: str | None = None) -> dict[str, str]:
        """CORS response headers for an allowed ``origin`` ({} otherwise); with ``preflight``
        also the allowed methods and headers (``CORS_HEADERS`` plus the valid header names in
        ``requested``, the preflight's ``Access-Control-Request-Headers``) and their cache
        time (600 s)."""
        allow = self.allow(origin, host)
        if allow is None:
            return {}
        h = {"Access-Control-Allow-Origin": allow, "Vary": "Origin"}
        if preflight:
            names = CORS_HEADERS
            if requested:
                asked = (n.strip() for n in requested.split(","))
                extra = [n for n in asked
                         if _HEADER_NAME.fullmatch(n) and n.lower() not in _CORS_HEADER_SET]
                names = ", ".join([CORS_HEADERS, *dict.fromkeys(extra)])
            h.update({"Access-Control-Allow-Methods": CORS_METHODS,
                      "Access-Control-Allow-Headers": names,
                      "Access-Control-Max-Age": "600"})
        return h
