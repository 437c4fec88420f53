#!/bin/bash
# Session 26, device call 1: the 16K x 16 merge variants (MERGE_GROUPS, cluster groups +- grid), then the groups tests.
source bench/h200_2026-12-02e/prelude.sh
timeout 340 python -m tools.bench_attention --only mla --mla-max-batch 16 \
  --mla-shapes '{"ctx": [16384], "heads": [64], "queries": [1]}' \
  --mla-variant '[{"MLA_WG_GRID": 0}, {"MLA_WG_GRID": 0, "MERGE_GROUPS": 2}, {}, {"MLA_WG_CLUSTER_GROUPS": true, "MLA_WG_GRID": 0}, {"MLA_WG_CLUSTER_GROUPS": true}]' \
  --out $OUT/mla16k_variants.json > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
timeout 200 python -m pytest -m gpu -n 14 -q tests/test_cuda_mla.py -k "epilogue and groups" > $OUT/pytest1.log 2>&1
echo "pytest rc $?" >> $OUT/pytest1.log
tail -5 $OUT/bench1.log $OUT/pytest1.log
