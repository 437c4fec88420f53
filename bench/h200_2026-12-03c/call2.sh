#!/bin/bash
# Session 29, device call 2: the q prologue with more loads in flight (MLA_WG_QG 18: all of a thread's 18 units at
# once; was 3): GPU tests of the default path, the stamps again, then timing against QG 3 and 9.
source bench/h200_2026-12-03c/prelude.sh
timeout 170 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py \
  -k "(test_gpu and not epilogue and not loads and not mma_sync) or stamps" > $OUT/tests2.log 2>&1
echo "pytest rc $?" >> $OUT/tests2.log
grep -E "passed|failed|Error|rc " $OUT/tests2.log | cut -c1-300 | tail -8
timeout 110 python -m tools.mla_stamps --cases 16384:16,65536:4,16384:1,4096:64 \
  --variant '{"MLA_WG_CLUSTER": 0}' --out $OUT/stamps.json > $OUT/stamps2.log 2>&1
echo "stamps rc $?" >> $OUT/stamps2.log
cut -c1-700 $OUT/stamps2.log | tail -6
timeout 280 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/qg.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_QG": 3}, {"MLA_WG_QG": 9}]' > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
grep -v "^\s*$" $OUT/bench2.log | cut -c1-420 | tail -24
