"""Prompts rendered by the gateway before admission, for chats it sends to llama-server's
completion routes instead of its chat route: ``/api/generate`` and ``/api/chat`` with
``format`` (gateway/api/ollama.py), and ``/v1/chat/completions`` with ``response_format``
(gateway/api/openai_structured.py). Ollama renders every chat so (its runner completes a
templated prompt).

The text comes from side calls to a worker of the model (``gateway.worker_calls``): the chat
template (llama-server ``/apply-template``, or a render learned by the chat's shape:
``gateway.template_shapes``) and an Ollama ``context`` detokenized in front (``/detokenize``).
"""

from __future__ import annotations

from gateway.api.errors import ApiError, admission_error
from gateway.logs import get_logger
from gateway.scheduling import QueueFull, Unavailable
from gateway.texts import CONTEXT_OVERFLOW_MESSAGE
from gateway.upstream import UpstreamError
from gateway.worker_calls import apply_template, detokenize, refuse_early

log = get_logger("gateway.api.render")


def upstream_error_text(e: UpstreamError) -> tuple[str, int]:
    """An upstream failure as (message, status): an over-long prompt is 400 with Ollama's
    runner text; other worker 4xx keep their status; transport faults 502/503/504; else 500."""
    if e.kind == "exceed_context_size_error" or "exceeds the available context size" in e.message:
        # with the numbers when the worker gave them (upstream.parse_error_body)
        return (e.message if e.message.startswith(CONTEXT_OVERFLOW_MESSAGE)
                else CONTEXT_OVERFLOW_MESSAGE), 400
    if 400 <= e.status < 500 or e.status in (502, 503, 504):
        return e.message, e.status
    return e.message, 500


async def render_prompt(gw, model: str, msgs: list[dict] | None, *,
                        template_fields: dict | None = None, text: str = "",
                        context: list[int] | tuple = ()) -> str:
    """The prompt text a worker's completion route gets: ``msgs`` through the chat template
    with the generation prompt (``template_fields``: more ``/apply-template`` body fields,
    such as ``chat_template_kwargs``; ``msgs`` None: ``text`` as it is), with ``context``
    (token ids) detokenized in front. An overflow gets admission's answer first, before any
    side call (``refuse_early``). Raises ApiError: that refusal (its status, text and
    Retry-After, ``errors.admission_error``) or a side call's failure
    (:func:`upstream_error_text`)."""
    try:
        refuse_early(gw, model)
        if msgs is not None:
            text = await _apply_template(gw, model, msgs, template_fields)
        if context:
            text = await detokenize(gw, model, context) + text
        return text
    except (Unavailable, QueueFull) as e:  # no worker can render it: refused like admission would
        raise admission_error(e, gw.config.queue.retry_after_s) from None
    except UpstreamError as e:
        msg, status = upstream_error_text(e)
        raise ApiError(status, msg) from None


async def _apply_template(gw, model: str, msgs: list, fields: dict | None) -> str:
    """``msgs`` through the chat template: filled in from the shape the model's
    ``TemplateShapes`` learned, or the worker's ``/apply-template`` (which, for a chat that may
    be filled in but whose shape is new, renders the shape first; gateway/template_shapes.py).
    Raises what ``apply_template`` raises."""
    entry = gw.inventory.resolve(model) if gw.inventory is not None else None
    shapes = entry.template_shapes if entry is not None and \
        gw.config.generation.template_shapes else None
    key = shapes.key(msgs, fields) if shapes is not None else None
    if key is None:
        return await apply_template(gw, model, msgs, **(fields or {}))
    known = shapes.known(key)
    if known is None:
        shaped = await apply_template(gw, model, shapes.sentinel_messages(msgs), **(fields or {}))
        known = shapes.learn(key, shaped, len(msgs))
        log.debug("template.shape_learned", model=model, roles=list(key[0]), reusable=known)
    if known:
        return shapes.fill(key, msgs)
    return await apply_template(gw, model, msgs, **(fields or {}))
