#!/bin/bash
# Prepared in session 33 for the next session's first device call (NOT run yet): the wgmma GEMM tests (the
# fence-less kernel's new correctness test among them), the bench with the fence off, and the MLA cluster-group
# grid cases left unverified since session 31. The K2 DDTree A/B needs its own calls: see the README of this folder.
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1
echo "pytest rc $?" >> $OUT/tests_wg.log
grep -c " PASSED" $OUT/tests_wg.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests_wg.log | cut -c1-300 | tail -12
timeout 150 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b \
  --variants wg_nofence --out $OUT/gemm_nofence.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -8
timeout 200 python -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda_mla.py -k "split66-groups or split33-groups" \
  > $OUT/tests_mla_groups.log 2>&1; echo "mla groups rc $?" >> $OUT/tests_mla_groups.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " $OUT/tests_mla_groups.log | cut -c1-200 | tail -8
