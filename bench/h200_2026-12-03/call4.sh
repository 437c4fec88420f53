#!/bin/bash
# Session 27, device call 4: the combine fused into the MoE down stage (kernels/moe.py FC): its GPU tests (bits
# against the combine launch, K2 shapes), the engine tests that run the MoE with a shared expert on a side branch,
# then the MoE table fused (default) against the combine launch ("unfused").
source bench/h200_2026-12-03/prelude.sh
timeout 260 python -m pytest -m gpu -q -rf -n 14 tests/test_cuda_moe.py tests/test_device_round.py \
  tests/test_backend_sim.py > $OUT/pytest1.log 2>&1
echo "pytest rc $?" >> $OUT/pytest1.log
tail -15 $OUT/pytest1.log | cut -c1-300
timeout 200 python -m tools.bench_kernels --only moe --quick --variants unfused --out $OUT/moe_fused.json \
  > $OUT/bench2.log 2>&1
echo "bench rc $?" >> $OUT/bench2.log
grep -v "^\s*$" $OUT/bench2.log | cut -c1-330 | tail -12
