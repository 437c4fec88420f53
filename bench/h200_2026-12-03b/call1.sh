#!/bin/bash
# Session 28, device call 1: the compact grid merge (MLA_WG_GRID, written in session 27, never GPU-run):
# its GPU tests, then 64-head 16K/64K timing against the merge launch.
source bench/h200_2026-12-03b/prelude.sh
timeout 250 python -m pytest -m gpu -n 14 -q tests/test_cuda_mla.py -k "epilogue and grid and not groups_grid" \
  > $OUT/tests1.log 2>&1
echo "pytest rc $?" >> $OUT/tests1.log
tail -25 $OUT/tests1.log | cut -c1-300
timeout 300 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/g.json \
  --mla-max-batch 16 --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_GRID": 8}, {"MLA_WG_GRID": 64}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
grep -v "^\s*$" $OUT/bench1.log | cut -c1-400 | tail -24
