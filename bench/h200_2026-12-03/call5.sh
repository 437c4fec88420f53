#!/bin/bash
# Session 27, device call 5: where the grid merge's ~13 us go (16K x batch 16, 8 splits): ncu source counters of the
# 64-head kernel with the grid merge compiled in (MLA_WG_GRID = 8), the third eager call; then the default split
# kernel (merge launch after it) under the same sections but the source counters, for its duration.
source bench/h200_2026-12-03/prelude.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" > $OUT/ncu.log
timeout 330 $NCU --clock-control none --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --section LaunchStats --section SchedulerStats --import-source no -k regex:mla_wg --launch-skip 2 --launch-count 1 \
  -o $OUT/grid python -m tools.bench_attention --profile-mla 64:1:16384:16 --mla-variant '{"MLA_WG_GRID": 8}' \
  >> $OUT/ncu.log 2>&1
echo "ncu rc $?" >> $OUT/ncu.log
tail -5 $OUT/ncu.log
$NCU -i $OUT/grid.ncu-rep --page details > $OUT/grid_details.txt 2>&1
$NCU -i $OUT/grid.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/grid_sass.csv.gz
grep -E "Duration|Elapsed Cycles|DRAM Throughput|Issued Warp|No Eligible|Registers|Warp Cycles Per Issued" \
  $OUT/grid_details.txt
rm -f $OUT/grid.ncu-rep
timeout 150 $NCU --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  -k regex:mla_wg --launch-skip 2 --launch-count 1 python -m tools.bench_attention --profile-mla 64:1:16384:16 \
  > $OUT/split_details.txt 2>&1
echo "ncu rc $?" >> $OUT/split_details.txt
grep -E "Duration|Elapsed Cycles|DRAM Throughput|Issued Warp|No Eligible|Warp Cycles Per Issued|ncu rc" \
  $OUT/split_details.txt
