"""Access control on a real gateway: API keys with real clients, per-key limits, Host header
(DNS rebinding), CORS, and the workers' own per-start key."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket

import httpx
import ollama
import openai
import pytest

from gateway.auth import hash_key
from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import gateway_requests_total, raw_exchange

pytestmark = pytest.mark.slow

ADMIN, WEB, LIMITED, ALIASED = "admin-key-1", "web-key-2", "limited-key-3", "alias-key-4"
ADMIN_TOKEN = "admin-token-0"


def requests_total(url: str, endpoint: str, model: str, status: int) -> float:
    """``llama_gateway_requests_total`` of one label set, scraped with the admin token."""
    return gateway_requests_total(url, endpoint, model, status, token=ADMIN_TOKEN)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    from tests.conftest import start_gateway
    cfg = base_config(free_port(), admin={"token": ADMIN_TOKEN}, auth={"keys": [
        {"name": "ops", "sha256": hash_key(ADMIN), "admin": True},
        {"name": "webui", "sha256": hash_key(WEB), "models": ["demo"], "priority": 5},
        {"name": "batch", "sha256": hash_key(LIMITED), "models": ["other"],
         "max_concurrent": 1, "rate_per_minute": 3},
        {"name": "aliased", "sha256": hash_key(ALIASED), "models": ["gpt-4o"]}]},
        http={"cors_origins": ["https://chat.example.com"]})
    cfg["models"][0].update(cpu=1, slots=2)
    cfg["models"].append({"name": "other", "path": "builtin:demo", "cpu": 1, "slots": 1,
                          "context": 2048, "aliases": ["gpt-4o"]})
    gw = start_gateway(tmp_path_factory.mktemp("secured"), cfg,
                       headers={"Authorization": f"Bearer {ADMIN}"})
    yield gw
    gw.stop()


def test_missing_or_wrong_key_401_in_route_shape(secured):
    url = secured.url
    r = httpx.post(url + "/api/chat", json={"model": "demo", "messages": []})
    assert r.status_code == 401 and "API key" in r.json()["error"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/api/tags", headers={"Authorization": f"Basic {WEB}"}).status_code == 401
    assert httpx.get(url + "/").text == "Ollama is running"  # heartbeat stays open


def test_real_clients_with_keys(secured):
    c = ollama.Client(host=secured.url, headers={"Authorization": f"Bearer {WEB}"})
    out = c.generate(model="demo", prompt="hi", options={"num_predict": 4})
    assert out.done and out.done_reason == "length"
    oc = openai.OpenAI(base_url=secured.url + "/v1", api_key=WEB)
    chat = oc.chat.completions.create(model="demo", max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong").models.list()
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=secured.url).list()
    assert e.value.status_code == 401


def test_model_not_allowed_403(secured):
    h = {"Authorization": f"Bearer {WEB}"}
    before = requests_total(secured.url, "/api/generate", "other:latest", 403)
    r = httpx.post(secured.url + "/api/generate", headers=h,
                   json={"model": "other", "prompt": "x", "stream": False})
    assert r.status_code == 403 and r.json() == {"error": "key 'webui' may not use model 'other'"}
    # counted under the model it asked for (a configured one), not model=""
    assert requests_total(secured.url, "/api/generate", "other:latest", 403) == before + 1
    r = httpx.get(secured.url + "/gateway/api/workers", headers=h)
    assert r.status_code == 403  # admin endpoints need an admin key


def test_pull_of_a_model_the_key_may_not_use_403(secured):
    """/api/pull answers a forbidden model as the inference routes do (403), not "success"."""
    web = ollama.Client(host=secured.url, headers={"Authorization": f"Bearer {WEB}"})
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            out = web.pull("other", stream=stream)
            if stream:
                list(out)
        assert (e.value.status_code, e.value.error) == (403, "key 'webui' may not use model 'other'")
    r = httpx.post(secured.url + "/api/pull", headers={"Authorization": f"Bearer {WEB}"},
                   json={"name": "other:latest", "stream": False})
    assert r.status_code == 403 and r.json() == {"error": "key 'webui' may not use model 'other:latest'"}
    assert web.pull("demo", stream=False).status == "success"
    admin = ollama.Client(host=secured.url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.pull("other", stream=False).status == "success"


def test_v1_model_the_key_may_not_use_is_openai_model_not_found(secured):
    """On /v1 a model the key may not use answers as OpenAI does for a model without access,
    alike on /v1/models/{id} and the inference routes, and alike for a model not served:
    404 invalid_request_error, code model_not_found."""
    oc = openai.OpenAI(base_url=secured.url + "/v1", api_key=WEB)
    calls = [lambda m: oc.models.retrieve(m),
             lambda m: oc.chat.completions.create(model=m, max_tokens=2,
                                                  messages=[{"role": "user", "content": "x"}]),
             lambda m: oc.completions.create(model=m, prompt="x", max_tokens=2),
             lambda m: oc.embeddings.create(model=m, input="x")]
    endpoint = "/v1/models/{model}"
    before = {m: requests_total(secured.url, endpoint, m, 404) for m in ("other:latest", "")}
    for name in ("other", "other:latest", "nope"):
        for call in calls:
            with pytest.raises(openai.NotFoundError) as e:
                call(name)
            assert e.value.code == "model_not_found"
            assert e.value.body == {
                "message": f"The model `{name}` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": None, "code": "model_not_found"}
    # counted under the configured model the id names; an id that names none stays unlabelled
    assert requests_total(secured.url, endpoint, "other:latest", 404) == before["other:latest"] + 2
    assert requests_total(secured.url, endpoint, "", 404) == before[""] + 1
    # a key that may use it gets it
    assert openai.OpenAI(base_url=secured.url + "/v1", api_key=ADMIN).models.retrieve("other").id == "other"
    # Ollama routes keep Ollama's shape: 403 for a forbidden model, 404 for an unknown one
    r = httpx.post(secured.url + "/api/show", headers={"Authorization": f"Bearer {WEB}"},
                   json={"model": "other"})
    assert r.status_code == 403 and r.json() == {"error": "key 'webui' may not use model 'other'"}


def test_metrics_need_the_admin_token_or_an_admin_key(secured):
    """With auth.keys, /metrics (every model and worker by name) is the gateway's own data:
    no or an unknown credential 401, a plain key 403, the admin token or an admin key 200."""
    url = secured.url + "/metrics"
    r = httpx.get(url)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "admin token" in r.json()["error"]
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(url, headers={"Authorization": f"Bearer {WEB}"})
    assert r.status_code == 403 and r.json() == {"error": "key 'webui' may not use /metrics"}
    for cred in (ADMIN, ADMIN_TOKEN):
        r = httpx.get(url, headers={"Authorization": f"Bearer {cred}"})
        assert r.status_code == 200 and "llama_gateway_worker_up" in r.text


def test_wrong_admin_token_401_valid_key_without_admin_403(secured):
    """401 = no valid credential (missing, unknown key, wrong admin token); 403 = a valid key
    without permission."""
    api = secured.url + "/gateway/api/admin/workers/demo-cpu0/undrain"
    for headers in ({}, {"Authorization": "Bearer wrong-token"}):
        r = httpx.post(api, headers=headers)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), r.text
    r = httpx.post(api, headers={"Authorization": f"Bearer {WEB}"})
    assert r.status_code == 403 and r.json() == {
        "error": "key 'webui' may not use /gateway/api/admin/workers/demo-cpu0/undrain"}
    assert httpx.post(api, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200


def test_model_lists_show_only_the_keys_models(secured):
    web = {"Authorization": f"Bearer {WEB}"}
    names = lambda r: sorted(m["name"] for m in r.json()["models"])  # noqa: E731
    assert names(httpx.get(secured.url + "/api/tags", headers=web)) == ["demo:latest"]
    assert names(httpx.get(secured.url + "/api/ps", headers=web)) == ["demo:latest"]
    oc = openai.OpenAI(base_url=secured.url + "/v1", api_key=WEB)
    assert [m.id for m in oc.models.list()] == ["demo:latest"]
    admin = {"Authorization": f"Bearer {ADMIN}"}  # a key without a model list sees all
    assert names(httpx.get(secured.url + "/api/tags", headers=admin)) == [
        "demo:latest", "gpt-4o:latest", "other:latest"]  # an alias as Ollama lists a copy
    assert [m.model for m in ollama.Client(host=secured.url, headers=web).list().models] == ["demo:latest"]


def test_a_key_allowed_only_an_alias_sees_the_alias_listed(secured):
    """Aliases were not listed, so a client checking its model name against the list failed
    on one that served, also under a key allowed only the alias (a fresh tester's find).
    /v1/models shows the alias as configured (``gpt-4o``), /api/tags as Ollama names a copy;
    a key allowed one name of a model may use it by any (as before), so both are listed."""
    h = {"Authorization": f"Bearer {ALIASED}"}
    oc = openai.OpenAI(base_url=secured.url + "/v1", api_key=ALIASED)
    assert [m.id for m in oc.models.list()] == ["other:latest", "gpt-4o"]
    # the id is the name as asked, as Ollama's /v1/models/{id} answers; names are
    # case-insensitive
    for asked in ("gpt-4o", "gpt-4o:latest", "GPT-4o"):
        m = oc.models.retrieve(asked)
        assert (m.id, m.owned_by) == (asked, "library")
    admin = openai.OpenAI(base_url=secured.url + "/v1", api_key=ADMIN)
    assert admin.models.retrieve("Demo").id == "Demo"
    with pytest.raises(openai.NotFoundError):
        oc.models.retrieve("demo")  # not a name of the key's model
    tags = httpx.get(secured.url + "/api/tags", headers=h).json()["models"]
    assert [m["name"] for m in tags] == ["other:latest", "gpt-4o:latest"]
    chat = oc.chat.completions.create(model="gpt-4o", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "gpt-4o" and chat.choices[0].finish_reason == "length"


def test_per_key_concurrency_and_rate(secured):
    h = {"Authorization": f"Bearer {LIMITED}"}
    refused = requests_total(secured.url, "/api/generate", "other:latest", 429)
    body = {"model": "other", "prompt": "a", "raw": True, "stream": False,
            "options": {"num_predict": 3000}}
    with cf.ThreadPoolExecutor(2) as ex:
        rs = list(ex.map(lambda _: httpx.post(secured.url + "/api/generate", headers=h, json=body,
                                              timeout=60), range(2)))
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 429], [r.text for r in rs]
    busy = next(r for r in rs if r.status_code == 429)
    assert "concurrent" in busy.json()["error"]
    # 3 per minute: 1 used above (the refused one does not count), 2 left, then 429
    for _ in range(2):
        ok = httpx.post(secured.url + "/api/generate", headers=h, timeout=60,
                        json={**body, "options": {"num_predict": 2}})
        assert ok.status_code == 200
    r = httpx.post(secured.url + "/api/generate", headers=h, timeout=60,
                   json={**body, "options": {"num_predict": 2}})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert "rate limit" in r.json()["error"]
    # both refusals are counted under the model they asked for
    assert requests_total(secured.url, "/api/generate", "other:latest", 429) == refused + 2


def test_host_header_checked_on_loopback(secured):
    h = {"Authorization": f"Bearer {WEB}"}
    for host in ("evil.example.com", "attacker.com:11434"):
        r = httpx.get(secured.url + "/api/tags", headers={**h, "Host": host})
        assert r.status_code == 403 and "not allowed" in r.json()["error"], host
    for host in ("localhost", f"127.0.0.1:{secured.port}", "myhost.local", "[::1]:80",
                 "10.1.2.3", "box.internal"):
        assert httpx.get(secured.url + "/api/tags", headers={**h, "Host": host}).status_code == 200, host
    # link-local is not private (Go's IsPrivate, as Ollama)
    assert httpx.get(secured.url + "/api/tags", headers={**h, "Host": "169.254.1.1"}).status_code == 403
    # an absolute-form target names the host the server must use (RFC 9112 §3.2.2), whatever
    # the Host header says (found by a tester: it bypassed the check)
    for target, status in ((b"http://evil.com/api/tags", 403), (b"http://localhost/api/tags", 200)):
        with socket.create_connection(("127.0.0.1", secured.port), timeout=10) as s:
            s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                      + WEB.encode() + b"\r\nConnection: close\r\n\r\n")
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
        assert head.startswith(b"HTTP/1.1 %d" % status), (target, head[:200])


def test_host_header_not_utf8_shown_escaped(secured):
    """A Host header with Latin-1 bytes (not UTF-8) is refused with its bytes shown as ``\\xNN``
    in the error text and the log, as Go's ``%q`` shows them (it was echoed as Python's
    surrogate escape ``\\udce9``)."""
    out = raw_exchange(secured.port, b"GET /api/tags HTTP/1.1\r\nHost: caf\xe9.com\r\n"
                       b"X-Request-ID: host-refused-1\r\n"
                       b"Authorization: Bearer " + WEB.encode() + b"\r\nConnection: close\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), out[:300]
    assert json.loads(body) == {"error": r"host 'caf\xe9.com' is not allowed"}
    refused = [json.loads(ln) for ln in secured.log_path.read_text().splitlines()
               if '"request.host_refused"' in ln]
    assert refused[-1]["host"] == r"caf\xe9.com", refused[-1]
    assert refused[-1]["request_id"] == "host-refused-1", refused[-1]  # as its request.done


def test_cors_for_configured_and_default_origins_and_403_for_others(secured):
    """Origins as Ollama (gin-contrib/cors): a configured origin and a default one (a local page)
    get ``Access-Control-Allow-Origin`` (preflight and streams too); any request from another
    origin gets 403 in the route's error shape, also a "simple" POST that a browser sends
    without a preflight (before, that one was executed: a fresh tester's find); the gateway's
    own origin passes."""
    h = {"Authorization": f"Bearer {WEB}"}
    for origin in ("https://chat.example.com", "http://localhost:3000"):
        r = httpx.get(secured.url + "/api/tags", headers={**h, "Origin": origin})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == origin
    r = httpx.get(secured.url + "/api/tags", headers={**h, "Origin": "http://evil.com"})
    assert r.status_code == 403 and r.json() == {"error": "origin not allowed"}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 2}}
    simple = {**h, "Origin": "http://evil.com", "Content-Type": "text/plain"}
    r = httpx.post(secured.url + "/api/chat", headers=simple, content=json.dumps(body))
    assert r.status_code == 403 and r.json() == {"error": "origin not allowed"}
    assert "Access-Control-Allow-Origin" not in r.headers
    r = httpx.post(secured.url + "/v1/chat/completions", headers=simple,
                   content=json.dumps({"model": "demo", "max_tokens": 2, "messages": body["messages"]}))
    assert r.status_code == 403 and r.json()["error"]["message"] == "origin not allowed"
    own = httpx.post(secured.url + "/api/chat", json=body, headers={**h, "Origin": secured.url})
    assert own.status_code == 200 and own.json()["done"] is True
    pre = httpx.options(secured.url + "/api/chat", headers={
        "Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 204 and "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    pre = httpx.options(secured.url + "/v1/chat/completions", headers={  # the OpenAI JS SDK's
        "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,openai-beta"})
    allowed = pre.headers["Access-Control-Allow-Headers"].lower()
    assert pre.status_code == 204 and "x-stainless-os" in allowed and "openai-beta" in allowed
    pre = httpx.options(secured.url + "/api/chat", headers={
        "Origin": "http://evil.com", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403
    # streams carry the header too
    with httpx.stream("POST", secured.url + "/api/generate", headers={
            **h, "Origin": "https://chat.example.com"},
            json={"model": "demo", "prompt": "a", "options": {"num_predict": 3}}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "https://chat.example.com"
        r.read()


def test_default_origins_and_worker_needs_its_key(gateway):
    r = httpx.get(gateway.url + "/api/tags", headers={"Origin": "vscode-webview://abc"})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "vscode-webview://abc"
    r = httpx.get(gateway.url + "/api/tags", headers={"Origin": "https://chat.example.com"})
    assert r.status_code == 403
    w = gateway.workers()[0]
    direct = httpx.post(f"http://127.0.0.1:{w['port']}/completion",
                        json={"prompt": "x", "n_predict": 2}, timeout=30)
    assert direct.status_code == 401
    assert httpx.get(f"http://127.0.0.1:{w['port']}/slots", timeout=10).status_code == 401


def test_admin_token_and_keys_together_and_reload_of_keys(tmp_path, gateway_factory):
    """With ``auth.keys`` set, the admin token still opens the admin API, ``status`` and
    ``/metrics``, an ``admin: true`` key does too, a plain key does not; the status page HTML is
    open (its data is not); a reload that removes a key revokes it at once and an added key
    works at once, and ``auth.metrics_public`` opens /metrics at once; concurrency caps count
    inference only (a UI may poll /api/tags during a stream)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import yaml

    cfg = base_config(free_port(), admin={"token": "admintok"}, auth={"keys": [
        {"name": "ops", "sha256": hash_key(ADMIN), "admin": True},
        {"name": "webui", "sha256": hash_key(WEB), "max_concurrent": 1}]})
    cfg["models"][0].update(cpu=1, slots=2, context=8192)
    gw = gateway_factory(cfg, headers={"Authorization": "Bearer admintok"})
    url = gw.url
    r = httpx.post(url + "/gateway/api/admin/workers/demo-cpu0/drain",
                   headers={"Authorization": "Bearer admintok"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/gateway/api/admin/workers/demo-cpu0/undrain",
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/gateway/api/admin/workers/demo-cpu0/drain",
                   headers={"Authorization": f"Bearer {WEB}"})
    assert r.status_code == 403
    out = subprocess.run([sys.executable, "-m", "gateway", "status", "--url", url, "--json",
                          "--token", "admintok"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert [w["id"] for w in json.loads(out.stdout)["workers"]] == ["demo-cpu0"]
    assert httpx.get(url + "/gateway").status_code == 200
    assert httpx.get(url + "/gateway/api/workers").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer admintok"}).status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {WEB}"}).status_code == 403

    # a stream of the capped key runs; its /api/tags poll is not refused
    web = {"Authorization": f"Bearer {WEB}"}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/api/generate", headers=web, json={
            "model": "demo", "prompt": "a", "raw": True, "options": {"num_predict": 8000}}) as s:
        lines = s.iter_lines()  # kept referenced: a collected iterator closes the stream
        next(lines)
        assert c.get(url + "/api/tags", headers=web).status_code == 200
        r = c.post(url + "/api/generate", headers=web, json={"model": "demo", "prompt": "b",
                                                             "stream": False})
        assert r.status_code == 429

    new = yaml.safe_load(gw.cfg_path.read_text())
    new["auth"]["keys"] = [new["auth"]["keys"][0],
                           {"name": "fresh", "sha256": hash_key("fresh-key-4")}]
    new["auth"]["metrics_public"] = True
    gw.cfg_path.write_text(yaml.safe_dump(new))
    gw.proc.send_signal(signal.SIGHUP)
    end = time.monotonic() + 30
    while time.monotonic() < end and "config.reloaded" not in gw.log_path.read_text():
        time.sleep(0.1)
    assert httpx.get(url + "/api/tags", headers=web).status_code == 401  # revoked
    assert httpx.get(url + "/api/tags",
                     headers={"Authorization": "Bearer fresh-key-4"}).status_code == 200
    # auth.metrics_public: /metrics open to a scraper without credentials, the rest still not
    assert "llama_gateway_worker_up" in httpx.get(url + "/metrics").text
    assert httpx.get(url + "/gateway/api/workers").status_code == 401
