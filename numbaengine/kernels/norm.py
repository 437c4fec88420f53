"""RMSNorm, alone and fused with the residual add.

out = x / sqrt(mean(x^2) + eps) * w, float32 math, w stored as bf16 bits.
"""
import math

from numba import cuda, float32, int32

from numbaengine.kernels.device import SIM, bf16_f32, block_sum, grid_dep
from numbaengine.kernels.launch import kernel, launch

NORM_THREADS = 32 if SIM else 256    # the simulator runs a Python thread per CUDA thread: one warp is enough there

_KERNELS = {}


def _build(add):
    @kernel()
    def norm_k(x, res, w, eps, out, d, res_out, keep):
        """One block per row (NORM_THREADS threads): [residual += x; (keep) res_out = residual;]
        out = v / sqrt(mean(v^2) + eps) * w. Moves n*d*4 bytes in and out (twice that with the residual, +n*d*4
        with res_out)."""
        grid_dep()
        row = cuda.blockIdx.x
        ss = float32(0)
        for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
            v = x[row, i]
            if add:
                v += res[row, i]
                res[row, i] = v
                if keep:
                    res_out[row, i] = v
            ss += v * v
        den = math.sqrt(block_sum(ss) / float32(d) + eps)
        for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
            v = res[row, i] if add else x[row, i]
            out[row, i] = v / den * bf16_f32(w[i])
    return norm_k


def _kernel(add):
    if add not in _KERNELS:
        _KERNELS[add] = _build(add)
    return _KERNELS[add]


def rmsnorm(x, w, eps, out):
    """GPU rmsnorm_ref: x f32[n, d] (any row stride; may alias out), w u16[d] -> out f32[n, d]."""
    n, d = x.shape
    if w.shape != (d,) or out.shape != (n, d):
        raise ValueError(f"rmsnorm: x {x.shape}, w {w.shape}, out {out.shape} do not match")
    launch(_kernel(False), n, NORM_THREADS, x, x, w, float32(eps), out, int32(d), x, int32(0))
    return out


def add_rmsnorm(x, residual, w, eps, out, res_out=None):
    """GPU add_rmsnorm_ref: residual += x (in place), [res_out = residual,] then out = rmsnorm(residual)."""
    n, d = x.shape
    if (residual.shape != (n, d) or w.shape != (d,) or out.shape != (n, d)
            or (res_out is not None and res_out.shape != (n, d))):
        raise ValueError(f"add_rmsnorm: x {x.shape}, residual {residual.shape}, w {w.shape}, out {out.shape}, "
                         f"res_out {None if res_out is None else res_out.shape}")
    launch(_kernel(True), n, NORM_THREADS, x, residual, w, float32(eps), out, int32(d),
           residual if res_out is None else res_out, int32(res_out is not None))
    return out
