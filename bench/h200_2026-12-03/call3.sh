#!/bin/bash
# Session 27, device call 3: the grid merge (cooperative launch) against a plain launch of the same kernel, and
# the merge launch (default), up to 64 partials (16K x 16: 8 splits; 64K x 4: 33).
source bench/h200_2026-12-03/prelude.sh
timeout 300 python -m tools.bench_attention --only mla --parallel --mla-parts --out $OUT/mla_grid.json \
  --mla-max-batch 16 --mla-shapes '{"ctx": [16384, 65536], "heads": [64], "queries": [1]}' \
  --mla-variant '[{}, {"MLA_WG_GRID": 64}, {"MLA_WG_GRID": 64, "MLA_WG_GRID_COOP": false}]' > $OUT/bench1.log 2>&1
echo "bench rc $?" >> $OUT/bench1.log
tail -3 $OUT/bench1.log | cut -c1-300
python3 - $OUT/mla_grid.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["attention"]["mla"]:
    print(r["variant"], r["ctx"], r["batch"], r["splits"], "cl", r["cluster"], r["us"], r["pct_copy"],
          r.get("split_us"), r.get("merge_us"), "grid", r["grid"])
PY
