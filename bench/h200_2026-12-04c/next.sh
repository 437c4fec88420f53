#!/bin/bash
# Prepared in session 33 for the next session's first device call (NOT run yet): the wgmma GEMM tests (new: the
# fence-less kernel, XIN 2 = x as f32 by TMA converted in shared memory), the bench with the fence off and with XIN 2,
# XIN 2's stamps, and the MLA cluster-group grid cases left unverified since session 31. The K2 DDTree A/B needs its own calls: see the README of this folder.
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1
echo "pytest rc $?" >> $OUT/tests_wg.log
grep -c " PASSED" $OUT/tests_wg.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests_wg.log | cut -c1-300 | tail -12
timeout 150 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,shared_down,q_b \
  --variants wg_nofence,wg_xtma,wg_xtma8 --out $OUT/gemm_next.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -8
timeout 100 python -m tools.gemm_wg_stamps --set WG_XTMA_ROWS=64 --set WG_XIN_ROWS=0 --out $OUT/stamps_xtma.json \
  > $OUT/stamps_xtma.log 2>&1; echo "stamps xtma rc $?"
timeout 200 python -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda_mla.py -k "split66-groups or split33-groups" \
  > $OUT/tests_mla_groups.log 2>&1; echo "mla groups rc $?" >> $OUT/tests_mla_groups.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " $OUT/tests_mla_groups.log | cut -c1-200 | tail -8
