"""SwiGLU activation: out = silu(gate) * up with gate_up = [gate | up] along the last axis."""
import math

from numba import cuda, float32, int32

from numbaengine.kernels.device import grid_dep
from numbaengine.kernels.launch import kernel, launch


@kernel()
def _silu_mul_k(gate_up, out, n, inter):
    """Thread per output element. Launch: grid (ceil(I/256), n), block 256. Moves n*I*12 bytes."""
    grid_dep()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y
    if i < inter:
        g = gate_up[row, i]
        out[row, i] = g / (float32(1) + math.exp(-g)) * gate_up[row, inter + i]


def silu_mul(gate_up, out):
    """GPU silu_mul_ref: gate_up f32[n, 2I] -> out f32[n, I]."""
    n, i2 = gate_up.shape
    if i2 % 2 or out.shape != (n, i2 // 2):
        raise ValueError(f"silu_mul: gate_up {gate_up.shape} and out {out.shape} do not fit [n, 2I] -> [n, I]")
    launch(_silu_mul_k, (math.ceil(i2 // 2 / 256), n), 256, gate_up, out, int32(n), int32(i2 // 2))
    return out
