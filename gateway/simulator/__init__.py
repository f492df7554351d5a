"""Discrete-event simulation of the gateway's scheduler against modelled llama-server workers.

The SAME scheduling objects as the live gateway (``gateway.scheduling.Dispatcher``, its queue,
leases and scorers) run on a virtual clock; only the workers are models
(``gateway.simulator.worker``). ``llama-gateway simulate`` and the benchmarks drive it.
"""

from gateway.simulator.engine import Result, simulate
from gateway.simulator.worker import PROFILES, GpuProfile
from gateway.simulator.workload import Request

__all__ = ["PROFILES", "GpuProfile", "Request", "Result", "simulate"]
