#!/bin/bash
# Session 33 call 5: the K2 engine's DDTree-16 round with and without the wgmma GEMM path (2 layers, batch 1).
source bench/h200_2026-12-03d/prelude.sh
for wg in 1 0; do
  NUMBAENGINE_GEMM_WG=$wg timeout 150 python -m tools.bench --synth-k2 2 --synth-dir /tmp/k2 --modes ddtree \
    --budgets 16 --batches 1 --new-tokens 32 --out $OUT/k2_ddtree_wg$wg.json > $OUT/k2_ddtree_wg$wg.log 2>&1
  echo "k2 ddtree wg=$wg rc $?"; grep -iE "round|loaded|written" $OUT/k2_ddtree_wg$wg.log | cut -c1-300 | tail -3
done
