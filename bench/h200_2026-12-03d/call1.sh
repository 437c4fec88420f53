#!/bin/bash
# Session 30, device call 1: session 29's call 4 again on a fresh H200 (final code vs MLA_WG_Q_FIRST off, the
# 64-head GPU tests incl. test_gpu_stamps' guard check), then the stamps of the final code at 16K x 16.
source bench/h200_2026-12-03d/prelude.sh
timeout 220 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/qfirst.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_Q_FIRST": false}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
grep -v "^\s*$" $OUT/bench1.log | cut -c1-420 | tail -16
timeout 150 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py \
  -k "(test_gpu and (h64 or h128) and not epilogue and not loads and not mma_sync) or stamps" > $OUT/tests1.log 2>&1
echo "pytest rc $?" >> $OUT/tests1.log
grep -E "passed|failed|Error|rc |^\.+" $OUT/tests1.log | cut -c1-300 | tail -8
timeout 100 python -m tools.mla_stamps --cases 16384:16,65536:4 --variant '{"MLA_WG_CLUSTER": 0}' \
  --out $OUT/stamps.json > $OUT/stamps1.log 2>&1
echo "stamps rc $?" >> $OUT/stamps1.log
tail -30 $OUT/stamps1.log | cut -c1-300
