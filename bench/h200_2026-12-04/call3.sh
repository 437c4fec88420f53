#!/bin/bash
# Session 31, device call 3: call 2's two GPU test sets again, verbose (call 2's were cut by their limits with 39 and
# 16 passed, none failed, names not printed): the MLA load paths / mma.sync path / cluster epilogues, then the
# engine's GPU tests (cuda backend vs numpy incl. the 64-head "wide64" pair; device rounds).
source bench/h200_2026-12-03d/prelude.sh
timeout 260 python -m pytest -m gpu -n 16 -v -p no:cacheprovider tests/test_cuda_mla.py \
  -k "loads or mma_sync or (epilogue and (cluster or groups))" > $OUT/tests3a.log 2>&1
echo "pytest rc $?" >> $OUT/tests3a.log
grep -c " PASSED" $OUT/tests3a.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests3a.log | cut -c1-300 | tail -12
timeout 260 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_backend_sim.py tests/test_device_round.py \
  > $OUT/tests3b.log 2>&1
echo "pytest rc $?" >> $OUT/tests3b.log
grep -c " PASSED" $OUT/tests3b.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests3b.log | cut -c1-300 | tail -12
