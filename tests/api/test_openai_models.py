"""OpenAI's model object (gateway.api.openai._model_obj): ``owned_by`` is the name's namespace,
as Ollama's ``ToModel`` gives it (``model.ParseName(m).Namespace``)."""

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from gateway.api.openai import _model_obj

ENTRY = SimpleNamespace(name="demo:latest", modified_at=datetime(2026, 1, 2, tzinfo=timezone.utc))


@pytest.mark.parametrize("name,owner", [("demo", "library"), ("Demo:latest", "library"),
                                        ("acme/coder:7b", "acme"),
                                        ("hf.co/bartowski/Llama-3.2-1B:Q4_K_M", "bartowski")])
def test_owned_by_is_the_namespace(name, owner):
    assert _model_obj(ENTRY, name) == {"id": name, "object": "model", "created": 1767312000,
                                       "owned_by": owner}


def test_without_a_name_the_entry_name():
    assert _model_obj(ENTRY)["id"] == "demo:latest"
