#!/bin/bash
# Session 32, device call 2: kernels/gemm_wg.py with clusters of <= 4, rings sized per block, x converted by the
# blocks (XIN): its GPU tests and the dense mma-path GPU tests, then the GEMM bench with the wgmma knobs.
source bench/h200_2026-12-03d/prelude.sh
timeout 170 python -m pytest -m gpu -n 12 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py tests/test_cuda_dense.py \
  -k "gemm" > $OUT/tests.log 2>&1
echo "pytest rc $?" >> $OUT/tests.log
grep -c " PASSED" $OUT/tests.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests.log | cut -c1-300 | tail -25
timeout 380 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b,kv_b \
  --variants mma,wg_cl8,wg_cl2,wg_noxin,wg_t1 --out $OUT/gemm_wg2.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|read|copy|rc " $OUT/bench.log | cut -c1-200 | tail -30
