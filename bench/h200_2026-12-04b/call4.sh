#!/bin/bash
# Session 32, device call 4: gemm_wg with x converted by the blocks a stage at a time (XIN, <= 8 rows); its GPU tests
# and the engine's wide64 backend test / graph replay beside them, then the GEMM bench (mma, XIN off at m = 1, XIN
# up to 16 rows at m = 9).
source bench/h200_2026-12-03d/prelude.sh
(timeout 200 python -m pytest -m gpu -n 4 -v -p no:cacheprovider tests/test_backend_sim.py tests/test_device_round.py \
  -k "wide64 or graph_replay or matches_numpy" > $OUT/tests_engine.log 2>&1; echo "pytest rc $?" >> $OUT/tests_engine.log) &
timeout 200 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1
echo "pytest rc $?" >> $OUT/tests_wg.log
wait
for f in $OUT/tests_wg.log $OUT/tests_engine.log; do grep -c " PASSED" $f; grep -E "FAILED|ERROR|passed|failed|rc " $f | cut -c1-300 | tail -12; done
timeout 250 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b,kv_b \
  --variants mma,wg_x0,wg_x16 --out $OUT/gemm_wg4.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -8
