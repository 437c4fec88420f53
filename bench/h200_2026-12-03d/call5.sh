#!/bin/bash
# Session 30, device call 5: the one-wave grids (blocks_per_sm 4) against the default at n = 4 / 9, where call 4's
# stamps put gate_up's one-wave span 6% under the two waves' (n = 4); call 4's table compared them at n = 1 / 17 only.
source bench/h200_2026-12-03d/prelude.sh
timeout 200 python -m tools.bench_kernels --only moe --quick --variants gu_bps4,bps4 --moe-sweep-ns 4,9 \
  --out $OUT/moe.json > $OUT/moe.log 2>&1
echo "moe rc $?" >> $OUT/moe.log
grep "moe \|copy\|rc " $OUT/moe.log | cut -c1-400 | tail -14
