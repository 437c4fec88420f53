"""MLA's per-head products for the absorbed (latent) form.

W_kv_b viewed [h, nope + v, kv_lora]: W_UK = rows [:nope], W_UV = rows [nope:]. Decode and tree verify
attend in the latent space: q_lat_h = q_nope_h @ W_UK_h, then o_h = o_lat_h @ W_UV_h^T.
"""
import numpy as np

from weights.dtypes import bf16_to_f32


def head_gemm_ref(x, w, out, transpose_w):
    """Per-head GEMM. x f32[n, h, a]; w u16[h, a, b] (transpose_w=False) or u16[h, b, a] (True) -> out f32[n, h, b]."""
    np.einsum("nha,hba->nhb" if transpose_w else "nha,hab->nhb", x, bf16_to_f32(w), out=out)
    return out
