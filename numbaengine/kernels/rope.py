"""Rotary position embedding at the frequencies of reference.rope_inv_freq (YaRN included).

Two layouts of the rotated dims: `interleaved` = adjacent pairs (2i, 2i+1) share inv_freq[i] (DeepSeek / K2
checkpoints, GPT-J style); otherwise rotate-half: (i, i + d/2) share inv_freq[i] (Qwen3, the DFlash drafter).
"""
import math

from numba import cuda, float32, int32

from numbaengine.kernels.device import SIM, bf16_f32, grid_dep, lane_id, warp_sum
from numbaengine.kernels.launch import kernel, launch

_KERNELS = {}


def _build(interleaved):
    @kernel()
    def rope_k(x, pos, inv_freq, out, attn_factor, n, nh, half):
        """Thread per rotated pair (token, head, i). Launch: grid ceil(n*h*d/2/256), block 256; out may alias x.
        Moves n*h*d*4 bytes in and out."""
        grid_dep()
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if idx >= n * nh * half:
            return
        tok, rem = idx // (nh * half), idx % (nh * half)
        h, i = rem // half, rem % half
        ang = float32(pos[tok]) * inv_freq[i]
        c, s = math.cos(ang) * attn_factor, math.sin(ang) * attn_factor
        ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        a, b = x[tok, h, ia], x[tok, h, ib]
        out[tok, h, ia] = a * c - b * s
        out[tok, h, ib] = b * c + a * s
    return rope_k


def rope(x, pos, inv_freq, out, *, interleaved, attn_factor=1.0):
    """GPU rope_ref: x f32[n, h, d] (any strides, e.g. the rope part of q), pos i32[n] -> out (may alias x)."""
    n, nh, d = x.shape
    if d % 2 or inv_freq.shape != (d // 2,) or out.shape != x.shape or pos.shape != (n,):
        raise ValueError(f"rope: x {x.shape}, pos {pos.shape}, inv_freq {inv_freq.shape}, out {out.shape}")
    key = bool(interleaved)
    if key not in _KERNELS:
        _KERNELS[key] = _build(key)
    launch(_KERNELS[key], max(1, math.ceil(n * nh * d / 2 / 256)), 256, x, pos, inv_freq, out, float32(attn_factor),
           int32(n), int32(nh), int32(d // 2))
    return out


def _build_qk(interleaved):
    @kernel()
    def qk_norm_rope_k(qk, nq, q_w, k_w, eps, pos, inv_freq, q_out, k_out, half):
        """One block per token, a warp per head (looping when heads outnumber warps), lanes over rotated pairs:
        sum of squares -> 1/rms -> weight -> rotation. Moves n*(nq+nk)*d*4 bytes in and out."""
        grid_dep()
        tok, lane = cuda.blockIdx.x, lane_id()
        d = 2 * half
        for h in range(cuda.threadIdx.x // 32, qk.shape[1], cuda.blockDim.x // 32):
            ss = float32(0)
            for i in range(lane, half, 32):
                ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                a, b = qk[tok, h, ia], qk[tok, h, ib]
                ss += a * a + b * b
            den = math.sqrt(warp_sum(ss) / float32(d) + eps)
            for i in range(lane, half, 32):
                ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                if h < nq:
                    a, b = qk[tok, h, ia] / den * bf16_f32(q_w[ia]), qk[tok, h, ib] / den * bf16_f32(q_w[ib])
                else:
                    a, b = qk[tok, h, ia] / den * bf16_f32(k_w[ia]), qk[tok, h, ib] / den * bf16_f32(k_w[ib])
                ang = float32(pos[tok]) * inv_freq[i]
                c, s = math.cos(ang), math.sin(ang)
                if h < nq:
                    q_out[tok, h, ia] = a * c - b * s
                    q_out[tok, h, ib] = b * c + a * s
                else:
                    k_out[tok, h - nq, ia] = a * c - b * s
                    k_out[tok, h - nq, ib] = b * c + a * s
    return qk_norm_rope_k


def qk_norm_rope(qk, nq, q_w, k_w, eps, pos, inv_freq, q_out, k_out, *, interleaved):
    """GPU qk_norm_rope_ref in one launch (not two norms and two ropes): qk f32[n, nq + nk, d] (any strides, e.g.
    the q|k heads of a stacked q|k|v projection) -> q_out f32[n, nq, d], k_out f32[n, nk, d] (q_out may be None
    when nq is 0). Launch: grid n, block a warp per head (<= 8 warps; one under the simulator)."""
    n, heads, d = qk.shape
    nk = heads - nq
    bad = (n == 0 or d % 2 or tuple(pos.shape) != (n,) or tuple(inv_freq.shape) != (d // 2,)
           or tuple(q_w.shape) != (d,) or tuple(k_w.shape) != (d,) or tuple(k_out.shape) != (n, nk, d)
           or (nq and (q_out is None or tuple(q_out.shape) != (n, nq, d))))
    if bad:
        raise ValueError(f"qk_norm_rope: qk {qk.shape} with {nq} query heads, pos {pos.shape}, inv_freq "
                         f"{inv_freq.shape}, norms {q_w.shape}/{k_w.shape}, outputs "
                         f"{None if q_out is None else q_out.shape}/{k_out.shape}")
    q_out = k_out if q_out is None else q_out          # nq == 0: a placeholder the kernel never writes
    key = ("qk", bool(interleaved))
    if key not in _KERNELS:
        _KERNELS[key] = _build_qk(key[1])
    warps = 1 if SIM else min(heads, 8)
    launch(_KERNELS[key], n, 32 * warps, qk, int32(nq), q_w, k_w, float32(eps), pos, inv_freq, q_out, k_out,
           int32(d // 2))
    return q_out, k_out
