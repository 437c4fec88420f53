"""SwiGLU activation: out = silu(gate) * up with gate_up = [gate | up] along the last axis."""
import numpy as np


def silu(x):
    return x / (np.float32(1) + np.exp(-x))


def silu_mul_ref(gate_up, out):
    """gate_up f32[n, 2I] -> out f32[n, I]."""
    i = gate_up.shape[-1] // 2
    np.multiply(silu(gate_up[:, :i]), gate_up[:, i:], out=out)
    return out
