"""gateway.template_shapes: chat-template renders reused by shape (pure; no I/O).

The templates here are Python stand-ins for what a worker's ``/apply-template`` does with a
chat; the same cases run against real llama-server templates in
tests/e2e/test_template_shapes.py."""

import json

import pytest

from gateway.template_shapes import TemplateShapes


def chatml(msgs):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + \
        "<|im_start|>assistant\n"


def llama3_trim(msgs):
    return "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        for m in msgs) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def tojson(msgs):
    return "".join(f"{m['role']}: {json.dumps(m['content'])}\n" for m in msgs)


def upper(msgs):
    return "".join(f"{m['role']}: {m['content'].upper()}\n" for m in msgs)


def twice(msgs):  # the system prompt also repeated at the end (verbatim both times)
    return chatml(msgs) + (msgs[0]["content"] if msgs[0]["role"] == "system" else "")


def drop_system(msgs):
    return chatml([m for m in msgs if m["role"] != "system"])


def render_by_shape(shapes, template, msgs, fields=None):
    """What render.py does: learn the shape from the sentinel chat, then fill it in; None when
    the chat may not be filled in."""
    key = shapes.key(msgs, fields)
    if key is None:
        return None
    if shapes.known(key) is None:
        shapes.learn(key, template(shapes.sentinel_messages(msgs)), len(msgs))
    return shapes.fill(key, msgs) if shapes.known(key) else None


CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": 'a "quoted" back\\slash\nnew line, ünïcødé 🙂'}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three"}],
]


@pytest.mark.parametrize("template", [chatml, llama3_trim, twice])
def test_a_verbatim_template_is_filled_in_exactly(template):
    shapes = TemplateShapes()
    for msgs in CHATS:
        for variant in (msgs, [{**m, "content": m["content"] + " more"} for m in msgs]):
            assert render_by_shape(shapes, template, variant) == template(variant)


@pytest.mark.parametrize("template", [tojson, upper, drop_system])
def test_a_template_that_changes_or_drops_content_is_not_reused(template):
    shapes = TemplateShapes()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    assert render_by_shape(shapes, template, msgs) is None
    assert shapes.known(shapes.key(msgs, None)) is False  # remembered: no second sentinel call


@pytest.mark.parametrize("content", [
    "", " leading space", "trailing newline\n", "<tool_response>x</tool_response>",
    "what is </think>", "/no_think hello", "a [INST] b", "json {x}", "ctl \x02 char"])
def test_contents_a_template_might_branch_on_or_trim_are_left_to_the_worker(content):
    assert TemplateShapes.key([{"role": "user", "content": content}], None) is None


def test_chats_other_than_plain_text_messages_are_left_to_the_worker():
    key = TemplateShapes.key
    assert key([], None) is None
    assert key([{"role": "tool", "content": "x"}], None) is None
    assert key([{"role": "user", "content": "x", "images": ["aGk="]}], None) is None
    assert key([{"role": "user", "content": [{"type": "text", "text": "x"}]}], None) is None
    assert key([{"role": "user", "content": "x"}], {"tools": []}) is None
    assert key(["user: x"], None) is None
    a = key([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"enable_thinking": False}})
    b = key([{"role": "user", "content": "y"}], {"chat_template_kwargs": {"enable_thinking": True}})
    assert a is not None and b is not None and a != b  # template fields are part of the shape
    assert key([{"role": "user", "content": "x"}], None) == key([{"role": "user", "content": "z"}], None)
    assert key([{"role": "user", "content": "x"}], None) != key(
        [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}], None)


def test_a_partly_changed_sentinel_is_not_reused():
    shapes = TemplateShapes()
    msgs = [{"role": "user", "content": "hi"}]
    key = shapes.key(msgs, None)
    mangled = chatml(shapes.sentinel_messages(msgs)).replace("\n", " ")  # newlines replaced
    assert shapes.learn(key, mangled, 1) is False and shapes.known(key) is False


def test_learned_shapes_expire_and_are_bounded():
    now = [0.0]
    shapes = TemplateShapes(clock=lambda: now[0], ttl_s=60, max_shapes=2)
    msgs = [{"role": "user", "content": "hi"}]
    key = shapes.key(msgs, None)
    shapes.learn(key, chatml(shapes.sentinel_messages(msgs)), 1)
    now[0] = 59.0
    assert shapes.known(key) is True
    now[0] = 60.5  # a template that prints the date is rendered again after TTL_S
    assert shapes.known(key) is None
    keys = []
    for n in range(1, 4):
        m = [{"role": "user", "content": "x"}] * n
        keys.append(shapes.key(m, None))
        shapes.learn(keys[-1], chatml(shapes.sentinel_messages(m)), n)
    assert shapes.known(keys[0]) is None and shapes.known(keys[2]) is True  # oldest dropped
    shapes.clear()
    assert shapes.known(keys[2]) is None
