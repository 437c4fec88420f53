"""Argmax and top-k over the vocabulary, per row: greedy tokens and the drafter's candidate ids.

Order: larger value first; among equal values the lower index first (matches np.argmax and a stable sort).
"""

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from kernels.device import SIM, block_argmax, kernel, launch

BIG = 2 ** 31 - 1
NEG_INF = float32(-np.inf)


def argmax_ref(logits, out):
    """logits f32[n, V] -> out i32[n]."""
    out[:] = np.argmax(logits, axis=-1)
    return out


def topk_ref(logits, k, idx_out, val_out):
    """logits f32[n, V] -> idx_out i32[n, k], val_out f32[n, k], sorted by value (lower index first on ties)."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    idx_out[:] = order
    val_out[:] = np.take_along_axis(logits, order, axis=-1)
    return idx_out, val_out


# ---------------------------------------------------------------------------------------------------- numba.cuda
if SIM:
    def f32_bits(x):
        return np.uint32(np.array([x], np.float32).view(np.uint32)[0])

    def bits_f32(u):
        return np.array([u], np.uint32).view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def f32_bits(x):
        return uint32(libdevice.float_as_int(x))

    @cuda.jit(device=True, inline="always")
    def bits_f32(u):
        return libdevice.int_as_float(int32(u))


@cuda.jit(device=True, inline="always")
def order_key(x, v):
    """Unique uint64 key of (value x, index v): larger key = earlier in this module's order (larger value, then
    lower index); -0.0 and +0.0 rank equal, as in numpy."""
    u = f32_bits(x + float32(0))
    u = ~u if (u & uint32(0x80000000)) != uint32(0) else u | uint32(0x80000000)
    return (uint64(u) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(v))


@cuda.jit(device=True, inline="always")
def key_value(key):
    """The value x of order_key(x, v) (-0.0 comes back as +0.0)."""
    u = uint32(key >> uint64(32))
    return bits_f32(u & uint32(0x7FFFFFFF) if (u & uint32(0x80000000)) != uint32(0) else ~u)


@cuda.jit(device=True, inline="always")
def key_index(key):
    """The index v of order_key(x, v)."""
    return int32(uint32(0xFFFFFFFF) - uint32(key & uint64(0xFFFFFFFF)))


@kernel()
def _argmax_k(logits, out, vocab):
    """One block per row (1024 threads): strided scan, then a block reduction. Moves n*V*4 bytes."""
    row = cuda.blockIdx.x
    bv, bi = NEG_INF, int32(BIG)
    for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        v = logits[row, i]
        if v > bv:
            bv, bi = v, i
    bv, bi = block_argmax(bv, bi)
    if cuda.threadIdx.x == 0:
        out[row] = bi


def argmax(logits, out):
    """GPU argmax_ref."""
    n, vocab = logits.shape
    if out.shape != (n,):
        raise ValueError(f"argmax: out {out.shape} is not [{n}]")
    launch(_argmax_k, n, 1024, logits, out, int32(vocab))
    return out


_TOPK = {}


def _build_topk(K):
    @kernel()
    def topk_k(logits, idx_out, val_out, vocab):
        """One block per row (256 threads): each thread keeps its K best in registers (sorted), then K rounds of a
        block argmax over the threads' heads; the winner shifts its list. Moves n*V*4 bytes."""
        row = cuda.blockIdx.x
        vals = cuda.local.array(K, float32)
        ids = cuda.local.array(K, int32)
        for j in range(K):
            vals[j], ids[j] = NEG_INF, BIG
        for i in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
            cv, ci = logits[row, i], int32(i)
            if cv > vals[K - 1]:
                for j in range(K):
                    if cv > vals[j]:
                        vals[j], cv = cv, vals[j]
                        ids[j], ci = ci, ids[j]
        for r in range(K):
            bv, bi = block_argmax(vals[0], ids[0])
            if cuda.threadIdx.x == 0:
                idx_out[row, r], val_out[row, r] = bi, bv
            if ids[0] == bi:
                for j in range(K - 1):
                    vals[j], ids[j] = vals[j + 1], ids[j + 1]
                vals[K - 1], ids[K - 1] = NEG_INF, BIG
    return topk_k


def topk(logits, k, idx_out, val_out):
    """GPU topk_ref (k <= 64)."""
    n, vocab = logits.shape
    if not 0 < k <= min(64, vocab) or idx_out.shape != (n, k) or val_out.shape != (n, k):
        raise ValueError(f"topk: k={k} (1..64, <= V={vocab}), idx_out {idx_out.shape}, val_out {val_out.shape}")
    if k not in _TOPK:
        _TOPK[k] = _build_topk(k)
    launch(_TOPK[k], n, 256, logits, idx_out, val_out, int32(vocab))
    return idx_out, val_out


