#!/bin/bash
# Session 26, device call 3: the grid merge against the merge launch (wave rule) for a 17-query tree at batch 1.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 OPENBLAS_NUM_THREADS=4
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt
timeout 140 python -m tools.bench_attention --only mla --mla-max-batch 1 \
  --mla-shapes '{"ctx": [4096, 16384], "heads": [64], "queries": [17]}' \
  --mla-variant '[{"MLA_WG_GRID": 0}, {}]' --out $OUT/mla_tree17_grid.json > $OUT/bench4.log 2>&1
echo "bench rc $?" >> $OUT/bench4.log
grep -v "^\s*$" $OUT/bench4.log | cut -c1-330
