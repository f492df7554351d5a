"""/api/generate's prompt rendered from a learned chat-template shape equals the worker's own
``/apply-template`` render, on real llama-server workers with real Jinja templates: one that
copies the content (the demo model's), Llama 3's ``| trim``, a ``| tojson`` one (never
reused) and a Qwen3-like one that branches on the content (``startswith('<tool_response>')``,
``'/no_think' in``). The prompt a worker got is read back exactly from the answer's
``context`` (the gateway's ``/tokenize`` of prompt + answer)."""

import json

import httpx
import pytest
import yaml

from tests.conftest import base_config, free_port, worker_key

pytestmark = pytest.mark.slow

TRIM = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
        "'<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}")
TOJSON = ("{% for m in messages %}{{ m['role'] + ': ' + (m['content'] | tojson) + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
BRANCH = ("{% for m in messages %}"
          "{% if m['role'] == 'user' and m['content'].startswith('<tool_response>') %}"
          "{{ '<|im_start|>tool\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% elif '/no_think' in m['content'] %}"
          "{{ '<|im_start|>' + m['role'] + ' quiet\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

PROMPTS = ["Why is the sky blue?", "hello there", 'say "hi" \\ now\nplease', "ünïcødé 🙂",
           "  padded  ", "<tool_response>42</tool_response>", "be brief /no_think",
           "a </think> b", "x{y}z", "Why is the sky green?"]


def _models(tmp_path) -> list[dict]:
    out = [{"name": "demo", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1}]
    for name, tpl in (("trim", TRIM), ("tojson", TOJSON), ("branch", BRANCH)):
        f = tmp_path / f"{name}.jinja"
        f.write_text(tpl)
        out.append({"name": name, "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1,
                    "args": ["--chat-template-file", str(f)]})
    return out


def _worker(gw, model: str) -> tuple[str, dict]:
    w = next(w for w in gw.workers() if w["model"] == f"{model}:latest" and w["state"] == "ready")
    return f"http://127.0.0.1:{w['port']}", {"Authorization": f"Bearer {worker_key(w['pid'])}"}


def _expected_context(gw, model: str, msgs: list[dict], response: str) -> list[int]:
    """The worker's own render of ``msgs`` (``/apply-template``), tokenized with the answer as
    the gateway tokenizes its ``context``."""
    url, h = _worker(gw, model)
    rendered = httpx.post(url + "/apply-template", json={"messages": msgs}, headers=h,
                          timeout=30).json()["prompt"]
    toks = httpx.post(url + "/tokenize", headers=h, timeout=30, json={
        "content": rendered + response, "add_special": False, "parse_special": True}).json()
    return toks["tokens"]


def _template_calls(gw, model: str) -> int:
    n = 0
    for line in gw.log_path.read_text().splitlines():
        if '"worker_call.done"' in line and '"/apply-template"' in line:
            n += json.loads(line).get("model") == f"{model}:latest"
    return n


def _generate(gw, model: str, prompt: str, system: str | None) -> dict:
    body = {"model": model, "prompt": prompt, "stream": False,
            "options": {"num_predict": 2, "temperature": 0, "seed": 1}}
    if system:
        body["system"] = system
    r = httpx.post(gw.url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_prompts_from_learned_shapes_equal_the_workers_render(tmp_path,
                                                                        gateway_factory):
    cfg = base_config(free_port(), log={"level": "debug", "format": "json"},
                      admin={"token": "t"}, models=_models(tmp_path))
    gw = gateway_factory(cfg)
    for model in ("demo", "trim", "tojson", "branch"):
        for system in (None, "Be brief."):
            for prompt in PROMPTS:
                got = _generate(gw, model, prompt, system)
                msgs = ([{"role": "system", "content": system}] if system else []) + \
                    [{"role": "user", "content": prompt}]
                assert got["context"] == _expected_context(gw, model, msgs, got["response"]), \
                    (model, system, prompt)
    # the 5 prompts that may be filled in, per shape (with and without a system prompt): one
    # render of the sentinel chat, all 5 filled in locally; the 5 others (edge whitespace,
    # markup) rendered by the worker each time. A tojson template's shape is learned as not
    # reusable: every chat rendered by the worker, after the sentinel chat.
    for model in ("demo", "trim", "branch"):
        assert _template_calls(gw, model) == 2 * (1 + 5), model
    assert _template_calls(gw, "tojson") == 2 * (1 + len(PROMPTS))

    # a reload that gives "demo" another template: the new worker process's render, not the
    # shape learned from the old one
    on_disk = yaml.safe_load(gw.cfg_path.read_text())
    on_disk["models"][0]["args"] = ["--chat-template-file", str(tmp_path / "trim.jinja")]
    gw.cfg_path.write_text(yaml.safe_dump(on_disk))
    r = httpx.post(gw.url + "/gateway/api/admin/reload", headers={"Authorization": "Bearer t"},
                   timeout=120)
    assert r.status_code == 200 and r.json()["changed"] == ["demo-cpu0"], r.text
    gw.wait_ready(60)
    got = _generate(gw, "demo", "Why is the sky blue?", None)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    expected = _expected_context(gw, "demo", msgs, got["response"])
    assert got["context"] == expected
    assert "<|start_header_id|>" in httpx.post(
        _worker(gw, "demo")[0] + "/detokenize", headers=_worker(gw, "demo")[1],
        json={"tokens": expected}, timeout=30).json()["content"]


REWRITE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
           "m['content'].replace('cat', 'dog') + '<|im_end|>\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_that_rewrites_words_needs_template_shapes_off(tmp_path, gateway_factory):
    """A template that rewrites the words of a message (``replace('cat', 'dog')``) keeps the
    sentinel intact, so a learned shape filled in "I have a cat" where the worker renders "I
    have a dog" (a fresh tester's find; no known model's template does this, README "Side
    calls"). ``generation.template_shapes: false`` has the worker render every chat: then
    the prompt is the worker's own, and every request asks for it."""
    tpl = tmp_path / "rewrite.jinja"
    tpl.write_text(REWRITE)
    model = {"name": "demo", "path": "builtin:demo", "slots": 1, "context": 512, "cpu": 1,
             "args": ["--chat-template-file", str(tpl)]}
    for shapes_on in (True, False):
        cfg = base_config(free_port(), log={"level": "debug", "format": "json"},
                          generation={"template_shapes": shapes_on}, models=[model])
        gw = gateway_factory(cfg)
        prompts = ["I have a dog", "I have a cat", "I have a bird"]
        got = [_generate(gw, "demo", p, None) for p in prompts]
        msgs = [{"role": "user", "content": "I have a cat"}]
        same = got[1]["context"] == _expected_context(gw, "demo", msgs, got[1]["response"])
        assert same is (not shapes_on), shapes_on  # the limit a shape cannot see; off: exact
        assert _template_calls(gw, "demo") == (1 if shapes_on else len(prompts)), shapes_on
        gw.stop()
