#!/bin/bash
# Session 32, device call 5: the final rule (XIN only for MT = 2 cuts): the wgmma GEMM GPU tests beside the engine's
# GPU tests (cuda backend tiny / wide / wide64 against numpy, device rounds, graph replay, sampling).
source bench/h200_2026-12-03d/prelude.sh
(timeout 100 python -m pytest -m gpu -n 6 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1;
 echo "pytest rc $?" >> $OUT/tests_wg.log) &
timeout 280 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_backend_sim.py tests/test_device_round.py \
  > $OUT/tests_engine.log 2>&1
echo "pytest rc $?" >> $OUT/tests_engine.log
wait
for f in $OUT/tests_wg.log $OUT/tests_engine.log; do grep -c " PASSED" $f; grep -E "FAILED|ERROR|passed|failed|rc " $f | cut -c1-300 | tail -12; done
