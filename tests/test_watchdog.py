"""Unit tests of gateway.watchdog with an injected clock and stand-in stream objects."""

import asyncio

from gateway.upstream import UpstreamError
from gateway.watchdog import StreamWatch, Watchdog


class Content:  # stands in for aiohttp's StreamReader: total_bytes + set_exception
    def __init__(self):
        self.total_bytes = 0
        self.exc = None

    def set_exception(self, exc):
        self.exc = exc


class Resp:  # stands in for gateway.worker_http.WorkerResponse without progress events
    def __init__(self):
        self.content = Content()

    @property
    def answered(self):
        return self.content.total_bytes > 0


class Transport:
    def __init__(self):
        self.buffered = 0
        self.aborted = False

    def is_closing(self):
        return self.aborted

    def get_write_buffer_size(self):
        return self.buffered

    def abort(self):
        self.aborted = True


def make(**kw):
    stalls, progress = [], []
    wd = Watchdog(UpstreamError, first_byte_s=5, inter_token_s=2, client_write_s=3,
                  write_buffer_bytes=100, on_stall=stalls.append, on_progress=progress.append, **kw)
    return wd, stalls, progress


def test_first_byte_inter_token_and_deadline():
    wd, stalls, progress = make()
    a = StreamWatch("w1", "r1", Resp(), t_sent=0.0, deadline=100.0)
    b = StreamWatch("w2", "r2", Resp(), t_sent=0.0, deadline=100.0)
    c = StreamWatch("w3", "r3", Resp(), t_sent=0.0, deadline=3.0)
    for w in (a, b, c):
        w.t_progress = 0.0
        wd.watches.add(w)
    b.resp.content.total_bytes = 10
    wd.check(1.0)
    assert progress == ["w2"] and not stalls
    wd.check(3.5)  # b silent 2.5 s > inter_token_s; c past its deadline
    assert b.resp.content.exc.kind == "inter_token_timeout" and stalls == ["w2"]
    assert c.resp.content.exc.kind == "deadline" and c.resp.content.exc.status == 504
    assert a.resp.content.exc is None
    wd.check(5.5)
    assert a.resp.content.exc.kind == "first_byte_timeout" and stalls == ["w2", "w1"]


def test_prompt_progress_is_not_the_answer_for_the_first_byte_limit():
    """With llama-server's prompt-progress events (a real WorkerResponse, ``progress``), bytes
    during the prefill count as the worker's progress but not as the answer: the first-byte
    limit still applies until the first real event, and the inter-token limit only after it."""
    from gateway.worker_http import WorkerResponse, _Conn

    loop = asyncio.new_event_loop()
    try:
        wd, stalls, progress = make()
        long_prefill = StreamWatch("w1", "r1", WorkerResponse(_Conn(loop), progress=True),
                                   t_sent=0.0, deadline=100.0)
        answering = StreamWatch("w2", "r2", WorkerResponse(_Conn(loop), progress=True),
                                t_sent=0.0, deadline=100.0)
        for w in (long_prefill, answering):
            w.t_progress = 0.0
            wd.watches.add(w)
        long_prefill.resp.content.total_bytes = 120  # progress events only
        answering.resp.content.total_bytes = 120
        wd.check(1.0)
        assert sorted(progress) == ["w1", "w2"] and not stalls
        answering.resp.note_answer()
        answering.resp.content.total_bytes = 200
        wd.check(1.5)
        wd.check(3.0)  # w1: 2 s without bytes, but no answer yet: only the first-byte limit
        assert long_prefill.aborted is None and answering.aborted is None
        wd.check(3.6)  # w2 answered and then fell silent for more than inter_token_s
        assert answering.aborted == "worker w2 sent nothing for 2 s mid-answer"
        assert long_prefill.aborted is None
        wd.check(5.1)
        assert long_prefill.aborted == ("worker w1 sent no token within 5 s (it was still "
                                        "computing the prompt)")
        assert stalls == ["w2", "w1"]
    finally:
        loop.close()


def test_client_not_reading_is_dropped_and_worker_not_blamed():
    wd, stalls, _ = make()
    t = Transport()
    w = StreamWatch("w1", "r1", Resp(), t_sent=0.0, deadline=100.0, downstream=t)
    w.t_progress = 0.0
    wd.watches.add(w)
    w.resp.content.total_bytes = 5
    wd.check(0.5)
    t.buffered = 100
    for now in (1.0, 2.5, 3.9):
        wd.check(now)
    assert not t.aborted and not stalls  # blocked by the client: worker not timed
    wd.check(4.1)
    assert t.aborted and not stalls and w.aborted == "client stopped reading"


def test_abort_worker_only_hits_that_worker():
    wd, _, _ = make()
    ws = [StreamWatch(f"w{i % 2}", f"r{i}", Resp(), 0.0, 100.0) for i in range(4)]
    wd.watches.update(ws)
    assert wd.abort_worker("w1", "worker w1 wedged") == 2
    assert [w.resp.content.exc is not None for w in ws] == [False, True, False, True]
    assert ws[1].resp.content.exc.message == "worker w1 wedged"
    assert wd.abort_worker("w1", "again") == 0  # idempotent
    asyncio.run(asyncio.sleep(0))
