"""Unit tests of gateway.auth: key hashing, key ring, per-key rate bucket, Host rules, CORS."""

import pytest

from gateway.auth import Cors, HostCheck, KeyRing, allowed_host, hash_key
from gateway.cli import main
from gateway.config import ConfigError, parse_config


def cfg(**over):
    return parse_config({"models": [{"name": "demo", "path": "builtin:demo", "aliases": ["d"]},
                                    {"name": "other", "path": "builtin:demo"}], **over})


def test_hash_key_and_cli(capsys):
    assert hash_key("foo") == "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
    assert main(["hash-key", "foo"]) == 0
    assert capsys.readouterr().out == hash_key("foo") + "\n"
    assert main(["hash-key"]) == 0
    out = capsys.readouterr().out.splitlines()
    key, digest = out[0].split()[-1], out[1].split()[-1]
    assert key.startswith("lgw-") and digest == hash_key(key)


def test_key_ring_lookup_models_and_rate():
    c = cfg(auth={"keys": [{"name": "a", "sha256": hash_key("k1"), "models": ["d"],
                            "rate_per_minute": 2}]})
    ring = KeyRing(c)
    assert ring.enabled
    k = ring.lookup("Bearer k1")
    assert k is not None and ring.lookup("bearer k1") is k
    assert ring.lookup("Bearer k2") is None and ring.lookup("Basic k1") is None
    assert ring.lookup(None) is None and ring.lookup("Bearer ") is None
    assert k.allows_model("demo:latest") and k.allows_model("DEMO") and not k.allows_model("other")
    assert k.take_token(100.0) == 0 and k.take_token(100.0) == 0
    wait = k.take_token(100.0)
    assert 29 < wait <= 30  # one request per 30 s refills
    assert k.take_token(130.1) == 0
    assert not KeyRing(cfg()).enabled


def test_auth_config_errors():
    with pytest.raises(ConfigError) as e:
        cfg(auth={"keys": [{"name": "a", "sha256": "abc"},
                           {"name": "b", "sha256": hash_key("x"), "max_concurrent": 0},
                           {"name": "c", "sha256": hash_key("x"), "models": []}]})
    text = str(e.value)
    assert "auth.keys[0].sha256: expected a SHA-256 hex digest" in text
    assert "auth.keys[1].max_concurrent: expected a positive integer or null, got 0" in text
    assert "auth.keys[2].models: expected a non-empty list" in text
    with pytest.raises(ConfigError) as e:
        cfg(auth={"keys": [{"name": "a", "sha256": hash_key("x")},
                           {"name": "b", "sha256": hash_key("x")}]})
    assert "auth.keys[1].sha256: same key as keys[0]" in str(e.value)


@pytest.mark.parametrize("host,ok", [
    ("localhost", True), ("localhost:11434", True), ("127.0.0.1:11434", True), ("[::1]:11434", True),
    ("192.168.1.5", True), ("10.0.0.1:80", True), ("0.0.0.0", True), ("a.localhost", True),
    ("printer.local", True), ("svc.internal:8080", True), ("", True),
    ("evil.com", False), ("8.8.8.8", False), ("localhost.evil.com", False),
    ("[2606:4700::1]:80", False), ("[fd00::5]:80", True), ("172.16.0.1", True), ("[::ffff:127.0.0.1]", True),
    # Go's IsPrivate, as Ollama: link-local and documentation addresses are not allowed
    ("169.254.1.1", False), ("[fe80::1]", False), ("[2001:db8::1]:80", False), ("100.64.0.1", False),
    # an IPv6 zone (RFC 6874 "%25", or a bare "%") does not change the address
    ("[::1%25lo]:11434", True), ("[fe80::1%eth0]", False), ("[fd00::5%25eth0]", True)])
def test_allowed_host(host, ok):
    assert allowed_host(host) is ok


def test_host_check_only_on_loopback_and_cors():
    assert HostCheck(cfg()).active and not HostCheck(cfg()).ok("evil.com")
    assert not HostCheck(cfg(listen="0.0.0.0:11434")).active
    assert not HostCheck(cfg(http={"check_host": False})).active
    c = Cors(cfg(http={"cors_origins": ["https://chat.example.com"]}))
    assert c.allow("https://CHAT.example.com") == "https://CHAT.example.com" and c.allow("http://x") is None
    assert Cors(cfg(http={"cors_origins": ["*"]})).allow("http://x") == "*"


@pytest.mark.parametrize("origin,allowed", [
    # Ollama's defaults (envconfig.AllowedOrigins) and browser extensions (gin-contrib/cors)
    ("http://localhost", True), ("http://localhost:3000", True), ("https://127.0.0.1:8443", True),
    ("http://0.0.0.0:8080", True), ("app://obsidian.md", True), ("file://", True),
    ("tauri://localhost", True), ("vscode-webview://abc-123", True), ("vscode-file://vscode-app", True),
    ("chrome-extension://jfgfiigpkhlkbnfnbobbkinehhfdhndo", True), ("moz-extension://x", True),
    # not local pages: another site, a name that only starts like localhost, a sandboxed frame
    ("http://evil.com", False), ("http://localhost.evil.com", False), ("http://127.0.0.1.nip.io", False),
    ("http://192.168.1.5:3000", False), ("null", False), ("https://chat.example.com", False)])
def test_default_origins_follow_ollama(origin, allowed):
    assert (Cors(cfg()).allow(origin) is not None) is allowed


def test_configured_origins_add_to_the_defaults_with_wildcards_and_own_origin_always_passes():
    c = Cors(cfg(http={"cors_origins": ["http://192.168.1.*:*", "https://chat.example.com"]}))
    assert c.allow("http://192.168.1.20:3000") and c.allow("https://chat.example.com")
    assert c.allow("http://localhost:5173")  # the defaults stay
    assert c.allow("http://192.168.2.20:3000") is None
    assert c.refused("http://evil.com", "127.0.0.1:11434") and not c.refused(None, "x")
    # the gateway's own origin (its status page) is never refused, whatever the list
    assert not c.refused("http://gpu-box.lan:11434", "gpu-box.lan:11434")
    assert c.refused("http://gpu-box.lan:11435", "gpu-box.lan:11434")
    pre = c.headers("http://192.168.1.20:3000", True)
    assert pre["Access-Control-Allow-Origin"] == "http://192.168.1.20:3000" and "POST" in pre[
        "Access-Control-Allow-Methods"] and "Authorization" in pre["Access-Control-Allow-Headers"]


def test_own_interface_addresses_are_allowed():
    """Ollama also allows this machine's own addresses (isLocalIP), whatever their class: here
    e.g. a link-local or documentation-range address of the VM's interface."""
    from gateway.auth import _own_addresses
    own = _own_addresses()
    assert "127.0.0.1" in own
    for a in own:
        assert allowed_host(f"[{a}]:11434" if ":" in a else f"{a}:11434"), a
        if ":" in a:
            assert allowed_host(f"[{a}%25eth0]:11434"), a


def test_preflight_allows_the_openai_sdk_headers_and_what_it_asks_for():
    """A browser using the OpenAI JS SDK asks for ``x-stainless-*`` and ``OpenAI-Beta`` in its
    preflight (Ollama allows them); they and any other valid header name asked for are
    allowed, a malformed name is not echoed (a tester's find: "Failed to fetch")."""
    c = Cors(cfg())
    h = c.headers("http://localhost:3000", True, requested=(
        "authorization,content-type,x-stainless-os,x-stainless-retry-count,openai-beta,bad name"))
    allowed = [n.strip().lower() for n in h["Access-Control-Allow-Headers"].split(",")]
    assert {"authorization", "content-type", "x-stainless-os", "x-stainless-retry-count",
            "openai-beta", "x-priority"} <= set(allowed)
    assert "bad name" not in allowed and len(allowed) == len(set(allowed))
    assert "PATCH" in h["Access-Control-Allow-Methods"]
    assert c.headers("http://localhost:3000", False, requested="x-a") == {
        "Access-Control-Allow-Origin": "http://localhost:3000", "Vary": "Origin"}
