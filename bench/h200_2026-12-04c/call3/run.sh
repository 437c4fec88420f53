#!/bin/bash
# Session 33 call 3: where a wgmma GEMM call's time goes (9 stamp points, SM sharing, the call / x prep / pure read
# chained), then the engine with and without the wgmma path (K2 shapes, 2 layers).
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m tools.gemm_wg_stamps --cases q_kv_a:1,q_kv_a:17,o:1,o:33,shared_gate_up:17,q_b:17,shared_down:17 \
  --out $OUT/stamps.json > $OUT/stamps.log 2>&1
echo "stamps rc $?"; python - $OUT/stamps.json <<'P'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["name"], r["m"], {k: v for k, v in r.items() if k not in ("raw", "cut", "name", "m", "n", "k")
                              and not isinstance(v, dict)})
    print("   ", {k: v["med"] for k, v in r.items() if isinstance(v, dict) and "med" in v})
P
for wg in 1 0; do
  NUMBAENGINE_GEMM_WG=$wg timeout 200 python -m tools.bench --synth-k2 2 --synth-dir /tmp/k2 --modes ar,ddtree \
    --budgets 16 --batches 1 --new-tokens 32 --out $OUT/k2_wg$wg.json > $OUT/k2_wg$wg.log 2>&1
  echo "k2 wg=$wg rc $?"; grep -iE "round|ms|tok" $OUT/k2_wg$wg.log | cut -c1-220 | tail -6
done
