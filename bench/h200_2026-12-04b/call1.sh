#!/bin/bash
# Session 32, device call 1: the wgmma dense GEMM (kernels/gemm_wg.py) GPU tests, then the GEMM bench (default =
# the wgmma path, "mma" = the mma path's cut as before); beside them, session 31's leftover MLA cluster-group tests.
source bench/h200_2026-12-03d/prelude.sh
(timeout 300 python -m pytest -m gpu -n 6 -v -p no:cacheprovider tests/test_cuda_mla.py -k "epilogue and groups" \
  > $OUT/mla_groups.log 2>&1; echo "pytest rc $?" >> $OUT/mla_groups.log) &
timeout 200 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/wg_tests.log 2>&1
echo "pytest rc $?" >> $OUT/wg_tests.log
grep -c " PASSED" $OUT/wg_tests.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/wg_tests.log | cut -c1-400 | tail -25
wait
grep -c " PASSED" $OUT/mla_groups.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/mla_groups.log | cut -c1-300 | tail -8
timeout 280 python -m tools.bench_kernels --only gemm --variants mma --out $OUT/gemm_wg.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "gemm |read|copy|rc " $OUT/bench.log | sed 's/GemmConfig.*//' | cut -c1-200 | tail -90
