"""Scheduling policy, free of I/O: tickets, queue, slot leases, scorer and dispatcher.

Nothing here touches asyncio, sockets or the wall clock. Time comes from an injected
``clock`` callable returning seconds (float). The live gateway (``gateway.admission``) and
the simulator drive the same objects.
"""

from gateway.scheduling.dispatcher import Dispatcher, QueueFull
from gateway.scheduling.lease import SlotLease
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.worker_view import WorkerView

__all__ = ["Dispatcher", "QueueFull", "SlotLease", "Ticket", "WorkerView"]
