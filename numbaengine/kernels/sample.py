"""Token choice per row: argmax at temperature 0, else Gumbel-max with counter-based noise.

The noise of vocab id v for (seed, seq, pos) is a pure function of those four integers (splitmix64 mixing; ids
2m and 2m + 1 take the two halves of one hash), so it needs no generator state and the GPU computes the same
numbers as reference.uniform. It is keyed by the ABSOLUTE POSITION of the token being chosen: every tree node at
one position shares it, which makes DDTree's committed tokens equal to autoregressive sampling's for the same seed,
and each committed token an exact draw from softmax(logits / T) given its prefix. Temperature and seed are one
pair for all rows, or device arrays per group of rows (the sequences of a batch, each with its own settings).
"""
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from numbaengine.kernels.device import (
    SIM,
    as_f32,
    block_argmax,
    grid_dep,
    ld16,
    shfl_xor,
)
from numbaengine.kernels.launch import kernel, launch
from numbaengine.kernels.topk import key_index, order_key, warp_max_u64

SAMPLE_THREADS = 512            # sample_kernel: one block per row
SPLIT_THREADS = 64 if SIM else 128  # sample_part_kernel: one block per (vocabulary chunk, row)
SAMPLE_CHUNKS = 32              # vocabulary chunks per row at most (columns of the workspace)
SPLIT_BLOCKS = 2048             # the split path aims at about this many blocks (~16 per SM). H200, us per call at
#   T = 1 on 17 / 33 / 65 / 256 rows of 163840: 128 threads and 2048 blocks 17.0 / 25.1 / 43.4 / 139.3; 256 threads
#   and 1024 blocks 18.7 / 27.2 / 43.9 / 138.3
MERGE_ROWS = 4                  # sample_merge_kernel: rows (warps) per block
_G1, _G2, _G3 = uint64(0xBF58476D1CE4E5B9), uint64(0x94D049BB133111EB), uint64(0x9E3779B97F4A7C15)
_POS_SALT = uint64(0x5851F42D)

@cuda.jit(device=True, inline="always")
def mix64_dev(z):
    """splitmix64 finalizer (wrapping uint64 math), the device twin of reference.mix64."""
    z = z + _G3
    z = (z ^ (z >> uint64(30))) * _G1
    z = (z ^ (z >> uint64(27))) * _G2
    return z ^ (z >> uint64(31))


@cuda.jit(device=True, inline="always")
def row_key(seed, seq, pos):
    """The per-(seed, seq, pos) hash that vocab ids are mixed with (uniform's h)."""
    return mix64_dev(seed ^ mix64_dev(uint64(seq) ^ mix64_dev(uint64(pos) + _POS_SALT)))


@cuda.jit(device=True, inline="always")
def _bits23(z, odd):
    """unit's 23 bits k of the pair hash z of ids 2m, 2m + 1: from its high half for the even id (odd = 0), its
    low half for the odd one; the draw is u = (k + 1/2) 2^-23."""
    return int32((uint32(z) if odd else uint32(z >> uint64(32))) >> uint32(9))


SCAN_UNROLL = 4                 # units (4 ids by a 16-byte load, or 2 ids) per thread per step of _scan
_VEC_IDS = 4 * SCAN_UNROLL      # (local array sizes must be plain constants)


@cuda.jit(device=True, inline="always")
def _bound_skips(xt, k, floor):
    """True when id value xt = x / T with the draw u = (k + 1/2) 2^-23 provably stays below `floor` (a value some
    id of the row reaches) whatever its noise: -log(-log u) <= -log(1 - u) (since -log u >= 1 - u), and with
    j = 2^23 - 1 - k, 1 - u = (j + 1/2) 2^-23 >= 2^-(clz(j) - 8), so -log(1 - u) <= (clz(j) - 8) ln 2 (24 ln 2 at
    j = 0): integer work, no log; plus a margin far above the roundings of x / T. Such an id skips the two logs."""
    j = int32(int32(0x7FFFFF) - k)                  # (int32 - int32 is int64 in numba: clz would count 64 bits)
    bound = xt + float32(int32(cuda.clz(j) - 8)) * float32(0.6931472)   # float32(ln 2) > ln 2
    return bound + (abs(xt) + abs(floor)) * float32(1e-6) + float32(1e-3) < floor


@cuda.jit(device=True, inline="always")
def _scan(logits, i, lo, hi, temperature, greedy, hkey, vec):
    """This thread's best (value, index) over its ids of logits[i, lo:hi] (the block steps over the range with
    SCAN_UNROLL units of ids per thread per step, each thread's ids in increasing order: its first hit has the
    lowest index); (-inf, V) if none; lo even. A unit is 4 ids read by one 16-byte load with vec (rows contiguous,
    16-byte aligned, lo and hi multiples of 4), else 2 ids; every load of a step is in flight before any is used.
    Greedy: the largest value. Else x / T + gumbel noise, one noise hash per id pair (2m, 2m + 1) (uniform); ids
    that _bound_skips against the warp's best so far skip the logs, so the winner and its value are those of
    computing every id. Every lane of a warp must call it (warp max inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    bv, bi = float32(-math.inf), int32(logits.shape[1])
    xs = cuda.local.array(_VEC_IDS, float32)          # unit u's ids at xs[4u:4u + W]
    row = int64(i) * logits.shape[1]
    if greedy and vec:
        for base in range(lo, hi, 4 * SCAN_UNROLL * nt):
            for u in range(SCAN_UNROLL):              # every load in flight first
                v = base + 4 * (u * nt + t)
                if v < hi:
                    w0, w1, w2, w3 = ld16(logits, row + v)
                    xs[4 * u], xs[4 * u + 1], xs[4 * u + 2], xs[4 * u + 3] = (
                        as_f32(w0), as_f32(w1), as_f32(w2), as_f32(w3))
            for u in range(SCAN_UNROLL):
                v = base + 4 * (u * nt + t)
                if v < hi:
                    for e in range(4):
                        if xs[4 * u + e] > bv:
                            bv, bi = xs[4 * u + e], int32(v + e)
        return bv, bi
    floor = float32(-math.inf)
    inv_t = float32(1) / temperature
    W = 4 if vec else 2                               # ids per unit
    for base in range(lo, hi, W * SCAN_UNROLL * nt):  # same trip count on every lane
        for u in range(SCAN_UNROLL):                  # every load in flight first
            v = base + W * (u * nt + t)
            if v < hi:
                if vec:
                    w0, w1, w2, w3 = ld16(logits, row + v)
                    xs[4 * u], xs[4 * u + 1], xs[4 * u + 2], xs[4 * u + 3] = (
                        as_f32(w0), as_f32(w1), as_f32(w2), as_f32(w3))
                else:
                    xs[4 * u] = logits[i, v]
                    if v + 1 < hi:
                        xs[4 * u + 1] = logits[i, v + 1]
        for u in range(SCAN_UNROLL):
            for pr in range(2):                       # the unit's id pairs (one without vec)
                v = base + W * (u * nt + t) + 2 * pr  # even: ids v and v + 1 share a hash
                if v >= hi or (pr and not vec):
                    continue
                z = mix64_dev(hkey ^ uint64(v >> 1)) if not greedy else uint64(0)
                for e in range(2):
                    if v + e >= hi:
                        continue
                    x = xs[4 * u + 2 * pr + e]
                    if not greedy:
                        k = _bits23(z, e)
                        if _bound_skips(x * inv_t, k, floor):
                            continue
                        r = (float32(k) + float32(0.5)) * float32(1.1920928955078125e-07)   # u = (k + 1/2) 2^-23
                        x = x / temperature + float32(-math.log(float32(-math.log(r))))
                    if x > bv:
                        bv, bi = x, int32(v + e)
        if not greedy:
            floor = max(floor, bv)
            for off in (16, 8, 4, 2, 1):
                floor = max(floor, shfl_xor(floor, int32(off)))
    return bv, bi


@cuda.jit(device=True, inline="always")
def _setting(temps, seeds, g):
    """(temperature, greedy, seed) of group g from the per-group arrays (a temperature of 1 stands in when greedy)."""
    t = temps[g]
    greedy = t == float32(0)
    return (float32(1) if greedy else t), greedy, seeds[g]


@cuda.jit(device=True, inline="always")
def _skipped(i, group, live):
    """Row i is past the live[i // group] rows its group samples (tree padding, a parked slot's nodes)."""
    g = i // group
    return i - g * group >= live[g]


@kernel()
def sample_kernel(logits, temperature, greedy, seed, seq, pos, vec, out):
    """Block per row, SAMPLE_THREADS threads strided over the vocabulary: argmax of logits (greedy) or of
    logits / temperature + gumbel noise; lowest index wins ties. Bytes: the logits once."""
    grid_dep()
    i, t = cuda.blockIdx.x, cuda.threadIdx.x
    V = logits.shape[1]
    bv, bi = _scan(logits, i, 0, V, temperature, greedy, row_key(seed, seq[i], pos[i]), vec)
    bv, bi = block_argmax(bv, bi)
    if t == 0:
        out[i] = bi if bi < V else int32(0)


@kernel()
def sample_rows_kernel(logits, temps, seeds, group, live, seq, pos, vec, out):
    """sample_kernel with per-group settings: row i samples with temps[i // group] (0: greedy) and
    seeds[i // group] (temps f32[G], seeds u64[G]: a batch whose sequences keep their own settings); only the
    first live[g] rows of group g (i32[G]), the others end at once (their out unchanged). Launch: grid n rows,
    block SAMPLE_THREADS. Bytes: the live rows' logits once."""
    grid_dep()
    i, t = cuda.blockIdx.x, cuda.threadIdx.x
    if _skipped(i, group, live):
        return
    V = logits.shape[1]
    temperature, greedy, seed = _setting(temps, seeds, i // group)
    bv, bi = _scan(logits, i, 0, V, temperature, greedy, row_key(seed, seq[i], pos[i]), vec)
    bv, bi = block_argmax(bv, bi)
    if t == 0:
        out[i] = bi if bi < V else int32(0)


@cuda.jit(device=True, inline="always")
def _chunk(V, c, C):
    """Ids [lo, hi) of vocabulary chunk c of C (chunk widths a multiple of 4: 16-byte loads stay aligned)."""
    width = ((V + C - 1) // C + 3) // 4 * 4
    lo = min(c * width, V)
    return lo, min(lo + width, V)


@kernel(launch_bounds=(SPLIT_THREADS, 8))
def sample_part_kernel(logits, temperature, greedy, seed, seq, pos, vec, best):
    """Block per (vocabulary chunk c, row i), grid (C, n): the chunk's winner as order_key(value, id) in
    best u64[>= n, >= C] (value -inf, id V when the chunk has none). Bytes: the logits once. Capped at 64
    registers (8 blocks per SM; 128 uncapped with the sampled rows' 16-byte loads): H200, us per call at T = 0 /
    T = 1 on 17 / 65 / 256 rows of 163840: capped at 64 (this) 6.7 / 16.8, 14.6 / 43.6, 45.5 / 103.9; uncapped
    8.1 / 21.5, 17.7 / 49.1, 50.8 / 123.3; capped at 80 6.7 / 16.7, 15.4 / 44.5, 49.1 / 105.6; sampled rows on
    4-byte loads 6.3 / 17.3, 13.5 / 41.1, 46.8 / 121.3."""
    grid_dep()
    c, i, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    lo, hi = _chunk(logits.shape[1], c, cuda.gridDim.x)
    bv, bi = _scan(logits, i, lo, hi, temperature, greedy, row_key(seed, seq[i], pos[i]), vec)
    bv, bi = block_argmax(bv, bi)
    if t == 0:
        best[i, c] = order_key(bv, bi)


@kernel(launch_bounds=(SPLIT_THREADS, 8))
def sample_rows_part_kernel(logits, temps, seeds, group, live, seq, pos, vec, best):
    """sample_part_kernel with per-group settings (sample_rows_kernel's temps, seeds, group, live). Launch: grid
    (C chunks, n rows), block SPLIT_THREADS. Bytes: the live rows' logits once."""
    grid_dep()
    c, i, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    if _skipped(i, group, live):
        return
    lo, hi = _chunk(logits.shape[1], c, cuda.gridDim.x)
    temperature, greedy, seed = _setting(temps, seeds, i // group)
    bv, bi = _scan(logits, i, lo, hi, temperature, greedy, row_key(seed, seq[i], pos[i]), vec)
    bv, bi = block_argmax(bv, bi)
    if t == 0:
        best[i, c] = order_key(bv, bi)


@kernel()
def sample_merge_kernel(best, chunks, vocab, out):
    """Warp per row (MERGE_ROWS rows per block): lane c reads best[i, c] (all loads at once; a thread per row
    looping over the chunks took 4.7 us for 17 rows on the H200, its loads in series), a warp max of the keys,
    then out[i] = the winner's id (0 if no chunk had a candidate). Launch: grid ceil(rows / MERGE_ROWS), block
    32*MERGE_ROWS. Moves rows*chunks*8 bytes in, rows*4 out."""
    grid_dep()
    i = cuda.blockIdx.x * MERGE_ROWS + cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    if i < out.shape[0]:                             # the same for the whole warp
        k = warp_max_u64(best[i, lane] if lane < chunks else uint64(0))
        if lane == 0:
            v = key_index(k)
            out[i] = v if v < vocab else int32(0)


def sample_work(zeros, n):
    """Workspace of the split sampler for up to n rows: u64[n, SAMPLE_CHUNKS] chunk winners."""
    return zeros((n, SAMPLE_CHUNKS), np.uint64)


def sample_chunks(n, V):
    """Vocabulary chunks per row of the split sampler: about SPLIT_BLOCKS blocks, >= 4 ids per thread."""
    return max(1, min(SAMPLE_CHUNKS, -(-SPLIT_BLOCKS // max(n, 1)), V // (4 * SPLIT_THREADS)))


def _rows_16b(logits):
    """Rows of logits can be read with 16-byte loads: C-contiguous, V % 4 == 0, 16-byte aligned."""
    from numbaengine.kernels.launch import contiguous, data_ptr
    return logits.shape[1] % 4 == 0 and contiguous(logits) and data_ptr(logits) % 16 == 0


def sample(logits, temperature, seed, seq, pos, out, work=None, live=None):
    """sample_ref on the GPU or the simulator: logits f32[n, V], seq i32[n], pos i32[n] -> out i32[n].
    temperature and seed: numbers for every row, or device arrays temps f32[G] and seeds u64[G] of G groups of
    n / G consecutive rows (row i samples with temps[i // (n / G)], 0 being greedy, and that seed: a batch whose
    sequences keep their own settings) with live i32[G]: only the first live[g] rows of group g are sampled (a
    tree's nodes; the other rows' out is left undefined). work (sample_work, >= n rows): split every row over
    vocabulary chunks (the part kernel, then sample_merge_kernel), for when n rows alone cannot fill the GPU;
    without it, one block per row. Rows are read with 16-byte loads where _rows_16b allows."""
    n, V = logits.shape
    if seq.shape != (n,) or pos.shape != (n,) or out.shape != (n,):
        raise ValueError(f"sample: seq {seq.shape}, pos {pos.shape}, out {out.shape} must be [{n}]")
    if work is not None and (work.shape[0] < n or work.shape[1] != SAMPLE_CHUNKS):
        raise ValueError(f"sample: work {work.shape} is not [>= {n}, {SAMPLE_CHUNKS}] (sample_work)")
    if hasattr(temperature, "shape"):
        G = temperature.shape[0]
        if seed.shape != (G,) or live is None or live.shape != (G,) or G == 0 or n % G:
            raise ValueError(f"sample: temperatures {temperature.shape}, seeds {seed.shape} and live rows "
                             f"{None if live is None else live.shape} must be [G], G dividing the {n} rows")
        args = (logits, temperature, seed, int32(n // G), live, seq, pos, _rows_16b(logits))
        one, part = sample_rows_kernel, sample_rows_part_kernel
    else:
        greedy = temperature == 0
        args = (logits, float32(1 if greedy else temperature), greedy, uint64(seed), seq, pos, _rows_16b(logits))
        one, part = sample_kernel, sample_part_kernel
    if n and work is None:
        launch(one, n, SAMPLE_THREADS, *args, out)
    elif n:
        C = sample_chunks(n, V)
        launch(part, (C, n), SPLIT_THREADS, *args, work)
        launch(sample_merge_kernel, -(-n // MERGE_ROWS), 32 * MERGE_ROWS, work, int32(C), int32(V), out)
    return out
