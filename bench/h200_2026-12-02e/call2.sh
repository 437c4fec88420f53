#!/bin/bash
# Session 26, device call 2: merge_shape's wave rule (kernels.attention MERGE_WAVE_THREADS) against the grid merge and
# the cluster groups at 16K / 64K, the 17-query tree at batch 1 with the rule off / on, then the MLA GPU tests.
source bench/h200_2026-12-02e/prelude.sh
timeout 290 python -m tools.bench_attention --only mla --mla-max-batch 16 \
  --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{"MLA_WG_GRID": 0}, {}, {"MLA_WG_CLUSTER_GROUPS": true, "MLA_WG_GRID": 0}]' \
  --out $OUT/mla_wave.json > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
timeout 100 python -m tools.bench_attention --only mla --mla-max-batch 1 \
  --mla-shapes '{"ctx": [4096], "heads": [64], "queries": [17]}' \
  --mla-variant '[{"MERGE_WAVE_THREADS": 1000000000}, {}]' --out $OUT/mla_tree17.json > $OUT/bench3.log 2>&1
echo "bench rc $?" >> $OUT/bench3.log
timeout 150 python -m pytest -m gpu -n 14 -q tests/test_cuda_mla.py tests/test_cuda_attention.py \
  -k "(test_gpu and not epilogue and not loads) or kv_attention" > $OUT/pytest2.log 2>&1
echo "pytest rc $?" >> $OUT/pytest2.log
grep -v Warn $OUT/pytest2.log | tail -4
