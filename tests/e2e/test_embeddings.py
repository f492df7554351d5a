"""Embeddings over real workers (field case 25): /api/embed, /api/embeddings, order, truncation,
spreading a batch over workers."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math

import httpx
import ollama
import pytest

from tests.conftest import base_config, free_port
from tests.e2e.compat_helpers import embed_model, nearest

pytestmark = pytest.mark.slow

TEXTS = ["alpha", "beta beta", "gamma gamma gamma", "delta " * 400, "epsilon"]  # [3] > 256 tokens


@pytest.fixture(scope="module")
def gw(module_gateway_factory):
    return module_gateway_factory(base_config(free_port(), models=[embed_model(cpu=2, context=256)]))


def test_case25_batch_order_truncation_and_legacy(gw):
    client = ollama.Client(host=gw.url)
    r = client.embed(model="embed", input=TEXTS)  # truncate defaults to true
    assert len(r.embeddings) == 5 and r.prompt_eval_count > 256
    for vec in r.embeddings:
        assert len(vec) == 64 and math.isclose(sum(x * x for x in vec), 1.0, rel_tol=1e-6)
    refs = {i: client.embed(model="embed", input=TEXTS[i]).embeddings[0] for i in range(5)}
    assert [nearest(v, refs) for v in r.embeddings] == [0, 1, 2, 3, 4]  # input order kept
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="embed", input=TEXTS, truncate=False)
    assert (e.value.status_code, e.value.error) == (400, "the input length exceeds the context length")
    legacy = httpx.post(gw.url + "/api/embeddings", json={"model": "embed", "prompt": "alpha"}).json()
    assert list(legacy) == ["embedding"]
    assert nearest(legacy["embedding"], refs) == 0
    assert client.embeddings(model="embed", prompt="alpha").embedding == pytest.approx(legacy["embedding"])
    cut = client.embed(model="embed", input="alpha", dimensions=8).embeddings[0]
    assert len(cut) == 8 and math.isclose(sum(x * x for x in cut), 1.0, rel_tol=1e-6)
    empty = httpx.post(gw.url + "/api/embed", json={"model": "embed", "input": ""}).json()
    assert empty == {"model": "embed", "embeddings": []}
    bad = httpx.post(gw.url + "/api/embed", json={"model": "embed", "input": [1, 2]})
    assert bad.status_code == 400 and bad.json() == {"error": "invalid input type"}


def test_concurrent_batches_spread_without_mixing(gw):
    client = ollama.Client(host=gw.url)
    ref = {t: client.embed(model="embed", input=t).embeddings[0] for t in TEXTS[:3] + TEXTS[4:]}
    batches = [[TEXTS[(i + k) % 5] for k in range(5) if (i + k) % 5 != 3] for i in range(6)]

    def run(batch):
        return batch, client.embed(model="embed", input=batch).embeddings

    with cf.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(run, batches))
    for batch, vecs in results:
        assert [nearest(v, ref) for v in vecs] == batch
    # Each input took its own lease: the access log shows batches served by both workers.
    used = set()
    for line in gw.log_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "request.done" and ev.get("path") == "/api/embed" and ev.get("worker"):
            used.update(ev["worker"].split(","))
    assert used == {"embed-cpu0", "embed-cpu1"}
