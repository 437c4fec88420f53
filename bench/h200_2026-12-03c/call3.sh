#!/bin/bash
# Session 29, device call 3: the whole ring (4 tiles) issued before the q prologue (MLA_WG_PRELOAD 4; was 3), with
# MLA_WG_QG 18: GPU tests of the default path, the stamps, then timing against PRELOAD 3.
source bench/h200_2026-12-03c/prelude.sh
timeout 170 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py \
  -k "(test_gpu and not epilogue and not loads and not mma_sync) or stamps" > $OUT/tests3.log 2>&1
echo "pytest rc $?" >> $OUT/tests3.log
grep -E "passed|failed|Error|rc " $OUT/tests3.log | cut -c1-300 | tail -8
timeout 90 python -m tools.mla_stamps --cases 16384:16,4096:64 \
  --variant '{"MLA_WG_CLUSTER": 0}' --out $OUT/stamps.json > $OUT/stamps3.log 2>&1
echo "stamps rc $?" >> $OUT/stamps3.log
cut -c1-700 $OUT/stamps3.log | tail -4
timeout 250 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/pre.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_PRELOAD": 3}]' > $OUT/bench3.log 2>&1
echo "bench rc $?" >> $OUT/bench3.log
grep -v "^\s*$" $OUT/bench3.log | cut -c1-420 | tail -16
