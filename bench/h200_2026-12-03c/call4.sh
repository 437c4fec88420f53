#!/bin/bash
# Session 29, device call 4: the q prologue's loads issued before the ring's first tiles (MLA_WG_Q_FIRST, with
# MLA_WG_QG 18): timing against the old order, the GPU tests of the default 64-head path
# (the stamps left out: the budget after a failed start).
source bench/h200_2026-12-03c/prelude.sh
timeout 220 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/qfirst.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_Q_FIRST": false}]' > $OUT/bench4.log 2>&1
echo "bench rc $?" >> $OUT/bench4.log
grep -v "^\s*$" $OUT/bench4.log | cut -c1-420 | tail -16
timeout 150 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py \
  -k "(test_gpu and (h64 or h128) and not epilogue and not loads and not mma_sync) or stamps" > $OUT/tests4.log 2>&1
echo "pytest rc $?" >> $OUT/tests4.log
grep -E "passed|failed|Error|rc |^\.+" $OUT/tests4.log | cut -c1-300 | tail -8
