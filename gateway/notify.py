"""systemd notification protocol (sd_notify), written against the protocol itself.

systemd's ``Type=notify`` services send newline-separated ``KEY=VALUE`` datagrams to the
AF_UNIX datagram socket named in ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace). Keys used here (man sd_notify(3)):

* ``READY=1``: start-up finished (sent once every worker is ready or has ended its first start
  attempt);
* ``EXTEND_TIMEOUT_USEC=<µs>``: start-up or a reload is still making progress (a llama-server
  build, a worker's first model load, a reload's roll-out): systemd (≥ 236) then waits that
  much longer than ``TimeoutStartSec`` (which also times reloads) from now;
* ``RELOADING=1`` + ``MONOTONIC_USEC=<CLOCK_MONOTONIC µs>``: a reload began; ``READY=1`` ends it;
* ``STOPPING=1``: shutdown began;
* ``STATUS=<text>``: one line shown by ``systemctl status``;
* ``WATCHDOG=1``: keep-alive, needed at least every ``$WATCHDOG_USEC`` µs when the unit sets
  ``WatchdogSec=``. systemd also sets ``$WATCHDOG_PID``; pings are sent only when it is unset
  or equals this process's pid.

Without ``$NOTIFY_SOCKET`` every call is a no-op, so the gateway runs the same outside systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

from gateway.logs import get_logger

log = get_logger("gateway.notify")

#: While start-up or a reload goes on: ``EXTEND_TIMEOUT_USEC`` of this many seconds …
EXTEND_BY_S = 60.0
#: … sent every this many seconds.
EXTEND_EVERY_S = 20.0


class Notifier:
    """Sends sd_notify datagrams. Never raises: a send failure is logged once per kind."""

    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") or ""
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        self.address = addr or None
        self.watchdog_interval_s: float | None = None
        usec, wpid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and (not wpid or wpid == str(os.getpid())):
            try:
                # Ping at half the timeout, as sd_watchdog_enabled(3) recommends.
                self.watchdog_interval_s = max(0.05, int(usec) / 2e6)
            except ValueError:
                log.warning("notify.bad_watchdog_usec", value=usec)
        self._sock: socket.socket | None = None
        self._failed = False
        self._watchdog: asyncio.Task | None = None
        self._last_status: str | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; True when it was sent."""
        if not self.address:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
            return True
        except OSError as e:
            if not self._failed:
                log.warning("notify.send_failed", socket=self.address.replace("\0", "@"), error=str(e))
                self._failed = True
            return False

    def ready(self, status: str | None = None) -> None:
        fields: dict[str, str | int] = {"READY": 1}
        if status:
            fields["STATUS"] = status
            self._last_status = status
        self.send(**fields)

    def extend_start(self, by_s: float) -> None:
        """``EXTEND_TIMEOUT_USEC``: start-up may take ``by_s`` seconds more from now."""
        self.send(EXTEND_TIMEOUT_USEC=int(by_s * 1e6))

    async def extending(self, aw, status: str, every_s: float | None = None,
                        by_s: float | None = None):
        """Await ``aw`` while telling systemd that start-up or a reload goes on
        (``STATUS=status``, and ``EXTEND_TIMEOUT_USEC`` of ``by_s`` s every ``every_s`` s;
        :data:`EXTEND_BY_S` and :data:`EXTEND_EVERY_S` by default); returns its result."""
        every_s = EXTEND_EVERY_S if every_s is None else every_s
        by_s = EXTEND_BY_S if by_s is None else by_s
        task = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=every_s)
                if done:
                    return task.result()
                self.status(status)
                self.extend_start(by_s)
        finally:
            if not task.done():
                task.cancel()

    def reloading(self) -> None:
        self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str = "stopping") -> None:
        self._last_status = status
        self.send(STOPPING=1, STATUS=status)

    def status(self, text: str) -> None:
        """``STATUS=`` line; sent only when it changed."""
        text = text.replace("\n", " ")
        if text != self._last_status:
            self._last_status = text
            self.send(STATUS=text)

    def start_watchdog(self) -> None:
        """Ping ``WATCHDOG=1`` every half ``$WATCHDOG_USEC`` from the event loop (so a stuck
        loop stops the pings and systemd restarts the service)."""
        if self.enabled and self.watchdog_interval_s and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._ping(), name="sd-watchdog")

    async def _ping(self) -> None:
        while True:
            self.send(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_interval_s or 1.0)

    def close(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
            self._watchdog = None
        if self._sock:
            self._sock.close()
            self._sock = None


def fleet_status(states: dict[str, str]) -> str:
    """One STATUS line from worker states, e.g. ``"2/3 workers ready; demo-cpu2: starting"``."""
    ready = sum(1 for s in states.values() if s == "ready")
    others = [f"{w}: {s}" for w, s in states.items() if s != "ready"]
    return f"{ready}/{len(states)} workers ready" + ("; " + ", ".join(others) if others else "")
