"""Telemetry parsing (both /slots shapes, /metrics, missing fields) and the poller against a
real llama-server worker. NVML is faked (no GPU here): ``FakeNvml`` is named as such."""

import asyncio
import sys
import time
import types

import aiohttp
import pytest

from gateway.scheduling import WorkerLoad
from workers import gpu
from workers.telemetry import (Progress, SlotState, WorkerPoller, build_load, parse_metrics,
                               parse_slot, parse_slots)

CURRENT = [  # shape of this build (0c1e570), captured from a running worker
    {"id": 0, "n_ctx": 2048, "speculative": False, "is_processing": False},
    {"id": 1, "n_ctx": 2048, "is_processing": True, "id_task": 1, "n_prompt_tokens": 771,
     "n_prompt_tokens_processed": 5, "n_prompt_tokens_cache": 0,
     "next_token": [{"has_next_token": True, "n_remain": 2234, "n_decoded": 766}]},
]
OLDER = [  # older builds: integer state, next_token an object, n_prompt_tokens prompt only
    {"id": 0, "n_ctx": 1024, "state": 1, "n_prompt_tokens": 100, "n_prompt_tokens_processed": 60,
     "n_prompt_tokens_cache": 40, "next_token": {"n_decoded": 25}},
    {"id": 1, "n_ctx": 1024, "state": 0},
    {"id": 2},  # missing everything
]
METRICS = """# HELP llamacpp:prompt_tokens_total x
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 40
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1000
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""


def test_current_shape():
    s = parse_slots(CURRENT)
    assert [x.busy for x in s] == [False, True]
    assert s[1].kv_tokens == 771 and s[1].n_decoded == 766 and s[1].n_ctx == 2048
    assert s[0].kv_tokens == 0
    assert [x.id_task for x in s] == [None, 1]  # none before a slot's first task


def test_id_task_kept_while_idle_and_only_when_an_integer():
    """This build names the previous task of an idle slot (``task_prev``); a build without the
    field, or a value that is not an integer, gives None (no leaked-slot judgement)."""
    idle = parse_slot({"id": 0, "is_processing": False, "id_task": 41})
    assert (idle.busy, idle.id_task) == (False, 41)
    assert [parse_slot({"id": 0, "is_processing": True, "id_task": v}).id_task
            for v in ("41", True, None, 4.0)] == [None, None, None, None]
    assert [x.id_task for x in parse_slots(OLDER)] == [None, None, None]


def test_older_shape_and_missing_fields():
    s = parse_slots(OLDER)
    assert [x.busy for x in s] == [True, False, False]
    assert s[0].kv_tokens == 60 + 40 + 25  # prompt (processed + cached) + decoded
    assert s[2].n_ctx == 0 and s[2].kv_tokens == 0
    assert parse_slots({"error": "x"}) == [] and parse_slots(None) == []
    assert parse_slot({"id": "x", "is_processing": True, "next_token": []}).kv_tokens == 0


def test_metrics_and_load():
    m = parse_metrics(METRICS)
    assert m["requests_deferred"] == 2 and m["prompt_tokens_cached_total"] == 40
    assert parse_metrics("garbage {{{") == {} or isinstance(parse_metrics("garbage {{{"), dict)
    p = Progress()
    load = build_load(10.0, parse_slots(CURRENT), m, p)
    assert load == WorkerLoad(at=10.0, processing=1, kv_tokens=771, deferred=2, decode_tps=0.0,
                              n_ctx=2048)
    later = [dict(CURRENT[0]), dict(CURRENT[1], next_token=[{"n_decoded": 866}])]
    load2 = build_load(10.5, parse_slots(later), m, p)
    assert load2.decode_tps == pytest.approx(200.0)  # 100 tokens in 0.5 s


def test_throughput_moves_only_with_fresh_metrics():
    """A worker decoding 1,000 tokens/s in requests of 250 tokens (a new one starts every
    0.25 s), polled every 0.25 s mid-request with /metrics read every 4th poll, as
    WorkerPoller does: the reading stays at the real rate. With the stale counter used on the
    other polls it swung between 0 and several times the real rate (a fresh tester's find)."""
    p = Progress()
    readings = []
    for k in range(40):
        at = k * 0.25 + 0.125  # mid-request: the running slot has decoded 125 tokens
        fresh = k % 4 == 0
        counted = k if fresh else k - k % 4  # requests ended by the poll whose /metrics we hold
        metrics = {"tokens_predicted_total": 250.0 * counted}
        running = [SlotState(id=0, n_ctx=2048, busy=True, kv_tokens=0, n_decoded=125,
                             n_cached=0)]
        readings.append(build_load(at, running, metrics, p, fresh).decode_tps)
    assert all(r == pytest.approx(1000.0) for r in readings[8:]), readings
    assert max(readings[8:]) <= 1100 and min(readings[8:]) >= 900, readings


class FakeNvml(types.ModuleType):
    """A named fake of pynvml for one GPU (no NVIDIA driver on this machine)."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        super().__init__("pynvml")

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=3 << 30, total=24 << 30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=87)

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000


def test_gpu_stats_with_fake_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(gpu, "_nvml_ok", None)
    stats = gpu.read_gpu_stats()
    assert stats[0].util_percent == 87 and stats[0].power_w == 250.0
    assert stats[0].memory_free_bytes == 21 << 30 and stats[0].name == "Fake GPU"


async def test_a_sample_is_stamped_when_its_poll_was_sent():
    """The worker may read its slots at any moment before its answer arrives, so the sample's
    ``at`` is the send time: a lease released while the poll was in flight counts as released
    after the poll (a fresh tester got 503s with a slot free when it was the arrival time).
    A fake worker (aiohttp app) answers ``/slots`` 0.3 s late."""
    from aiohttp import web

    async def slow_slots(_request):
        await asyncio.sleep(0.3)
        return web.json_response([{"id": 0, "n_ctx": 512, "is_processing": True}])

    async def no_metrics(_request):
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/slots", slow_slots)
    app.router.add_get("/metrics", no_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    ep = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", api_key="k")
    try:
        async with aiohttp.ClientSession() as s:
            p = WorkerPoller("w", lambda: ep, lambda _s: None)
            sent = time.monotonic()
            smp = await p.poll_once(s)
            assert smp is not None and smp.load.processing == 1
            assert sent <= smp.at < sent + 0.2, (sent, smp.at)
            assert p.last is smp
            # the worker went down (no endpoint): its last sample is gone with it, so status
            # and /metrics show no tokens/s or KV fill for a worker with no process
            ep = None
            assert await p.poll_once(s) is None and p.last is None
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_poller_against_real_worker(tmp_path):
    """A real llama-server with --api-key: the poller authenticates, parses, and a request in
    flight shows as one processing slot with KV tokens; a wrong key fails without raising."""
    from tests.conftest import free_port, wait_health
    from workers.demo_model import ensure_demo_model
    from workers.provision import ensure_llama_server

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(ensure_llama_server(None, "cpu")), "-m", str(ensure_demo_model()), "--port", str(port),
        "-np", "2", "-c", "2048", "-t", "1", "--metrics", "--api-key", "k1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    ep = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", api_key="k1")
    try:
        async with aiohttp.ClientSession() as s:
            await wait_health(s, ep.url, tries=100)
            samples = []
            p = WorkerPoller("w", lambda: ep, samples.append, interval_s=0.05)
            first = await p.poll_once(s)
            assert first.load.processing == 0 and first.load.n_ctx == 1024
            gen = asyncio.create_task(s.post(ep.url + "/completion", json={
                "prompt": "hi", "n_predict": 3000}, headers={"Authorization": "Bearer k1"}))
            busy = None
            for _ in range(100):
                smp = await p.poll_once(s)
                if smp.load.processing == 1 and smp.load.kv_tokens > 10:
                    busy = smp
                    break
                await asyncio.sleep(0.02)
            assert busy is not None, "in-flight request never seen in /slots"
            assert "tokens_predicted_total" in busy.metrics
            (await gen).close()
            bad = WorkerPoller("w", lambda: types.SimpleNamespace(url=ep.url, api_key="nope"),
                               samples.append)
            smp = await bad.poll_once(s)
            assert smp is None or smp.slots == []
    finally:
        proc.terminate()
        await proc.wait()
