"""Token choice per row: argmax at temperature 0, else Gumbel-max with counter-based noise.

The noise of vocab id v for (seed, seq, pos) is a pure function of those four integers (splitmix64 mixing),
so it needs no generator state and the GPU computes the same numbers. It is keyed by the ABSOLUTE POSITION
of the token being chosen: every tree node at one position shares it, which makes DDTree's committed
tokens equal to autoregressive sampling's for the same seed, and each committed token an exact draw
from softmax(logits / T) given its prefix.
"""
import numpy as np

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    z = z + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniform(seed, seq, pos, vocab):
    """u f32[vocab] in (0, 1) with 24 random bits, for one (seed, seq, pos)."""
    with np.errstate(over="ignore"):
        h = mix64(np.uint64(seed) ^ mix64(np.uint64(seq) ^ mix64(np.uint64(pos) + np.uint64(0x5851F42D))))
        z = mix64(h ^ np.arange(vocab, dtype=np.uint64))
    return ((z >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)


def gumbel(seed, seq, pos, vocab):
    return -np.log(-np.log(uniform(seed, seq, pos, vocab)))


def sample_ref(logits, temperature, seed, seq, pos, out):
    """logits f32[n, V], seq i32[n], pos i32[n] -> out i32[n]. Lowest index wins exact ties."""
    if temperature == 0:
        out[:] = np.argmax(logits, axis=-1)
        return out
    for i in range(logits.shape[0]):
        g = gumbel(seed, int(seq[i]), int(pos[i]), logits.shape[1])
        out[i] = np.argmax(logits[i] / np.float32(temperature) + g)
    return out


# --- numba.cuda kernel: the same noise with uint64 math on the device ----------------------------------------------

import math  # noqa: E402

from numba import cuda, float32, int32, uint64  # noqa: E402

from kernels.device import current_stream  # noqa: E402

SAMPLE_THREADS = 512
_G1, _G2, _G3 = uint64(0xBF58476D1CE4E5B9), uint64(0x94D049BB133111EB), uint64(0x9E3779B97F4A7C15)
_POS_SALT = uint64(0x5851F42D)


@cuda.jit(device=True, inline="always")
def mix64_dev(z):
    """splitmix64 finalizer (wrapping uint64 math), the device twin of mix64."""
    z = z + _G3
    z = (z ^ (z >> uint64(30))) * _G1
    z = (z ^ (z >> uint64(27))) * _G2
    return z ^ (z >> uint64(31))


@cuda.jit(device=True, inline="always")
def row_key(seed, seq, pos):
    """The per-(seed, seq, pos) hash that vocab ids are mixed with (uniform's h)."""
    return mix64_dev(seed ^ mix64_dev(uint64(seq) ^ mix64_dev(uint64(pos) + _POS_SALT)))


@cuda.jit(device=True, inline="always")
def gumbel_dev(hkey, v):
    """-log(-log(u)) with u = uniform's 24-bit draw for vocab id v."""
    z = mix64_dev(hkey ^ uint64(v))
    u = (float32(z >> uint64(40)) + float32(0.5)) * float32(5.9604644775390625e-08)
    return float32(-math.log(float32(-math.log(u))))


@cuda.jit
def sample_kernel(logits, temperature, greedy, seed, seq, pos, out):
    """Block per row, SAMPLE_THREADS threads strided over the vocabulary: argmax of logits (greedy) or of
    logits / temperature + gumbel noise; lowest index wins ties. Bytes: the logits once."""
    i, t = cuda.blockIdx.x, cuda.threadIdx.x
    V = logits.shape[1]
    best_v = cuda.shared.array(SAMPLE_THREADS, float32)
    best_i = cuda.shared.array(SAMPLE_THREADS, int32)
    hkey = row_key(seed, seq[i], pos[i])
    bv, bi = float32(-math.inf), int32(V)
    for v in range(t, V, SAMPLE_THREADS):
        x = logits[i, v]
        if not greedy:
            x = x / temperature + gumbel_dev(hkey, v)
        if x > bv:                 # strided: the first hit per thread has the lowest index
            bv, bi = x, int32(v)
    best_v[t], best_i[t] = bv, bi
    step = SAMPLE_THREADS // 2
    while step > 0:
        cuda.syncthreads()
        if t < step:
            ov, oi = best_v[t + step], best_i[t + step]
            if ov > best_v[t] or (ov == best_v[t] and oi < best_i[t]):
                best_v[t], best_i[t] = ov, oi
        step //= 2
    if t == 0:
        out[i] = best_i[0] if best_i[0] < V else int32(0)


def sample(logits, temperature, seed, seq, pos, out):
    """sample_ref on the GPU or the simulator: logits f32[n, V], seq i32[n], pos i32[n] -> out i32[n]."""
    n = logits.shape[0]
    if seq.shape != (n,) or pos.shape != (n,) or out.shape != (n,):
        raise ValueError(f"sample: seq {seq.shape}, pos {pos.shape}, out {out.shape} must be [{n}]")
    greedy = temperature == 0
    if n:
        sample_kernel[n, SAMPLE_THREADS, current_stream()](logits, float32(1 if greedy else temperature), greedy,
                                                           uint64(seed), seq, pos, out)
    return out
