#!/bin/bash
# Session 30, device call 3: the MoE stamps again with L2 flushed by a read (call 2 wrote its flush buffer: the
# write-backs of ~50 MB of dirty lines ran during the stamped stage), default cuts and gate_up on registers.
source bench/h200_2026-12-03d/prelude.sh
timeout 120 python -m tools.moe_stamps --cases 1,4,17 --out $OUT/moe_stamps.json > $OUT/moe_stamps.log 2>&1
echo "stamps rc $?" >> $OUT/moe_stamps.log
timeout 90 python -m tools.moe_stamps --cases 1 --variant '{"tiled": 0}' --out $OUT/moe_stamps_regs.json \
  >> $OUT/moe_stamps.log 2>&1
echo "stamps regs rc $?" >> $OUT/moe_stamps.log
cut -c1-1200 $OUT/moe_stamps.log
