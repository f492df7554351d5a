"""gateway/speed.py: per-sequence decode rate from llama-server's generation counters, and the
relative speeds the scheduler uses (pure); plus what the counters count, on a real worker."""

import asyncio

import pytest

from gateway.speed import (SPEED_MAX, SPEED_MIN, DecodeMeter, SpeedBoard, print_step,
                           relative_speeds)
from workers.telemetry import parse_metrics


def m(tokens, seconds):
    """A ``/metrics`` sample as ``parse_metrics`` gives it."""
    return {"tokens_predicted_total": tokens, "tokens_predicted_seconds_total": seconds,
            "requests_deferred": 0.0}


def test_window_closes_once_it_holds_a_second_and_64_tokens():
    d = DecodeMeter()
    assert d.update(m(1000, 10.0)) is False and d.rate is None  # the window's start
    assert d.update(m(1100, 10.5)) is False and d.rate is None  # 0.5 s: keeps accumulating
    assert d.update(m(1240, 11.2)) is True
    assert d.rate == pytest.approx(240 / 1.2)  # Δ since the window's start, not the last read
    assert d.update(m(1240, 11.2)) is False  # nothing new (a poll that reused the last read)


def test_window_needs_64_tokens_too():
    d = DecodeMeter()
    d.update(m(0, 0.0))
    assert d.update(m(50, 5.0)) is False and d.rate is None  # a slow worker: 10 tokens/s
    assert d.update(m(70, 7.0)) is True and d.rate == pytest.approx(10.0)


def test_rate_is_an_ewma_over_windows():
    d = DecodeMeter()
    d.update(m(0, 0.0))
    d.update(m(200, 2.0))  # 100 tokens/s: the first window is taken as it is
    assert d.rate == pytest.approx(100.0)
    d.update(m(600, 4.0))  # 200 tokens/s
    assert d.rate == pytest.approx(0.1 * 200 + 0.9 * 100)


def test_print_step_and_windows_on_large_counters():
    """llama-server prints 6 significant digits: past 10^6 a window must span 100 steps."""
    assert print_step(123456) == 1 and print_step(1.23457e6) == 10
    assert print_step(0.196754) == pytest.approx(1e-6) and print_step(0) == 0.0
    d = DecodeMeter()
    d.update(m(5.0e8, 2.0e6))  # tokens step 1000, seconds step 10
    assert d.update(m(5.0e8 + 50_000, 2.0e6 + 500)) is False  # 500 s < 100 steps of 10 s
    assert d.update(m(5.0e8 + 100_000, 2.0e6 + 1000)) is True
    assert d.rate == pytest.approx(100.0)


def test_counters_going_down_start_over():
    """A new worker process starts its counters at 0: no rate until a new window closes."""
    d = DecodeMeter()
    d.update(m(0, 0.0))
    d.update(m(300, 1.0))
    assert d.update(m(10, 0.1)) is True and d.rate is None
    assert d.update(m(110, 1.1)) is True and d.rate == pytest.approx(100.0)  # from (10, 0.1)


def test_missing_counters_give_no_rate_and_speed_one():
    d = DecodeMeter()
    for s in ({}, {"tokens_predicted_total": 500.0}, parse_metrics("garbage {{{")):
        assert d.update(s) is False
    assert d.rate is None
    board = SpeedBoard()
    assert board.observe("a", "m", {"requests_deferred": 0.0}) == {}
    assert board.speeds("m") == {"a": 1.0} and board.rate("a") is None


def test_relative_to_the_lower_median_of_measured_workers():
    assert relative_speeds({"a": 100.0, "b": 300.0}) == {"a": 1.0, "b": 3.0}
    s = relative_speeds({"a": 100.0, "b": 50.0, "c": 300.0, "d": None})
    assert s == {"a": 1.0, "b": 0.5, "c": 3.0, "d": 1.0}
    assert relative_speeds({"a": None, "b": None}) == {"a": 1.0, "b": 1.0}
    assert relative_speeds({}) == {}


def test_dead_band_keeps_similar_workers_exactly_equal():
    s = relative_speeds({"ref": 100.0, "a": 119.0, "b": 81.0, "c": 122.0, "d": 78.0, "e": 100.0})
    assert s["a"] == s["b"] == s["e"] == s["ref"] == 1.0
    assert s["c"] == pytest.approx(1.22) and s["d"] == pytest.approx(0.78)


def test_clamped():
    assert relative_speeds({"a": 10.0, "b": 10.0, "fast": 1000.0})["fast"] == SPEED_MAX
    assert relative_speeds({"a": 100.0, "b": 100.0, "slow": 1.0})["slow"] == SPEED_MIN


def test_board_normalises_per_model_and_forgets_a_restarted_worker():
    board = SpeedBoard()
    for w, model in (("a", "m"), ("b", "m"), ("x", "other")):
        assert board.observe(w, model, m(0, 0.0)) == {}
    assert board.observe("a", "m", m(100, 1.0)) == {"a": 1.0, "b": 1.0}  # b unmeasured
    assert board.observe("b", "m", m(300, 1.0)) == {"a": 1.0, "b": 3.0}
    assert board.observe("x", "other", m(1000, 1.0)) == {"x": 1.0}  # not compared with m
    assert board.rate("b") == pytest.approx(300.0)
    assert board.forget("b") == {"a": 1.0, "b": 1.0}
    assert board.rate("b") is None and board.forget("b") == {}
    assert board.observe("b", "m", m(5, 0.01)) == {}  # the new process: a new window start
    assert board.speeds("m") == {"a": 1.0, "b": 1.0}


@pytest.mark.slow
async def test_counters_of_a_real_worker_count_finished_sequences(tmp_path):
    """What ``gateway.speed`` reads, on the pinned llama-server: a finished request adds its
    ``predicted_n`` tokens and ``predicted_ms`` (first token to last) to the two counters; a
    running request adds nothing yet."""
    import aiohttp

    from tests.conftest import free_port, wait_health
    from workers.demo_model import ensure_demo_model
    from workers.provision import ensure_llama_server

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(ensure_llama_server(None, "cpu")), "-m", str(ensure_demo_model()), "--port", str(port),
        "-np", "2", "-c", "8192", "-t", "1", "--metrics",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def counters():
                async with s.get(url + "/metrics") as r:
                    return parse_metrics(await r.text())

            await wait_health(s, url, tries=100)
            before = await counters()
            meter = DecodeMeter(min_seconds=0.0, min_tokens=1)
            meter.update(before)
            long = asyncio.create_task(s.post(url + "/completion", json={
                "prompt": "a", "n_predict": 3000, "stream": True}))
            resp = await long
            await resp.content.readline()  # it runs
            async with s.post(url + "/completion", json={"prompt": "b", "n_predict": 200}) as r:
                done = (await r.json())["timings"]
            mid = await counters()
            assert mid["tokens_predicted_total"] - before["tokens_predicted_total"] == done["predicted_n"]
            assert mid["tokens_predicted_seconds_total"] - before["tokens_predicted_seconds_total"] \
                == pytest.approx(done["predicted_ms"] / 1000, abs=2e-6)
            assert meter.update(mid) is True
            assert meter.rate == pytest.approx(done["predicted_n"] / (done["predicted_ms"] / 1000),
                                               rel=1e-3)
            resp.close()
    finally:
        # llama-server can sit on SIGTERM while a generation is still running (field case 11:
        # once, this wait hung the CI run for pytest's 300 s): SIGKILL after 10 s, as the
        # supervisor's stop_grace_s does.
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
