#!/bin/bash
# Session 29, device call 1: where a 64-head MLA split block's time goes (MLA_WG_STAMPS, tools/mla_stamps.py):
# its GPU test, then the stamps at 16K x 16, 64K x 4, batch 1, and 4K x 64 without its cluster merge.
source bench/h200_2026-12-03c/prelude.sh
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_mla.py -k "gpu_stamps" > $OUT/tests1.log 2>&1
echo "pytest rc $?" >> $OUT/tests1.log
tail -5 $OUT/tests1.log | cut -c1-300
timeout 300 python -m tools.mla_stamps --cases 16384:16,65536:4,16384:1,65536:1,4096:64 \
  --variant '{"MLA_WG_CLUSTER": 0}' --out $OUT/stamps.json > $OUT/stamps1.log 2>&1
echo "stamps rc $?" >> $OUT/stamps1.log
cut -c1-1500 $OUT/stamps1.log | tail -12
