#!/bin/bash
# Session 30, device call 2: issue 6's final code timed once more (a third H200), then issue 5: the MoE stages'
# block timelines (tools/moe_stamps.py) at n = 1 / 4 / 17, their GPU test, and the MoE table for the same machine.
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/mla.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}]' > $OUT/mla.log 2>&1
echo "bench rc $?" >> $OUT/mla.log
grep "batch': [0-9][0-9]\|copy\|rc " $OUT/mla.log | cut -c1-300
timeout 150 python -m tools.moe_stamps --cases 1,4,17 --out $OUT/moe_stamps.json > $OUT/moe_stamps.log 2>&1
echo "stamps rc $?" >> $OUT/moe_stamps.log
tail -8 $OUT/moe_stamps.log | cut -c1-1500
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda_moe.py -k stamps > $OUT/tests2.log 2>&1
echo "pytest rc $?" >> $OUT/tests2.log
grep -E "passed|failed|Error|rc " $OUT/tests2.log | cut -c1-300 | tail -5
timeout 150 python -m tools.bench_kernels --only moe --quick --out $OUT/moe.json > $OUT/moe.log 2>&1
echo "moe rc $?" >> $OUT/moe.log
grep "moe \|copy\|rc " $OUT/moe.log | cut -c1-400 | tail -12
