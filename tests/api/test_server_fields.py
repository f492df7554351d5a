"""Unit tests of ``gateway.api.server_fields``: llama-server's own fields on ``/v1``."""

from __future__ import annotations

import pytest

from gateway.api.errors import ApiError
from gateway.api.server_fields import SAMPLER_NAMES, check_server_fields, lora_adapters


def _refused(body: dict, chat: bool = False, adapters: int | None = 0) -> str:
    with pytest.raises(ApiError) as e:
        check_server_fields(body, chat, adapters)
    assert e.value.status == 400
    return e.value.message


def test_lora_adapters_counts_each_listed_file():
    assert lora_adapters([]) == 0
    assert lora_adapters(["--lora", "a.gguf"]) == 1
    assert lora_adapters(["--lora", "a.gguf,b.gguf", "--lora-scaled", "c.gguf:0.5"]) == 3
    assert lora_adapters(["--lora=a.gguf", "-c", "512"]) == 1
    assert lora_adapters(["--lora"]) == 0  # no value: llama-server refuses to start anyway


def test_lora_of_the_wrong_shape_or_an_id_without_an_adapter_is_refused():
    assert _refused({"lora": 5}).startswith("lora must be a list")
    assert _refused({"lora": [5]}) == 'lora[0] must be an object with an integer id and a ' \
                                      'number scale, got 5'
    assert "got {\"id\":\"a\"" in _refused({"lora": [{"id": "a", "scale": 1}]})
    assert "number scale" in _refused({"lora": [{"id": 0, "scale": True}]})
    assert _refused({"lora": [{"id": 0, "scale": 1}]}) == \
        "lora[0].id 0: this model's workers have no LoRA adapters (its args load none: --lora)"
    assert _refused({"lora": [{"id": 0, "scale": 1}, {"id": 2, "scale": 1}]}, adapters=2) == \
        "lora[1].id 2: this model's workers have 2 LoRA adapters (ids from 0)"
    assert "lora[0].id -1" in _refused({"lora": [{"id": -1, "scale": 1}]}, adapters=None)


def test_lora_within_the_adapters_or_unknown_adapters_passes():
    check_server_fields({"lora": [{"id": 1, "scale": 0.5}]}, False, 2)
    check_server_fields({"lora": [{"id": 7, "scale": 1}]}, False, None)
    check_server_fields({"lora": []}, True, 0)


def test_samplers_are_llama_servers_names_or_letters():
    for name in ("top_k", "top-k", "topk", "TOP_K", "nucleus", "temp", "typ", "adaptive-p"):
        check_server_fields({"samplers": [name]}, False, None)
    check_server_fields({"samplers": "dkypsmtxiea"}, False, None)
    check_server_fields({"samplers": []}, False, None)  # a choice: sample the raw distribution
    assert "dry" in SAMPLER_NAMES and "top_p" in SAMPLER_NAMES and "bogus" not in SAMPLER_NAMES
    assert _refused({"samplers": ["top_k", "bogus"]}).startswith('samplers: unknown sampler "bogus"')
    assert _refused({"samplers": "kz"}).startswith('samplers: unknown sampler letter "z"')


def test_a_continuation_without_add_generation_prompt_gets_it_false():
    for v in (True, "content", "reasoning_content"):
        body = {"continue_final_message": v}
        check_server_fields(body, True, None)
        assert body["add_generation_prompt"] is False
    for body in ({"continue_final_message": True, "add_generation_prompt": True},
                 {"continue_final_message": False}, {}):
        before = dict(body)
        check_server_fields(body, True, None)
        assert body == before  # the client's own choice, or nothing to continue


def test_continue_final_message_values():
    for v in (True, False, "content", "reasoning_content", None):
        check_server_fields({"continue_final_message": v}, True, None)
    assert _refused({"continue_final_message": 5}, chat=True) == \
        'continue_final_message must be a boolean, "content" or "reasoning_content", got 5'
    assert "got \"x\"" in _refused({"continue_final_message": "x"}, chat=True)


def test_grammar_triggers_shape_on_completions():
    check_server_fields({"grammar_triggers": [{"type": 1, "value": "<tool>"},
                                              {"type": 0, "value": "<t>", "token": 5},
                                              {"type": 3, "value": ".*x"}]}, False, None)
    assert _refused({"grammar_triggers": 5}).startswith("grammar_triggers must be a list")
    for bad in (5, "abc", {"type": "x", "value": "q"}, {"type": 4, "value": "q"},
                {"type": 1, "value": 2}, {"type": 0, "value": "q"}, {"type": True, "value": "q"}):
        assert _refused({"grammar_triggers": [bad]}).startswith("grammar_triggers[0] must be")


def test_fields_the_chat_route_replaces_are_refused_there_only():
    body = {"grammar": 'root ::= "a"', "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "q"}]}
    check_server_fields(body, False, None)
    assert _refused(body, chat=True) == (
        "grammar_lazy is not applied on /v1/chat/completions (llama-server replaces it with the "
        "chat template's own); send a lazy grammar to /v1/completions")
    assert _refused({"preserved_tokens": ["<x>"]}, chat=True).startswith("preserved_tokens is not")
    check_server_fields({"grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": None},
                        True, None)
