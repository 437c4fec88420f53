#!/bin/bash
# Session 32, device call 3: gemm_wg with x's conversion loads batched (8 chunks in flight per thread) and the
# workspace fix for xs=2 (mma path); GPU tests of the GEMMs and of the engine (cuda backend on the wide / wide64
# pairs: the wgmma GEMM in prefill, eager and captured rounds), then the GEMM bench.
source bench/h200_2026-12-03d/prelude.sh
(timeout 250 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py tests/test_cuda_dense.py \
  -k "gemm" > $OUT/tests_gemm.log 2>&1; echo "pytest rc $?" >> $OUT/tests_gemm.log) &
timeout 250 python -m pytest -m gpu -n 6 -v -p no:cacheprovider tests/test_backend_sim.py tests/test_device_round.py \
  > $OUT/tests_engine.log 2>&1
echo "pytest rc $?" >> $OUT/tests_engine.log
wait
for f in $OUT/tests_gemm.log $OUT/tests_engine.log; do grep -c " PASSED" $f; grep -E "FAILED|ERROR|passed|failed|rc " $f | cut -c1-300 | tail -12; done
timeout 250 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b,kv_b \
  --variants mma,wg_noxin --out $OUT/gemm_wg3.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -12
