"""``Gateway.model_config``: the configured model of a name, remembered per config."""

from gateway import app as gateway_app
from gateway.app import Gateway
from gateway.config import parse_config


def _config(*names):
    return parse_config({"models": [{"name": n, "path": "builtin:demo"} for n in names]})


def test_model_config_by_full_name_in_any_case():
    gw = Gateway(_config("demo", "other:7b"))
    assert gw.model_config("demo").name == "demo"
    assert gw.model_config("DEMO:latest") is gw.model_config("demo")
    assert gw.model_config("other:7b").name == "other:7b"
    assert gw.model_config("other") is None  # other:latest is not configured
    assert gw.model_config("missing") is None


def test_model_config_follows_a_replaced_config():
    """A reload replaces ``Gateway.config``: what was remembered for the old one is not used."""
    gw = Gateway(_config("demo"))
    assert gw.model_config("demo") is not None and gw.model_config("next") is None
    gw.config = _config("next")
    assert gw.model_config("demo") is None
    assert gw.model_config("next").name == "next"


def test_model_config_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(gateway_app, "MODEL_CONFIG_MEMO", 3)
    gw = Gateway(_config("demo"))
    for i in range(10):
        assert gw.model_config(f"nope{i}") is None
    assert len(gw._model_configs[1]) == 3
    assert gw.model_config("demo").name == "demo"  # past the bound: still answered
