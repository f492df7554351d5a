"""GPU discovery and telemetry through NVML (``import pynvml`` from nvidia-ml-py).

Degrades cleanly: with no NVIDIA driver (``nvmlInit`` fails), ``detect_gpus()`` returns ``[]``
and ``read_gpu_stats()`` returns ``{}``; nothing raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.logs import get_logger

log = get_logger("workers.gpu")
_nvml_ok: bool | None = None


def _init() -> bool:
    global _nvml_ok
    if _nvml_ok is None:
        try:
            import pynvml
            pynvml.nvmlInit()
            _nvml_ok = True
        except Exception as e:  # no driver, no library, container without devices …
            log.info("gpu.nvml_unavailable", reason=str(e) or type(e).__name__)
            _nvml_ok = False
    return _nvml_ok


def detect_gpus() -> list[int]:
    """NVML indices of the GPUs present, ``[]`` without a usable NVIDIA driver."""
    if not _init():
        return []
    import pynvml
    try:
        return list(range(pynvml.nvmlDeviceGetCount()))
    except Exception:
        return []


@dataclass(frozen=True)
class GpuStats:
    """One NVML sample. Units: percent, bytes, degrees Celsius, watts."""

    index: int
    name: str
    util_percent: int
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: int
    power_w: float

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - self.memory_used_bytes


def read_gpu_stats() -> dict[int, GpuStats]:
    """A sample per GPU (index → GpuStats); ``{}`` when NVML is unavailable. Never raises."""
    if not _init():
        return {}
    import pynvml
    out: dict[int, GpuStats] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            name = pynvml.nvmlDeviceGetName(h)
            try:
                temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            except Exception:
                temp = 0
            try:
                power = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except Exception:
                power = 0.0
            out[i] = GpuStats(i, name.decode() if isinstance(name, bytes) else str(name),
                              int(util.gpu), int(mem.used), int(mem.total), int(temp), power)
    except Exception as e:
        log.warning("gpu.read_failed", error=str(e))
    return out
