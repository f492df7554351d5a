"""workers/stall_check.py: the decision whether a worker whose requests stalled still works.

``slots_work`` is pure. ``check_worker`` is run over real HTTP against FAKE workers: small
aiohttp apps in this file that answer ``/lora-adapters`` and ``/slots`` as scripted (a frozen
main loop, a route that is missing, slots that never move), which no real llama-server does on
demand. The last test runs the check against the real llama-server (busy, then frozen by
SIGSTOP); through a gateway, tests/e2e/test_watchdog.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import free_port, wait_health
from workers.demo_model import ensure_demo_model
from workers.process import LaunchSpec, WorkerProcess
from workers.provision import ensure_llama_server
from workers.stall_check import check_worker, slots_work


def slot(i: int, busy: bool, task: int | None = None, processed: int = 0, decoded: int = 0):
    """One ``/slots`` entry in the pinned llama-server's shape."""
    return {"id": i, "n_ctx": 2048, "is_processing": busy, "id_task": task,
            "n_prompt_tokens_processed": processed,
            "next_token": [{"has_next_token": busy, "n_decoded": decoded}]}


def test_an_idle_slot_means_the_worker_can_take_work():
    assert slots_work([slot(0, True, 7, 5, 3), slot(1, False)]) is None
    assert slots_work([{"id": 0, "state": 0}]) is None  # older builds: integer state, 0 idle


def test_busy_slots_are_compared_by_task_prompt_progress_and_tokens_decoded():
    before = slots_work([slot(0, True, 7, 5, 3), slot(1, True, 8, 5, 0)])
    assert before == slots_work([slot(0, True, 7, 5, 3), slot(1, True, 8, 5, 0)])  # nothing moved
    assert before != slots_work([slot(0, True, 7, 5, 4), slot(1, True, 8, 5, 0)])  # decoding
    assert before != slots_work([slot(0, True, 7, 5, 3), slot(1, True, 8, 9, 0)])  # prefill
    assert before != slots_work([slot(0, True, 7, 5, 3), slot(1, True, 9, 5, 0)])  # new task


def test_a_body_that_is_not_slots_shows_no_free_slot_and_no_work():
    for body in ({"error": "x"}, [], ["x"], None):
        assert slots_work(body) == frozenset()


async def fake_worker(lora, slots, completion=None) -> tuple[web.AppRunner, str]:
    """A FAKE worker on a free port: ``lora``, ``slots`` and ``completion`` (POST
    ``/completion``) are aiohttp handlers."""
    app = web.Application()
    app.add_routes([web.get("/slots", slots)] + ([web.get("/lora-adapters", lora)] if lora else [])
                   + ([web.post("/completion", completion)] if completion else []))
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # do not wait for a frozen handler
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def loop_answers(request):
    return web.json_response([])


async def loop_frozen(request):
    await asyncio.sleep(3600)


def scripted_slots(*reads: list[dict]):
    """``/slots`` answering ``reads`` in turn, then the last one again and again."""
    calls = []

    async def handler(request):
        calls.append(1)
        return web.json_response(reads[min(len(calls), len(reads)) - 1])
    return handler


async def check(lora, slots, timeout_s: float = 0.6, completion=None) -> str | None:
    """``check_worker`` against a FAKE worker; asserts it kept its bound. With a
    ``completion`` handler the check includes the one-token completion (step 3)."""
    runner, url = await fake_worker(lora, slots, completion)
    try:
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            why = await check_worker(http, url, {}, timeout_s, poll_s=0.05,
                                     completion=completion is not None)
            assert time.monotonic() - t0 < timeout_s + 0.5
            return why
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("reads", [
    [[slot(0, False), slot(1, False)]],                                   # idle worker
    [[slot(0, True, 4, 5, 1)], [slot(0, True, 4, 5, 2)]],                 # every slot generating
    [[slot(0, True, 4, 5, 0)], [slot(0, True, 4, 5, 0)], [slot(0, False)]],  # stalled slot freed
])
async def test_a_worker_whose_loop_answers_and_whose_slots_free_or_move_passes(reads):
    assert await check(loop_answers, scripted_slots(*reads)) is None


async def test_a_frozen_main_loop_fails_within_the_bound():
    why = await check(loop_frozen, scripted_slots([slot(0, False)]))
    assert why == "its main loop (GET /lora-adapters) did not answer within 0.6 s"


async def test_slots_that_never_free_nor_move_fail():
    stuck = [slot(0, True, 4, 5, 0), slot(1, True, 6, 5, 0)]
    why = await check(loop_answers, scripted_slots(stuck))
    assert why == "every slot stayed busy with no progress for 0.6 s"


async def test_a_build_without_the_route_fails_as_before_the_check_existed():
    why = await check(None, scripted_slots([slot(0, False)]))
    assert why == "its main loop (GET /lora-adapters) answered HTTP 404"


async def test_a_worker_that_never_schedules_a_completion_fails_the_completion_step():
    """Step 3 (field case 10): main loop and ``/slots`` answer, every slot idle, and the
    one-token completion is never answered (a fresh tester's proxy that held completions)."""
    probes = []

    async def held(request):
        probes.append(await request.json())
        await asyncio.sleep(3600)

    why = await check(loop_answers, scripted_slots([slot(0, False)]), completion=held)
    assert why == ("a one-token completion (POST /completion) while a slot was idle did not "
                   "answer within 0.6 s")
    assert probes == [{"prompt": "ok", "n_predict": 1, "cache_prompt": False, "stream": False}]


async def test_the_completion_step_passes_when_answered_and_is_skipped_while_slots_work():
    async def answered(request):
        return web.json_response({"content": "x", "stop": True})

    async def refused(request):
        return web.json_response({"error": {"code": 500}}, status=500)

    async def never(request):  # must not be asked: every slot is busy and moving
        raise AssertionError("probe sent with no idle slot")

    assert await check(loop_answers, scripted_slots([slot(0, False)]), completion=answered) is None
    assert await check(loop_answers, scripted_slots([slot(0, False)]), completion=refused) == \
        "a one-token completion (POST /completion) while a slot was idle answered HTTP 500"
    moving = scripted_slots([slot(0, True, 4, 5, 1)], [slot(0, True, 4, 5, 2)])
    assert await check(loop_answers, moving, completion=never) is None


async def test_a_worker_that_is_gone_fails_without_raising():
    async with aiohttp.ClientSession() as http:
        why = await check_worker(http, f"http://127.0.0.1:{free_port()}", {}, 0.6)
    assert why.startswith("its main loop (GET /lora-adapters) failed: ")


@pytest.mark.slow
async def test_a_real_worker_passes_with_every_slot_generating_and_fails_when_frozen(tmp_path):
    """The pinned llama-server itself: ``/lora-adapters`` is answered with no free slot (both
    slots generating long answers), and not at all while the process is stopped (SIGSTOP)."""
    spec = LaunchSpec(worker_id="demo-cpu0", binary=ensure_llama_server(),
                      model_path=ensure_demo_model(), alias="demo:latest", gpus=(), slots=2,
                      context_per_slot=8192, threads=1)
    proc = WorkerProcess(spec, state_dir=tmp_path / "run")
    await proc.start()
    headers = {"Authorization": f"Bearer {proc.api_key}"}
    try:
        async with aiohttp.ClientSession() as http:
            await wait_health(http, proc.url)
            assert await check_worker(http, proc.url, headers, 2.0) is None  # idle
            # the one-token completion of step 3 is answered by the real worker
            assert await check_worker(http, proc.url, headers, 2.0, completion=True) is None

            async def generate():
                async with http.post(proc.url + "/completion", headers=headers, json={
                        "prompt": "a", "n_predict": 8000, "stream": True}) as r:
                    async for _ in r.content:
                        pass
            async def slots():
                async with http.get(proc.url + "/slots", headers=headers) as r:
                    return await r.json()

            running = [asyncio.create_task(generate()) for _ in range(2)]
            try:
                while slots_work(await slots()) is None:  # until no slot is free
                    await asyncio.sleep(0.05)
                assert await check_worker(http, proc.url, headers, 2.0) is None
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    why = await check_worker(http, proc.url, headers, 1.0)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                assert why == "its main loop (GET /lora-adapters) did not answer within 1 s"
            finally:
                for t in running:
                    t.cancel()
    finally:
        await proc.stop(2)
