"""workers.gpu against the machine's own NVML (nvidia-ml-py over the NVIDIA driver), no fake.

Which tests run depends on the machine: on one with an NVIDIA GPU (a GPU server; this
project's lent device machine) the readings are checked against NVML's own calls; on one
without a driver (the developers' machines, CI) the clean degradation is. Each skips on the
other kind of machine, saying why. ``tests/workers/test_telemetry.py`` covers the parsing with
a FAKE NVML on every machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import gpu, provision

GPUS = gpu.detect_gpus()
needs_gpu = pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU here (NVML finds none)")


@pytest.mark.skipif(bool(GPUS), reason="this machine has an NVIDIA GPU")
def test_without_a_gpu_nothing_is_found_and_nothing_raises():
    assert gpu.detect_gpus() == []
    assert gpu.read_gpu_stats() == {}
    assert provision.detect_backend() == "cpu"


@needs_gpu
def test_a_real_sample_matches_nvml():
    import pynvml

    stats = gpu.read_gpu_stats()
    assert sorted(stats) == GPUS
    for i, s in stats.items():
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        assert s.index == i and s.name == (name.decode() if isinstance(name, bytes) else name)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        assert s.memory_total_bytes == mem.total >= 1 << 30
        assert 0 < s.memory_used_bytes <= s.memory_total_bytes
        assert s.memory_free_bytes == s.memory_total_bytes - s.memory_used_bytes
        assert 0 <= s.util_percent <= 100
        assert 0 < s.temperature_c < 110, s  # degrees Celsius
        assert 0 < s.power_w < 2000, s  # watts (NVML gives milliwatts)


@needs_gpu
@pytest.mark.skipif(provision._find_nvcc() is None, reason="no nvcc (CUDA toolkit) here")
def test_a_gpu_machine_with_nvcc_builds_for_cuda_and_its_cards():
    assert provision.detect_backend() == "cuda"
    caps = provision._nvidia_compute_capabilities()
    assert len(caps) == len(GPUS) and all(major >= 5 for major, _ in caps), caps
    args = provision._cmake_configure_args(Path("src"), Path("build"), "cuda")
    archs = ";".join(f"{a}{b}" for a, b in sorted(set(caps)))
    assert f"-DCMAKE_CUDA_ARCHITECTURES={archs}" in args
