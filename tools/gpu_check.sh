#!/usr/bin/env bash
# On a GPU machine: every GPU test (pytest -m gpu), the kernel benchmark, then the end-to-end benchmark under the
# NVML profiler. Logs and JSON go to $OUT (./gpu_out).
#   bash tools/gpu_check.sh            (device tool: OUT is set there)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import numpy, numba, numba_cuda, cupy; print('numpy', numpy.__version__, 'numba', numba.__version__, \
'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n ${GPU_TEST_WORKERS:-8}"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rf $xdist --junitxml="$OUT/pytest_gpu.xml" ${GPU_TESTS:-tests} 2>&1 \
  | tee "$OUT/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-400}" python3 -m tools.bench_kernels --out "$OUT/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_kernels.log"
bench_rc=${PIPESTATUS[0]}
timeout "${E2E_TIMEOUT:-400}" python3 -m numbaengine.profile --out "$OUT/nvml" -- python3 -m tools.bench \
  --out "$OUT/bench.json" ${E2E_ARGS:---modes ar,dflash,ddtree --budgets 4,16,64,256 --batches 1,8,32} 2>&1 \
  | tee "$OUT/bench.log"
e2e_rc=${PIPESTATUS[0]}
echo "pytest rc=$test_rc bench rc=$bench_rc e2e rc=$e2e_rc" | tee -a "$OUT/gpu.txt"
exit $(( test_rc != 0 || bench_rc != 0 || e2e_rc != 0 ))
