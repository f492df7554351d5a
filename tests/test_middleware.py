"""Unit test of gateway.middleware's Guard: the model a request names is resolved once, by
``_check_model``, whose entry the prompt-length check then uses (the guard's whole order is
covered end to end in tests/e2e/test_access.py and tests/e2e/test_limits.py). The requests
are aiohttp's own test requests (make_mocked_request: a real web.Request with no connection)."""

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.api.errors import ApiError
from gateway.app import Gateway
from gateway.auth import KeyRing, hash_key
from gateway.config import parse_config
from gateway.inventory import Inventory, ModelEntry
from gateway.middleware import Guard
from workers.demo_model import ensure_demo_model

# the gateway keeps its per-request fields under string keys (aiohttp suggests RequestKey)
pytestmark = [pytest.mark.filterwarnings("ignore:It is recommended to use web.RequestKey"),
              pytest.mark.filterwarnings("ignore:It is recommended to use web.AppKey")]


@pytest.fixture(scope="module")
def gw():
    cfg = parse_config({"models": [{"name": "demo", "path": "builtin:demo"},
                                   {"name": "other", "path": "builtin:demo"}],
                        "auth": {"keys": [{"name": "a", "sha256": hash_key("k1"),
                                           "models": ["demo"]}]}})
    g = Gateway(cfg)
    path = ensure_demo_model()  # the real demo GGUF
    g.inventory = Inventory([ModelEntry.load(m.full_name, path) for m in cfg.models])
    return g


def test_note_model_returns_the_entry_it_labels_the_request_with(gw):
    req = make_mocked_request("POST", "/api/chat")
    entry = Guard._note_model(req, {"model": "demo"}, gw)
    assert entry is gw.inventory.resolve("demo:latest") and req["model"] == "demo:latest"
    req = make_mocked_request("POST", "/api/show")  # /api/show's "name" names the model too
    assert Guard._note_model(req, {"name": "demo"}, gw) is entry
    for body in ({"model": "nope"}, {"model": 5}, {}):  # not configured: no entry, no label
        req = make_mocked_request("POST", "/api/chat")
        assert Guard._note_model(req, body, gw) is None and "model" not in req


def test_check_model_refuses_a_model_the_key_may_not_use(gw):
    key = KeyRing(gw.config).lookup("Bearer k1")  # may use demo only
    req = make_mocked_request("POST", "/api/chat")
    Guard._check_model(req, {"model": "demo"}, gw.inventory.resolve("demo"), key)  # allowed
    Guard._check_model(req, {"model": "nope"}, None, key)  # not configured: the handler's 404
    with pytest.raises(ApiError) as e:
        Guard._check_model(make_mocked_request("POST", "/api/chat"), {"model": "other"},
                           gw.inventory.resolve("other"), key)
    assert e.value.status == 403


def test_context_per_slot_before_any_worker_is_capped_at_the_trained_context():
    """Before a worker reports ``/slots``, the prompt-length check uses the configured context
    capped at the model's trained context, as llama-server will (the demo model: 4096)."""
    cfg = parse_config({"models": [{"name": "big", "path": "builtin:demo", "context": 100000},
                                   {"name": "small", "path": "builtin:demo", "context": 1024}]})
    g = Gateway(cfg)
    path = ensure_demo_model()
    g.inventory = Inventory([ModelEntry.load(m.full_name, path) for m in cfg.models])
    trained = g.inventory.resolve("big").context_length
    assert trained == 4096
    assert g.context_per_slot("big:latest") == 4096 and g.context_per_slot("small:latest") == 1024


def test_x_priority_is_ignored_with_header_priority_false():
    """``queue.header_priority: false``: a client's ``X-Priority`` no longer sets its class (the
    model's default does); true (default): it does, and a bad value is a 400."""
    from aiohttp import web

    from gateway.api.common import make_ticket
    for allowed, expect in ((True, 7), (False, 2)):
        cfg = parse_config({"models": [{"name": "demo", "path": "builtin:demo", "priority": 2}],
                            "queue": {"header_priority": allowed}})
        app = web.Application()
        app["gw"] = Gateway(cfg)
        req = make_mocked_request("POST", "/api/chat", headers={"X-Priority": "7"}, app=app)
        assert make_ticket(req, "demo:latest", 2, 60.0).priority == expect
        bad = make_mocked_request("POST", "/api/chat", headers={"X-Priority": "high"}, app=app)
        if allowed:
            with pytest.raises(ApiError):
                make_ticket(bad, "demo:latest", 2, 60.0)
        else:
            assert make_ticket(bad, "demo:latest", 2, 60.0).priority == 2
