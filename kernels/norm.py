"""RMSNorm, alone and fused with the residual add.

out = x / sqrt(mean(x^2) + eps) * w, float32 math, w stored as bf16 bits.
"""
import numpy as np

from weights.dtypes import bf16_to_f32


def rmsnorm_ref(x, w, eps, out):
    """x f32[n, d], w u16[d] (bf16 bits) -> out f32[n, d]."""
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    np.multiply(x / np.sqrt(var + np.float32(eps)), bf16_to_f32(w), out=out)
    return out


def add_rmsnorm_ref(x, residual, w, eps, out):
    """residual += x (in place), then out = rmsnorm(residual): the pre-norm block boundary."""
    residual += x
    return rmsnorm_ref(residual, w, eps, out)
