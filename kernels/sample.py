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
