#!/bin/bash
# Session 26, device call 3: the grid merge against the merge launch (wave rule) for a 17-query tree at batch 1.
source bench/h200_2026-12-02e/prelude.sh
timeout 140 python -m tools.bench_attention --only mla --mla-max-batch 1 \
  --mla-shapes '{"ctx": [4096, 16384], "heads": [64], "queries": [17]}' \
  --mla-variant '[{"MLA_WG_GRID": 0}, {}]' --out $OUT/mla_tree17_grid.json > $OUT/bench4.log 2>&1
echo "bench rc $?" >> $OUT/bench4.log
grep -v "^\s*$" $OUT/bench4.log | cut -c1-330
