#!/bin/bash
# Session 30, device call 4: the expert stages' grids as one wave (blocks_per_sm 4 = what fits) against the default
# two waves (8): stamps at n = 1 / 4, then the MoE table with the variants.
source bench/h200_2026-12-03d/prelude.sh
for v in '{"gu": {"blocks_per_sm": 4}, "dn": {"blocks_per_sm": 4}}'; do
  timeout 100 python -m tools.moe_stamps --cases 4,17 --variant "$v" --out $OUT/moe_stamps_bps4.json >> $OUT/moe_stamps.log 2>&1
  echo "stamps rc $?" >> $OUT/moe_stamps.log
done
cut -c1-900 $OUT/moe_stamps.log
timeout 200 python -m tools.bench_kernels --only moe --quick --variants gu_bps4,bps4 --out $OUT/moe.json > $OUT/moe.log 2>&1
echo "moe rc $?" >> $OUT/moe.log
grep "moe \|copy\|rc " $OUT/moe.log | cut -c1-400 | tail -14
