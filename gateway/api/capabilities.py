"""What a served model can do, as Ollama's ``capabilities`` list, and the 400s when it cannot.

The chat template and vision support are taken from a ready worker's ``/props``
(``chat_template``, ``modalities.vision``) the first time they are needed, because workers may
run with ``--chat-template-file`` or ``--mmproj``; before any worker is ready the GGUF's own
template and the configured args are used.
"""

from __future__ import annotations

from gateway.api.errors import ApiError
from gateway.inventory import ModelEntry, capabilities
from gateway.upstream import UpstreamError
from gateway.worker_calls import fit_workers, side_call

_PROJECTOR_ARGS = ("--mmproj", "-mm", "--mmproj-url", "-mmu")


async def model_template(gw, entry: ModelEntry) -> str:
    """The chat template ``entry``'s workers render with: a ready worker's ``/props``
    ``chat_template`` (read once), before that the GGUF's own (``""`` when it has none)."""
    if entry.worker_template is None and fit_workers(gw, entry.name):
        try:
            props = await side_call(gw, entry.name, "/props", None, wait_s=0, timeout_s=5)
            entry.worker_template = str(props.get("chat_template") or "")
            entry.worker_vision = bool((props.get("modalities") or {}).get("vision"))
        except UpstreamError:
            pass
    return entry.worker_template if entry.worker_template is not None else entry.facts.chat_template


async def model_capabilities(gw, entry: ModelEntry) -> list[str]:
    """Ollama capability names for ``entry`` (see ``inventory.capabilities``)."""
    template = await model_template(gw, entry)
    mcfg = gw.model_config(entry.name)
    args = list(gw.config.llama_server.extra_args) + (list(mcfg.args) if mcfg else [])
    vision = entry.worker_vision or any(a in _PROJECTOR_ARGS for a in args)
    return capabilities(embeddings=entry.embeddings, template=template, has_fim=entry.facts.has_fim,
                        vision=vision)


async def require(gw, entry: ModelEntry, requested: str, name: str) -> None:
    """Raise ApiError(400) with Ollama's wording when ``entry`` lacks ``requested``.

    Ollama texts (routes.go, shared/reference A10): ``"<model>" does not support generate|chat|
    thinking`` (quoted request name), ``<full name> does not support tools|insert|vision|
    embedding`` (unquoted full name).
    """
    caps = await model_capabilities(gw, entry)
    if requested == "generate" or requested == "chat":
        if "completion" not in caps:
            raise ApiError(400, f'"{name}" does not support {requested}')
    elif requested == "thinking":
        if "thinking" not in caps:
            raise ApiError(400, f'"{name}" does not support thinking')
    elif requested not in caps:
        raise ApiError(400, f"{entry.name} does not support {requested}")
