"""Unit tests of gateway.limits.prompt_texts: only the text a route sends to a worker counts
against the slot context (the end-to-end check is tests/e2e/test_limits.py)."""

from gateway.limits import prompt_texts

MSGS = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                     {"type": "text", "text": "b"}]}]


def test_generate_counts_system_only_where_the_template_uses_it():
    body = {"system": "S", "prompt": "P", "suffix": "", "messages": MSGS}
    assert prompt_texts(body, "/api/generate") == ["S\nP"]
    assert prompt_texts({**body, "raw": True}, "/api/generate") == ["P"]
    assert prompt_texts({**body, "suffix": "X"}, "/api/generate") == ["P\nX"]
    assert prompt_texts({"prompt": ""}, "/api/generate") == []


def test_chat_routes_count_messages_only():
    body = {"system": "S" * 9000, "prompt": "P" * 9000, "messages": MSGS}
    for path in ("/api/chat", "/v1/chat/completions"):
        assert prompt_texts(body, path) == ["be brief\nab"]
    assert prompt_texts({"messages": "nope"}, "/api/chat") == []


def test_v1_completions_counts_each_prompt_and_nothing_else():
    assert prompt_texts({"prompt": "P", "system": "S", "suffix": "X"}, "/v1/completions") == ["P"]
    assert prompt_texts({"prompt": ["a", "", 3, "b"]}, "/v1/completions") == ["a", "b"]
    for path in ("/api/show", "/api/embed", "/v1/embeddings", "/api/pull"):
        assert prompt_texts({"prompt": "P", "system": "S", "input": "I"}, path) == []
