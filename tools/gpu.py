"""The GPU tools' first check: one line on stderr and exit status 2 where the cuda backend cannot run."""
import sys

from numbaengine.backends import gpu_ready


def require_gpu(prog: str):
    """Exit unless CuPy imports and numba sees an NVIDIA GPU (the simulator off): the tool measures that GPU."""
    if not gpu_ready():
        print(f"{prog}: needs an NVIDIA GPU and CuPy (pip install -e '.[cuda13]', or '.[cuda]' for CUDA 12); none is "
              "usable here (on a CPU: python -m numbaengine.run)", file=sys.stderr)
        raise SystemExit(2)
