"""Dense GEMM on bf16 weights: out = x @ W^T, W stored [n, k] as bf16 bits (the checkpoint layout)."""
import numpy as np

from weights.dtypes import bf16_to_f32


def gemm_ref(x, w, out):
    """x f32[m, k], w u16[n, k] -> out f32[m, n]."""
    np.matmul(x, bf16_to_f32(w).T, out=out)
    return out
