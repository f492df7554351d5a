"""``python -m gateway`` and the ``llama-gateway`` command (``run``).

``serve`` (also the default verb) ignores SIGHUP first thing, before the imports and the config
load: until its reload handler is installed a SIGHUP's default action ended the process (exit
129 within the first ~0.45 s in a tester's runs, the time ``gateway.cli``'s imports took)."""

import signal
import sys


def run() -> int:
    if sys.argv[1:2] in (["serve"], []):  # serve, named or by default (no verb)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from gateway.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
