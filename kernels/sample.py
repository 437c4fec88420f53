"""Token choice per row: argmax at temperature 0, else Gumbel-max with counter-based noise.

The noise of vocab id v for (seed, seq, pos) is a pure function of those four integers (splitmix64 mixing; ids
2m and 2m + 1 take the two halves of one hash), so it needs no generator state and the GPU computes the same
numbers. It is keyed by the ABSOLUTE POSITION of the token being chosen: every tree node at one position shares
it, which makes DDTree's committed tokens equal to autoregressive sampling's for the same seed, and each committed
token an exact draw from softmax(logits / T) given its prefix.
"""
import numpy as np

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    z = z + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def bits23(z, odd=0):
    """Hashes z u64[...] -> their 23-bit draws k: bits 63-41 where odd is 0, 31-9 where it is 1."""
    half = np.where(np.asarray(odd) != 0, z & np.uint64(0xFFFFFFFF), z >> np.uint64(32))
    return half >> np.uint64(9)


def unit(z, odd=0):
    """Hashes z u64[...] -> u f32 = (k + 1/2) 2^-23 from their draws k (bits23): exact in float32, so 0 < u < 1.
    (With 24 bits, k = 2^24 - 1 rounded up to u = 1.0, an infinite Gumbel: that id won whatever its logit, in about
    1% of the rows of a 163840-id vocabulary.)"""
    return (bits23(z, odd).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def pair_hashes(seed, seq, pos, vocab):
    """(z u64[vocab], odd u64[vocab]) for one (seed, seq, pos): ids 2m and 2m + 1 share the hash mix64(h ^ m) and
    take disjoint halves of it (odd = id & 1), one hash per two ids."""
    with np.errstate(over="ignore"):
        h = mix64(np.uint64(seed) ^ mix64(np.uint64(seq) ^ mix64(np.uint64(pos) + np.uint64(0x5851F42D))))
        v = np.arange(vocab, dtype=np.uint64)
        return mix64(h ^ (v >> np.uint64(1))), v & np.uint64(1)


def uniform(seed, seq, pos, vocab):
    """u f32[vocab] in (0, 1) for one (seed, seq, pos) (pair_hashes, unit)."""
    return unit(*pair_hashes(seed, seq, pos, vocab))


NOISE_GROUP = 64        # ids per noise-bound group (32 hash pairs): noise_bound_ref / noise_bound_kernel
NOISE_BOUNDS = False    # the tree round samples with per-(seq, pos) noise bounds (kernels.tree); not timed on a GPU yet


def noise_groups(vocab):
    return -(-vocab // NOISE_GROUP)


def noise_bound_ref(seed, seq, pos, vocab):
    """f32[noise_groups(vocab)]: per group of NOISE_GROUP ids, an upper bound on the largest Gumbel noise of its ids
    under (seed, seq, pos): (clz(2^23 - 1 - k) - 8) ln 2 for the group's largest draw k (see _noise_bound)."""
    k = np.zeros(noise_groups(vocab) * NOISE_GROUP, np.int64)
    k[:vocab] = bits23(*pair_hashes(seed, seq, pos, vocab))
    j = 2 ** 23 - 1 - k.reshape(-1, NOISE_GROUP).max(axis=1)
    clz = 32 - np.frexp(j.astype(np.float64))[1]              # frexp's exponent is j's bit length (0 for j = 0)
    return ((clz - 8).astype(np.float32) * np.float32(0.6931472)).astype(np.float32)


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


# --- numba.cuda kernels: the same noise with uint64 math on the device -------------------------------------------

import math  # noqa: E402

from numba import cuda, float32, int32, int64, uint32, uint64  # noqa: E402

from kernels.attention import shfl_xor  # noqa: E402
from kernels.device import SIM, as_f32, block_argmax, launch, ld16  # noqa: E402
from kernels.topk import key_index, order_key, warp_max_u64  # noqa: E402

SAMPLE_THREADS = 512            # sample_kernel: one block per row
# H200 (.whl A/B in session 13, bench/h200_2026-11-30g/sample_ab.txt), us per call at T = 1 for 17 / 33 / 65 / 256
# rows of 163840: 256 threads and 1024 blocks 18.7 / 27.2 / 43.9 / 138.3; 128 and 2048 17.0 / 25.1 / 43.4 / 139.3
SPLIT_THREADS = 64 if SIM else 128  # sample_part_kernel: one block per (vocabulary chunk, row)
SAMPLE_CHUNKS = 32              # vocabulary chunks per row at most (columns of the workspace)
SPLIT_BLOCKS = 2048             # the split path aims at about this many blocks (~16 per SM)
MERGE_ROWS = 4                  # sample_merge_kernel: rows (warps) per block
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
def _bits23(z, odd):
    """unit's 23 bits k of the pair hash z of ids 2m, 2m + 1: from its high half for the even id (odd = 0), its
    low half for the odd one; the draw is u = (k + 1/2) 2^-23."""
    return int32((uint32(z) if odd else uint32(z >> uint64(32))) >> uint32(9))


SCAN_UNROLL = 4                 # ids (greedy, 16-byte loads: 4 ids each) or id pairs per thread per step of _scan
_VEC_IDS = 4 * SCAN_UNROLL      # (local array sizes must be plain constants)
_PAIR_IDS = 2 * SCAN_UNROLL


@cuda.jit(device=True, inline="always")
def _noise_bound(k):
    """Upper bound on the Gumbel noise -log(-log u) of the draw u = (k + 1/2) 2^-23: -log(-log u) <= -log(1 - u)
    (since -log u >= 1 - u), and with j = 2^23 - 1 - k, 1 - u = (j + 1/2) 2^-23 >= 2^-(clz(j) - 8), so
    -log(1 - u) <= (clz(j) - 8) ln 2 (24 ln 2 at j = 0): integer work, no log; increasing in k."""
    j = int32(int32(0x7FFFFF) - k)                  # (int32 - int32 is int64 in numba: clz would count 64 bits)
    return float32(int32(cuda.clz(j) - 8)) * float32(0.6931472)   # float32(ln 2) > ln 2


@cuda.jit(device=True, inline="always")
def _stays_below(xt, bound, floor):
    """xt + noise <= xt + bound provably stays below `floor` (a value some id of the row reaches), with a margin far
    above the roundings of x / T."""
    return xt + bound + (abs(xt) + abs(floor)) * float32(1e-6) + float32(1e-3) < floor


@cuda.jit(device=True, inline="always")
def _bound_skips(xt, k, floor):
    """True when id value xt = x / T with the draw k provably stays below `floor` whatever its noise: such an id
    skips the two logs."""
    return _stays_below(xt, _noise_bound(k), floor)


@cuda.jit
def noise_bound_kernel(seed, key_seq, key_pos, vocab, bnd):
    """Thread per (id group g, noise key q), grid (ceil(groups / 256), keys), block 256: bnd[q, g] = the noise bound
    of the largest draw among ids [64g, 64g + 64) under (seed, key_seq[q], key_pos[q]) (noise_bound_ref): 32 pair
    hashes per thread. Moves only bnd (4 bytes per group and key)."""
    g, q = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, cuda.blockIdx.y
    if g >= bnd.shape[1]:
        return
    h = row_key(seed, key_seq[q], key_pos[q])
    kmax = int32(0)
    for p in range(NOISE_GROUP // 2):
        v = g * NOISE_GROUP + 2 * p
        if v < vocab:
            z = mix64_dev(h ^ uint64(v >> 1))
            kmax = max(kmax, _bits23(z, 0))
            if v + 1 < vocab:
                kmax = max(kmax, _bits23(z, 1))
    bnd[q, g] = _noise_bound(kmax)


@cuda.jit(device=True, inline="always")
def _scan(logits, i, lo, hi, temperature, greedy, hkey, vec, bnd, kr):
    """This thread's best (value, index) over its ids of logits[i, lo:hi] (the block steps over the range with
    SCAN_UNROLL ids per thread per step, each thread's ids in increasing order: its first hit has the lowest
    index); (-inf, V) if none; lo even. Greedy with vec (rows contiguous, 16-byte aligned, lo and hi multiples of
    4): SCAN_UNROLL 16-byte loads per step, 4 ids each. Else SCAN_UNROLL id pairs (2m, 2m + 1) per step, one noise
    hash per pair (uniform); ids that _bound_skips against the warp's best so far skip the logs, so the winner and
    its value are those of computing every id. With kr >= 0 (row kr of a noise_bound_kernel table bnd for this
    row's noise key), a pair whose two ids stay below that best under their group's bound skips the hash too.
    Every lane of a warp must call it (warp max inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    bv, bi = float32(-math.inf), int32(logits.shape[1])
    if greedy and vec:
        xs4 = cuda.local.array(_VEC_IDS, float32)
        row = int64(i) * logits.shape[1]
        for base in range(lo, hi, 4 * SCAN_UNROLL * nt):
            for u in range(SCAN_UNROLL):              # every load in flight first
                v = base + 4 * (u * nt + t)
                if v < hi:
                    w0, w1, w2, w3 = ld16(logits, row + v)
                    xs4[4 * u], xs4[4 * u + 1], xs4[4 * u + 2], xs4[4 * u + 3] = (
                        as_f32(w0), as_f32(w1), as_f32(w2), as_f32(w3))
            for u in range(SCAN_UNROLL):
                v = base + 4 * (u * nt + t)
                if v < hi:
                    for e in range(4):
                        if xs4[4 * u + e] > bv:
                            bv, bi = xs4[4 * u + e], int32(v + e)
        return bv, bi
    floor = float32(-math.inf)
    inv_t = float32(1) / temperature
    xs = cuda.local.array(_PAIR_IDS, float32)
    for base in range(lo, hi, 2 * SCAN_UNROLL * nt):  # same trip count on every lane
        for u in range(SCAN_UNROLL):                  # every load in flight first
            v = base + 2 * (u * nt + t)
            for e in range(2):
                if v + e < hi:
                    xs[2 * u + e] = logits[i, v + e]
        for u in range(SCAN_UNROLL):
            v = base + 2 * (u * nt + t)               # even: ids v and v + 1 share a hash
            if v >= hi:
                continue
            if kr >= 0 and not greedy:                # the group's bound (NOISE_GROUP even: one group per pair)
                gb = bnd[kr, v // NOISE_GROUP]
                if _stays_below(xs[2 * u] * inv_t, gb, floor) and (
                        v + 1 >= hi or _stays_below(xs[2 * u + 1] * inv_t, gb, floor)):
                    continue
            z = mix64_dev(hkey ^ uint64(v >> 1)) if not greedy else uint64(0)
            for e in range(2):
                if v + e >= hi:
                    continue
                x = xs[2 * u + e]
                if not greedy:
                    k = _bits23(z, e)
                    if _bound_skips(x * inv_t, k, floor):
                        continue
                    r = (float32(k) + float32(0.5)) * float32(1.1920928955078125e-07)   # unit's u: (k + 1/2) 2^-23
                    x = x / temperature + float32(-math.log(float32(-math.log(r))))
                if x > bv:
                    bv, bi = x, int32(v + e)
        if not greedy:
            floor = max(floor, bv)
            for off in (16, 8, 4, 2, 1):
                floor = max(floor, shfl_xor(floor, int32(off)))
    return bv, bi


@cuda.jit(device=True, inline="always")
def _key_row(i, seq, pos, bnd, krow, key_seq, key_pos):
    """Row of the noise-bound table for row i, or -1: none given (an empty krow), or its key is not row i's own
    (seq, pos): a wrong table row would bound the wrong noise, so it is not used."""
    if krow.shape[0] == 0:
        return int32(-1)
    q = krow[i]
    ok = 0 <= q < bnd.shape[0] and key_seq[q] == seq[i] and key_pos[q] == pos[i]
    return q if ok else int32(-1)


@cuda.jit(device=True, inline="always")
def _chunk(V, c, C):
    """Ids [lo, hi) of vocabulary chunk c of C (chunk widths a multiple of 4: 16-byte loads stay aligned)."""
    width = ((V + C - 1) // C + 3) // 4 * 4
    lo = min(c * width, V)
    return lo, min(lo + width, V)


def _row_kernels(noise):
    """(sample_kernel, sample_part_kernel) reading the noise-bound table (noise=True) or with its lookups compiled
    out (the split kernel holds 64 registers instead of 70); both take the table's arguments."""
    @cuda.jit
    def sample_kernel(logits, temperature, greedy, seed, seq, pos, vec, bnd, krow, key_seq, key_pos, out):
        """Block per row, SAMPLE_THREADS threads strided over the vocabulary: argmax of logits (greedy) or of
        logits / temperature + gumbel noise; lowest index wins ties. Bytes: the logits once."""
        i, t = cuda.blockIdx.x, cuda.threadIdx.x
        V = logits.shape[1]
        kr = _key_row(i, seq, pos, bnd, krow, key_seq, key_pos) if noise else int32(-1)
        bv, bi = _scan(logits, i, 0, V, temperature, greedy, row_key(seed, seq[i], pos[i]), vec, bnd, kr)
        bv, bi = block_argmax(bv, bi)
        if t == 0:
            out[i] = bi if bi < V else int32(0)

    @cuda.jit
    def sample_part_kernel(logits, temperature, greedy, seed, seq, pos, vec, bnd, krow, key_seq, key_pos, best):
        """Block per (vocabulary chunk c, row i), grid (C, n): the chunk's winner as order_key(value, id) in
        best u64[>= n, >= C] (value -inf, id V when the chunk has none). Bytes: the logits once."""
        c, i, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        lo, hi = _chunk(logits.shape[1], c, cuda.gridDim.x)
        kr = _key_row(i, seq, pos, bnd, krow, key_seq, key_pos) if noise else int32(-1)
        bv, bi = _scan(logits, i, lo, hi, temperature, greedy, row_key(seed, seq[i], pos[i]), vec, bnd, kr)
        bv, bi = block_argmax(bv, bi)
        if t == 0:
            best[i, c] = order_key(bv, bi)
    return sample_kernel, sample_part_kernel


sample_kernel, sample_part_kernel = _row_kernels(False)
sample_kernel_noise, sample_part_kernel_noise = _row_kernels(True)


@cuda.jit
def sample_merge_kernel(best, chunks, vocab, out):
    """Warp per row (MERGE_ROWS rows per block): lane c reads best[i, c] (all loads at once; a thread per row
    looping over the chunks took 4.7 us for 17 rows on the H200, its loads in series), a warp max of the keys,
    then out[i] = the winner's id (0 if no chunk had a candidate)."""
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
    from kernels.attention import _address
    from kernels.gemm import contiguous
    return logits.shape[1] % 4 == 0 and contiguous(logits) and _address(logits) % 16 == 0


def sample(logits, temperature, seed, seq, pos, out, work=None, noise=None):
    """sample_ref on the GPU or the simulator: logits f32[n, V], seq i32[n], pos i32[n] -> out i32[n].
    work (sample_work, >= n rows): split every row over vocabulary chunks (sample_part_kernel, then
    sample_merge_kernel), for when n rows alone cannot fill the GPU; without it, one block per row. Greedy rows
    are read with 16-byte loads where _rows_16b allows.
    noise = (bnd f32[keys, noise_groups(V)], krow i32[n], key_seq i32[keys], key_pos i32[keys]): rows that share a
    noise key (a tree's nodes of one depth) share one table of per-group noise bounds, made first by
    noise_bound_kernel (one hash per id pair per KEY, not per row); a row skips the hashes of the pairs that
    provably cannot win. krow[i] names row i's key; a row whose named key is not its own (seq, pos) ignores the
    table. Same result as without."""
    n, V = logits.shape
    if seq.shape != (n,) or pos.shape != (n,) or out.shape != (n,):
        raise ValueError(f"sample: seq {seq.shape}, pos {pos.shape}, out {out.shape} must be [{n}]")
    if work is not None and (work.shape[0] < n or work.shape[1] != SAMPLE_CHUNKS):
        raise ValueError(f"sample: work {work.shape} is not [>= {n}, {SAMPLE_CHUNKS}] (sample_work)")
    greedy = temperature == 0
    if noise is not None:
        bnd, krow, key_seq, key_pos = noise
        keys = bnd.shape[0]
        if bnd.shape[1:] != (noise_groups(V),) or krow.shape != (n,) or key_seq.shape != (keys,) or \
                key_pos.shape != (keys,):
            raise ValueError(f"sample: noise table {bnd.shape}, krow {krow.shape}, keys {key_seq.shape} / "
                             f"{key_pos.shape} do not fit {n} rows of {V} ids ([keys, {noise_groups(V)}], [{n}], "
                             f"[keys])")
        if greedy or not n:
            noise = None
        elif keys:
            launch(noise_bound_kernel, (-(-bnd.shape[1] // 256), keys), 256, uint64(seed), key_seq, key_pos,
                   int32(V), bnd)
    if noise is None:      # no table: views of the call's own arrays (no allocation; an empty krow means none)
        bnd, krow, key_seq, key_pos = logits[:1, :1], seq[:0], seq, pos
    args = (logits, float32(1 if greedy else temperature), greedy, uint64(seed), seq, pos,
            greedy and _rows_16b(logits), bnd, krow, key_seq, key_pos)
    rows_k, part_k = (sample_kernel_noise, sample_part_kernel_noise) if noise is not None else (sample_kernel,
                                                                                                 sample_part_kernel)
    if n and work is None:
        launch(rows_k, n, SAMPLE_THREADS, *args, out)
    elif n:
        C = sample_chunks(n, V)
        launch(part_k, (C, n), SPLIT_THREADS, *args, work)
        launch(sample_merge_kernel, -(-n // MERGE_ROWS), 32 * MERGE_ROWS, work, int32(C), int32(V), out)
    return out
