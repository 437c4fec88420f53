#!/bin/bash
# Session 33 call 4: the stamps again (call 3's read chain was captured with a numba array made inside the capture),
# then the K2 engine's AR step with the wgmma path (call 3 ran out of time on it; its NUMBAENGINE_GEMM_WG=0 run gave
# AR 1.229 ms GPU).
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m tools.gemm_wg_stamps --cases q_kv_a:1,q_kv_a:17,o:1,o:33,shared_gate_up:17,q_b:17,shared_down:17 \
  --out $OUT/stamps.json > $OUT/stamps.log 2>&1
echo "stamps rc $?"; tail -3 $OUT/stamps.log | cut -c1-300; python - $OUT/stamps.json <<'P'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["name"], r["m"], {k: v for k, v in r.items() if k not in ("raw", "cut", "name", "m", "n", "k")
                              and not isinstance(v, dict)})
    print("   ", {k: v["med"] for k, v in r.items() if isinstance(v, dict) and "med" in v})
P
NUMBAENGINE_GEMM_WG=1 timeout 330 python -m tools.bench --synth-k2 2 --synth-dir /tmp/k2 --modes ar \
  --budgets 16 --batches 1 --new-tokens 32 --out $OUT/k2_wg1.json > $OUT/k2_wg1.log 2>&1
echo "k2 wg=1 rc $?"; grep -iE "round|loaded|written" $OUT/k2_wg1.log | cut -c1-260 | tail -4
