#!/usr/bin/env bash
# On the lent GPU: a chosen set of GPU tests and end-to-end benches in one call (what a session re-measures).
#   GPU_TESTS="tests/test_parallel.py tests/test_device_round.py" E2E="--modes ar,ddtree --budgets 16" bash tools/gpu_quick.sh
# E2E (tools/bench.py) and PROFILE (tools/profile_round.py) may hold several argument sets separated by ';'.
# Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
# The NumPy references of the GPU tests multiply small matrices: OpenBLAS's one thread per core (16-128 here) spins
# against the other test workers (suspected cause of a two-device test that sat 250 s in the reference decode).
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-4}
rc=0
if [ -n "${GPU_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -v -rf -o faulthandler_timeout=$((${TEST_TIMEOUT:-300} - 30)) \
    -n "${GPU_TEST_WORKERS:-8}" $GPU_TESTS \
    > "$OUT/pytest_gpu.log" 2>&1 || rc=1
  grep -E "FAILED|ERROR" "$OUT/pytest_gpu.log" | head -20      # -v: a run killed by its timeout still names them
  tail -3 "$OUT/pytest_gpu.log"
fi
run_sets() {   # run_sets MODULE PREFIX "ARGS1;ARGS2;...": one run of python -m MODULE per argument set
  local module=$1 prefix=$2 i=0 args sets
  IFS=';' read -ra sets <<< "$3"
  for args in "${sets[@]}"; do
    i=$((i + 1))
    timeout "${E2E_TIMEOUT:-300}" python3 -m "$module" $args --out "$OUT/${prefix}_$i.json" 2>&1 | sed "/^{/d" || rc=1
  done
}
run_sets tools.bench bench "${E2E:-}"
run_sets tools.profile_round profile "${PROFILE:-}"
exit $rc
