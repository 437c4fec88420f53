#!/bin/bash
# Session 31, device call 2 (a fresh machine): the 64-head decode with bf16 partials (the default, "auto") against
# f32 again, then the MLA GPU tests call 1 left out (load paths, mma.sync path, cluster epilogues) and the engine's
# GPU tests (cuda backend vs numpy incl. the 64-head "wide64" pair, device rounds: graph replay == eager).
source bench/h200_2026-12-03d/prelude.sh
timeout 170 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/partials.json \
  --mla-max-batch 64 --mla-shapes '{"ctx": [4096, 16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_PARTIALS": "f32"}]' > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
grep "batch': [0-9][0-9]\|copy\|rc " $OUT/bench2.log | cut -c1-330
timeout 190 python -m pytest -m gpu -n 14 -q -p no:cacheprovider tests/test_cuda_mla.py \
  -k "loads or mma_sync or (epilogue and (cluster or groups))" > $OUT/tests2a.log 2>&1
echo "pytest rc $?" >> $OUT/tests2a.log
grep -E "passed|failed|Error|rc |FAILED" $OUT/tests2a.log | cut -c1-300 | tail -12
timeout 190 python -m pytest -m gpu -n 6 -q -p no:cacheprovider tests/test_backend_sim.py tests/test_device_round.py \
  > $OUT/tests2b.log 2>&1
echo "pytest rc $?" >> $OUT/tests2b.log
grep -E "passed|failed|Error|rc |FAILED" $OUT/tests2b.log | cut -c1-300 | tail -12
