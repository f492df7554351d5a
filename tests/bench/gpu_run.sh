#!/usr/bin/env bash
# The GPU checks, as run on this project's lent GPU machine (one NVIDIA GPU, nothing can be
# fetched there, its python3 is 3.12 with PyTorch's packages): from the repository root,
#
#   OUT=/some/dir bash tests/bench/gpu_run.sh
#
# It expects, carried beside the checkout (both ignored by git):
#   .whl/                          wheels of this project's pinned packages for CPython 3.12
#   .device/llama-server-cuda.tar.xz   a CUDA build of the pinned llama-server: bin/llama-server
#                                  and its libraries (libcublas comes from the machine's CUDA)
# On a GPU server of your own, skip both: `pip install -e '.[test]'`, set LLAMA_SERVER to a
# CUDA llama-server, and run the two steps at the end.
# It writes under $OUT: pytest.log (tests/workers/test_gpu.py, tests/e2e/test_gpu_workers.py),
# bench_gpu.md and bench.log (tests/bench/real_gpu.py), gpu-demo1b.json and gpu-llama8b-q4.json
# (the calibrations).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
if [ -f .device/llama-server-cuda.tar.xz ]; then
  mkdir -p /tmp/llama-cuda && tar -xJf .device/llama-server-cuda.tar.xz -C /tmp/llama-cuda || exit 1
  export LLAMA_SERVER=/tmp/llama-cuda/bin/llama-server
  lib=$(find /usr/local /opt /usr/lib -name 'libcublas.so.13' 2>/dev/null | head -1)
  [ -n "$lib" ] && export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
: "${LLAMA_SERVER:?set LLAMA_SERVER to a CUDA build of llama-server}"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nproc; grep -m1 "model name" /proc/cpuinfo
ldd "$(dirname "$LLAMA_SERVER")"/libggml-cuda.so 2>/dev/null | grep -E "not found|cublas|cudart"
"$LLAMA_SERVER" --version 2>&1 | tail -1
"$LLAMA_SERVER" --list-devices 2>&1 | tail -3
python3 -m gateway check-config -c gateway.yaml 2>&1 | tail -4

timeout 180 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/workers/test_gpu.py tests/e2e/test_gpu_workers.py 2>&1 | tee "$OUT/pytest.log"
timeout 360 python3 tests/bench/real_gpu.py --binary "$LLAMA_SERVER" --out "$OUT/bench_gpu.md" \
  --calibration "$OUT/gpu-demo1b.json" --calibration-8b "$OUT/gpu-llama8b-q4.json" 2>&1 \
  | tee "$OUT/bench.log"
