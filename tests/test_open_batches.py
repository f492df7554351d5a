"""gateway/open_batches.py: the running embedding batches a reload lets end."""

from __future__ import annotations

import asyncio

from gateway.open_batches import OpenBatches


def test_count_follows_the_with_blocks_and_forgets_ended_batches():
    b = OpenBatches()
    assert b.count(["a"]) == 0
    with b.running("a"), b.running("a"), b.running("c"):
        assert (b.count(["a"]), b.count(["a", "c"]), b.count(["z"])) == (2, 3, 0)
    assert b.count(["a", "c"]) == 0 and b._open == {}


def test_a_batch_that_raises_still_ends():
    b = OpenBatches()
    try:
        with b.running("a"):
            raise ValueError("an input failed")
    except ValueError:
        pass
    assert b.count(["a"]) == 0


def test_wait_returns_when_the_running_batches_end_and_ignores_later_ones():
    async def main():
        b = OpenBatches()
        release = asyncio.Event()

        async def batch(model, until=release):
            with b.running(model):
                await until.wait()

        first = asyncio.ensure_future(batch("a"))
        other = asyncio.ensure_future(batch("b"))
        await asyncio.sleep(0)
        waiter = asyncio.ensure_future(b.wait(["a"], 5))
        await asyncio.sleep(0)
        never = asyncio.Event()
        later = asyncio.ensure_future(batch("a", never))  # begun after the wait: not waited for
        await asyncio.sleep(0.01)
        assert not waiter.done()
        release.set()
        await first
        left = await asyncio.wait_for(waiter, 1)  # while ``later`` still runs
        assert not later.done() and b.count(["a"]) == 1
        never.set()
        await asyncio.gather(other, later)
        return left

    assert asyncio.run(main()) == 0


def test_wait_times_out_with_the_count_still_running():
    async def main():
        b = OpenBatches()
        stuck = asyncio.Event()

        async def batch():
            with b.running("a"):
                await stuck.wait()

        tasks = [asyncio.ensure_future(batch()) for _ in range(2)]
        await asyncio.sleep(0)
        t0 = asyncio.get_running_loop().time()
        left = await b.wait(["a"], 0.05)
        waited = asyncio.get_running_loop().time() - t0
        stuck.set()
        await asyncio.gather(*tasks)
        return left, waited

    left, waited = asyncio.run(main())
    assert left == 2 and waited >= 0.05


def test_wait_with_nothing_running_returns_at_once():
    assert asyncio.run(OpenBatches().wait(["a"], 10)) == 0
