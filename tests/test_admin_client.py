"""gateway/admin_client.py: where the CLI's status/worker/reload verbs send their requests."""

from gateway.admin_client import _url


def test_url_without_a_scheme_means_http(monkeypatch):
    """``status --url 127.0.0.1:19237`` was an httpx error (a fresh tester's find); a URL
    with its scheme is kept, and the environment variable reads the same way."""
    monkeypatch.delenv("LLAMA_GATEWAY_URL", raising=False)
    assert _url("127.0.0.1:19237") == "http://127.0.0.1:19237"
    assert _url("https://gw.example.com/") == "https://gw.example.com"
    monkeypatch.setenv("LLAMA_GATEWAY_URL", "localhost:11434")
    assert _url(None) == "http://localhost:11434"
