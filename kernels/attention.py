"""Softmax attention with an explicit visibility mask; GQA/MQA when k has fewer heads than q.

One reference serves every attention of the engine: MLA prefill (naive form, hk = h), MLA decode and tree
verify in the absorbed form (MQA over the latent cache: hk = 1, d = kv_lora + rope, v = the c_kv part), and the
DFlash drafter (GQA, no mask).
"""
import numpy as np


def attention_ref(q, k, v, visible, scale, out):
    """q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv], visible bool[n, S] or None -> out f32[n, h, dv]."""
    h, hk = q.shape[1], k.shape[1]
    g = h // hk
    for j in range(hk):
        qj = q[:, j * g:(j + 1) * g]                                   # [n, g, d]
        s = np.einsum("ngd,sd->gns", qj, k[:, j]) * np.float32(scale)  # [g, n, S]
        if visible is not None:
            s = np.where(visible[None], s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[:, j * g:(j + 1) * g] = np.einsum("gns,se->nge", p, v[:, j])
    return out
