"""Helpers shared by the compatibility e2e tests (configs, worker metrics, raw HTTP)."""

from __future__ import annotations

import re
import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import worker_key

# A ChatML template that also renders ``tools`` (so the model gets the ``tools`` capability).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "(message['content'] or '') + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def model(name: str, **over) -> dict:
    m = {"name": name, "path": "builtin:demo", "slots": 2, "context": 1024, "cpu": 1}
    m.update(over)
    return m


def embed_model(name: str = "embed", cpu: int = 1, context: int = 256) -> dict:
    """The demo model served for embeddings. Its GGUF names no pooling type; the gateway adds
    ``--pooling mean`` for an embedding demo model by itself (gateway/fleet.py)."""
    return model(name, embeddings=True, cpu=cpu, context=context)


def gateway_requests_total(url: str, endpoint: str, model: str, status: int,
                           token: str | None = None) -> float:
    """The gateway's ``llama_gateway_requests_total`` of one label set (0 when absent), scraped
    from ``/metrics`` (with ``token`` as Bearer credential when given)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    want = {"endpoint": endpoint, "model": model, "status": str(status)}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llama_gateway_requests_total" and s.labels == want:
                return s.value
    return 0.0


def worker_metrics(worker: dict) -> dict[str, float]:
    """A worker's own Prometheus counters (``llamacpp:*``), asked directly with its key."""
    r = httpx.get(f"http://127.0.0.1:{worker['port']}/metrics",
                  headers={"Authorization": f"Bearer {worker_key(worker['pid'])}"}, timeout=5)
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        m = re.match(r"^(llamacpp:\w+)\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def nearest(vec: list[float], refs: dict) -> object:
    """The key of ``refs`` whose vector is closest (cosine) to ``vec``.

    Used to check embedding order: llama-server's vectors for one text differ slightly (~1e-2)
    when it batches several requests together, so equality is too strict but the nearest
    reference must be the text's own."""
    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / (
            (sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))
    return max(refs, key=lambda k: cos(vec, refs[k]))


def raw_exchange(port: int, head: bytes, body: bytes = b"", wait_s: float = 5.0) -> bytes:
    """Send ``head``; after a first answer (or at once without one) send ``body``; all read."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(head)
        first = s.recv(65536)
        if body and first.startswith(b"HTTP/1.1 100"):
            s.sendall(body)
        rest = b""
        try:
            while chunk := s.recv(65536):
                rest += chunk
        except socket.timeout:
            pass
    return first + rest
