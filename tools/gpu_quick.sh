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
rc=0
if [ -n "${GPU_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rf -n "${GPU_TEST_WORKERS:-8}" $GPU_TESTS \
    > "$OUT/pytest_gpu.log" 2>&1 || rc=1
  tail -8 "$OUT/pytest_gpu.log"
fi
i=0
IFS=';' read -ra sets <<< "${E2E:-}"
for args in "${sets[@]}"; do
  i=$((i + 1))
  timeout "${E2E_TIMEOUT:-300}" python3 -m tools.bench $args --out "$OUT/bench_$i.json" 2>&1 | sed "/^{/d" || rc=1
done
i=0
IFS=';' read -ra sets <<< "${PROFILE:-}"
for args in "${sets[@]}"; do
  i=$((i + 1))
  timeout "${E2E_TIMEOUT:-300}" python3 -m tools.profile_round $args --out "$OUT/profile_$i.json" 2>&1 || rc=1
done
exit $rc
