"""SIGHUPs that arrive before ``serve`` installs its reload handler (no I/O but the signal).

``serve`` (both entry points: ``gateway.__main__`` and ``gateway.cli.main``) calls
:func:`catch` first thing, before its imports and the config load; ``gateway.app.serve`` asks
:func:`take` once its loop's reload handler is installed and then reloads. A SIGHUP's default
action ended the process there (exit 129 within the first ~0.45 s, a tester's find), and the
``SIG_IGN`` that replaced it dropped the reload: a config changed and signalled in the gateway's
first second was never applied, with nothing logged (a fresh tester's find: 5 of 6 tries at
0.70–0.80 s after the start).
"""

import signal

_pending: list[bool] = []


def _note(signum, frame) -> None:  # a signal handler: only records the signal
    _pending.append(True)


def catch() -> None:
    """Record SIGHUPs from now on, for :func:`take` (main thread only, as ``signal.signal``)."""
    signal.signal(signal.SIGHUP, _note)


def take() -> bool:
    """Whether a SIGHUP was recorded since :func:`catch` (the record is cleared)."""
    got = bool(_pending)
    _pending.clear()
    return got
