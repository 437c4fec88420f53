#!/bin/bash
# Session 31, device call 1: bf16 split partials (kernels.mla MLA_PARTIALS) against f32, 64 and 8 heads, decode at
# 4K / 16K / 64K, then the MLA GPU tests of the changed kernels (both split kernels, merges, the refusal).
source bench/h200_2026-12-03d/prelude.sh
timeout 270 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/partials.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64, 8], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_PARTIALS": "f32"}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
grep -v "^\s*$" $OUT/bench1.log | cut -c1-330 | tail -30
timeout 250 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py tests/test_cuda_attention.py \
  -k "(test_gpu and not loads and not mma_sync and not epilogue) or (epilogue and (staged or direct or grid) and not groups_grid)" \
  > $OUT/tests1.log 2>&1
echo "pytest rc $?" >> $OUT/tests1.log
grep -E "passed|failed|Error|rc |FAILED" $OUT/tests1.log | cut -c1-300 | tail -20
