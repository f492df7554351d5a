"""Scheduling policy, free of I/O: tickets, queue, slot leases, scorer and dispatcher.

Nothing here touches asyncio, sockets or the wall clock. Time comes from an injected
``clock`` callable returning seconds (float). The live gateway (``gateway.admission``) and
the simulator drive the same objects.
"""

from gateway.scheduling.dispatcher import Dispatcher, QueueFull, TooLarge, TooManySlots
from gateway.scheduling.lease import SlotLease
from gateway.scheduling.refusals import (AllDrained, AllFailed, ModelRemoved, NoWorkers, NotStarted,
                                        ShuttingDown, Unavailable)
from gateway.scheduling.ticket import Ticket
from gateway.scheduling.scorer import POLICIES, make_scorer
from gateway.scheduling.worker_view import WorkerLoad, WorkerView

__all__ = ["POLICIES", "AllDrained", "AllFailed", "Dispatcher", "ModelRemoved", "NoWorkers", "NotStarted",
           "QueueFull",
           "ShuttingDown", "SlotLease", "Ticket", "TooLarge", "TooManySlots", "Unavailable",
           "WorkerLoad", "WorkerView", "make_scorer"]
