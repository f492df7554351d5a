"""``python -m gateway`` and the ``llama-gateway`` command (``run``).

``serve`` (also the default verb) catches SIGHUP first thing, before the imports and the config
load (``gateway.early_hup``): until its reload handler is installed a SIGHUP's default action
ended the process (exit 129 within the first ~0.45 s in a tester's runs, the time
``gateway.cli``'s imports took); one that arrives then is applied as a reload once the handler
is there."""

import sys


def run() -> int:
    if sys.argv[1:2] in (["serve"], []):  # serve, named or by default (no verb)
        from gateway import early_hup
        early_hup.catch()
    from gateway.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
