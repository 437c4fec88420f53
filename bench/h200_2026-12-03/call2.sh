#!/bin/bash
# Session 27, device call 2: merge launch shapes (fewer, wider blocks; all of a thread's splits in one load round)
# and the clusters-of-2 variant, the split kernel and the merge timed apart (--mla-parts).
source bench/h200_2026-12-03/prelude.sh
timeout 300 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/mla_merge.json \
  --mla-max-batch 16 --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MERGE_COLS": 128}, {"MERGE_COLS": 64}, {"MLA_WG_CLUSTER_GROUPS": true},
  {"MERGE_SPLITS": 8, "MERGE_WAVE_THREADS": 135168},
  {"MERGE_COLS": 128, "MERGE_SPLITS": 8, "MERGE_WAVE_THREADS": 135168}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
tail -3 $OUT/bench1.log | cut -c1-300
python3 - $OUT/mla_merge.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["attention"]["mla"]:
    print(r["variant"], r["ctx"], r["batch"], r["splits"], "cl", r["cluster"], r["us"], r["pct_copy"],
          r.get("split_us"), r.get("merge_us"))
PY
