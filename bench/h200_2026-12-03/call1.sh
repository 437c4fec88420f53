#!/bin/bash
# Session 27, device call 1: --parallel smoke test; the 64-head MLA split kernel and merge launch timed apart
# (--mla-parts) with and without the PDL trigger after the main loop; the two unmeasured gate_up ring cuts.
source bench/h200_2026-12-03/prelude.sh
timeout 200 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/mla_trig.json \
  --mla-max-batch 16 --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_TRIGGER": true}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
grep -v "^\s*$" $OUT/bench1.log | cut -c1-400 | tail -20
timeout 230 python -m tools.bench_kernels --only moe --quick --variants bulk_s4u1,bulk_s3u2 \
  --out $OUT/moe_rings.json > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
grep -v "^\s*$" $OUT/bench2.log | cut -c1-330 | tail -20
