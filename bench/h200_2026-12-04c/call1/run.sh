#!/bin/bash
# Prepared in session 32 for the next session's first device call (NOT run yet): the GPU tests of what changed after
# call 5 (strided out, WG_EARLY_W), where a wgmma GEMM block's time goes, and WG_EARLY_W against the default.
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1
echo "pytest rc $?" >> $OUT/tests_wg.log
grep -c " PASSED" $OUT/tests_wg.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests_wg.log | cut -c1-300 | tail -12
timeout 150 python -m tools.gemm_wg_stamps --out $OUT/stamps.json > $OUT/stamps.log 2>&1; echo "stamps rc $?" >> $OUT/stamps.log
cut -c1-600 $OUT/stamps.log | tail -8
timeout 250 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b,kv_b \
  --variants mma,wg_early --out $OUT/gemm_early.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -8
