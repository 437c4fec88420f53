#!/bin/bash
# Session 33 call 2: GPU tests of gemm_wg with the fold's loads first (new default); stamps with the tensor map
# fence on / prefetch / off; the knobs wg_tmap0, wg_tmapp, wg_fold0, wg_tail, wg_tail0 against the default; the MLA
# cluster-group cases left unverified since session 31.
source bench/h200_2026-12-03d/prelude.sh
timeout 150 python -m pytest -m gpu -n 8 -v -p no:cacheprovider tests/test_cuda_gemm_wg.py > $OUT/tests_wg.log 2>&1
echo "pytest rc $?" >> $OUT/tests_wg.log
grep -c " PASSED" $OUT/tests_wg.log; grep -E "FAILED|ERROR|passed|failed|rc " $OUT/tests_wg.log | cut -c1-300 | tail -12
for t in acquire none prefetch; do
  timeout 80 python -m tools.gemm_wg_stamps --set WG_TMAP=$t --out $OUT/stamps_$t.json > $OUT/stamps_$t.log 2>&1
  echo "stamps $t rc $?"; python - $OUT/stamps_$t.json <<'P'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["name"], r["m"], r["call_us"], {k: r[k]["med"] for k in ("ring issue", "first stage wait", "main loop",
          "partial tile + barrier", "reduce + store")}, r["span us"])
P
done
timeout 200 python -m tools.bench_kernels --only gemm --gemm-shapes q_kv_a,o,shared_gate_up,q_b \
  --variants wg_tmap0,wg_tmapp,wg_fold0,wg_tail,wg_tail0 --out $OUT/gemm.json > $OUT/bench.log 2>&1
echo "bench rc $?" >> $OUT/bench.log
grep -E "best|copy|rc " $OUT/bench.log | cut -c1-200 | tail -8
timeout 120 python -m pytest -m gpu -v -p no:cacheprovider tests/test_cuda_mla.py -k "split66-groups or split33-groups" \
  > $OUT/tests_mla_groups.log 2>&1; echo "mla groups rc $?" >> $OUT/tests_mla_groups.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " $OUT/tests_mla_groups.log | cut -c1-200 | tail -6
