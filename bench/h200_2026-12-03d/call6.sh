#!/bin/bash
# Session 30, device call 6: the MoE GPU tests on the final code (every expert stage launch gained the stamps
# argument), the router/plan/MoE ones of tests/test_cuda_moe.py and the engine's K2-shape op table cases.
source bench/h200_2026-12-03d/prelude.sh
timeout 400 python -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_cuda_moe.py > $OUT/tests6.log 2>&1
echo "pytest rc $?" >> $OUT/tests6.log
grep -E "passed|failed|Error|rc " $OUT/tests6.log | cut -c1-300 | tail -8
