#!/bin/bash
# Session 31, device call 4: the cluster-group epilogues (their clusters' partials written as bf16 by cluster_merge,
# then merge_splits or the grid merge), which call 3 left running at its limit.
source bench/h200_2026-12-03d/prelude.sh
timeout 230 python -m pytest -m gpu -n 16 -v -p no:cacheprovider tests/test_cuda_mla.py -k "epilogue and groups" \
  > $OUT/tests4.log 2>&1
echo "pytest rc $?" >> $OUT/tests4.log
grep -c " PASSED" $OUT/tests4.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests4.log | cut -c1-300 | tail -12
