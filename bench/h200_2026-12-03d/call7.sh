#!/bin/bash
# Session 30, device call 7: after the review moved both stamp writers onto kernels.device.stamp_point, the stamps'
# GPU tests (64-head MLA and MoE).
source bench/h200_2026-12-03d/prelude.sh
timeout 230 python -m pytest -m gpu -n 2 -q -p no:cacheprovider tests/test_cuda_mla.py tests/test_cuda_moe.py -k stamps \
  > $OUT/tests7.log 2>&1
echo "pytest rc $?" >> $OUT/tests7.log
grep -E "passed|failed|Error|rc " $OUT/tests7.log | cut -c1-300 | tail -6
