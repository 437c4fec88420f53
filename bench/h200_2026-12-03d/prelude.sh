# Sourced by call*.sh (session 30) on the device: numpy 2.4.1 from .whl/ (the image's numpy breaks numba-cuda), the card's name.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 OPENBLAS_NUM_THREADS=4
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt
