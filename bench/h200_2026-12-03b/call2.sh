#!/bin/bash
# Session 28, device call 2: the grid merge with one L2 round trip (partials land in shared memory by cp.async,
# kernels/mla_wg.py grid_merge): its GPU tests (verbose: call 1's run timed out with 8 of 9 passed), then
# 64-head 16K/64K timing against the merge launch, and batch 1 (129 splits) under the 256 bound.
source bench/h200_2026-12-03b/prelude.sh
timeout 240 python -m pytest -m gpu -n 9 -v -p no:cacheprovider tests/test_cuda_mla.py \
  -k "epilogue and grid and not groups_grid" > $OUT/tests2.log 2>&1
echo "pytest rc $?" >> $OUT/tests2.log
grep -E "PASSED|FAILED|ERROR|rc |passed|failed|Error|assert" $OUT/tests2.log | cut -c1-300 | tail -30
timeout 300 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/g2.json \
  --mla-max-batch 16 --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_GRID": 64}, {"MLA_WG_GRID": 256}]' > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
grep -v "^\s*$" $OUT/bench2.log | cut -c1-330 | tail -24
