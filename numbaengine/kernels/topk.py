"""Argmax and top-k over the vocabulary, per row: greedy tokens and the drafter's candidate ids.

Order: larger value first; among equal values the lower index first (matches np.argmax and a stable sort).
DDTree's per-depth top-K (kernels.tree.tree_topk) is at the end, two launches: every (vocabulary chunk, row)
block histograms its values by 12-bit order-key bins, keeps the ids at or above its own K-th best's bin as
candidates and adds those bins to the row's histogram; one block per row finds the row's K-th best bin, which
is at or above every chunk's, gathers the candidates at or above it (beyond REFINE_FROM of them only those at
or above the K-th best's sub-bin, the next 8 key bits) and orders them: up to RANK_MAX each finds its rank by
counting the larger ones, beyond that a block-wide bitonic network sorts them. Rows whose candidates overflow
(many equal values) take an exact radix select over the row instead.
"""
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from numbaengine.kernels.device import (
    LOG2E,
    SIM,
    as_f32,
    block_argmax,
    block_scan,
    grid_dep,
    ld16,
    shfl_xor,  # noqa: F401 (re-exported)
)
from numbaengine.kernels.launch import kernel, launch, launch_smem
from numbaengine.kernels.mma import ex2

TOPK_THREADS = 64 if SIM else 512       # topk_merge_kernel's block (H200, top-K at K = 16: 25.6 us; merge blocks of
#                                         256 / 1024 threads 25.9 / 29.9)
TOPK_WARPS = TOPK_THREADS // 32
PART_THREADS = 64 if SIM else 256       # topk_part_kernel's block
PART_IDS = 4 if SIM else 32            # ids per thread of topk_part_kernel, in registers (groups of 4; H200, K = 16:
#                                         256 x 32 ids 25.6 us, 512 threads x 16 ids 28.0); the
#                                         simulator's chunk (256 ids) keeps the pads of its 128-id test vocabulary few
TOPK_SPAN = PART_IDS * PART_THREADS     # vocabulary ids per chunk (one topk_part_kernel block)
TOPK_MAX = 1024                 # largest K (candidates per depth)
TOPK_CHUNKS = 64                # vocabulary chunks per row at most (V <= TOPK_CHUNKS * TOPK_SPAN)

BIG = 2 ** 31 - 1
NEG_INF = float32(-np.inf)

if SIM:
    from numbaengine.kernels.device import shfl_idx

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
    def shfl_idx(value, src):
        """device.shfl_idx inlined in numba IR (see kernels.attention.shfl_xor)."""
        return cuda.shfl_sync(0xFFFFFFFF, value, src)


@cuda.jit(device=True, inline="always")
def order_key32(x):
    """uint32 key of value x, larger key = larger value; -0.0 and +0.0 equal, as in numpy."""
    u = f32_bits(x + float32(0))
    return ~u if (u & uint32(0x80000000)) != uint32(0) else u | uint32(0x80000000)


@cuda.jit(device=True, inline="always")
def order_key(x, v):
    """Unique uint64 key of (value x, index v): larger key = earlier in this module's order (larger value, then
    lower index); -0.0 and +0.0 rank equal, as in numpy."""
    return (uint64(order_key32(x)) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(v))


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
    grid_dep()
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
        grid_dep()
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


# --- DDTree per-depth top-K: histogram threshold, filtered candidates, one sort per row --------------------------

TOPK_BINS = 4096                # bins of the top 12 bits of a value's order key (1/8 octave each)
TOPK_BIN_SHIFT = 52             # bin of an order_key = key >> 52
TOPK_CAP = 4096                 # candidates a row's merge sorts in shared memory (8 B each)
TOPK_STAT = TOPK_BINS           # cstats row: TOPK_BINS histogram counts, then per chunk (max, sum exp, count)
_PRE = TOPK_CHUNKS + 2
_PER = TOPK_BINS // TOPK_THREADS       # histogram bins per thread of topk_merge_kernel
_PART_PER = TOPK_BINS // PART_THREADS  # and of topk_part_kernel


def topk_cap(K):
    """Candidates per vocabulary chunk (beyond it the chunk, and its row, take the exact slow path)."""
    return 2 * K + 64


if SIM:
    def _block_reduce(buf, x, is_max, nw):
        """Simulator twin of _block_reduce through shared memory (its warp exchanges are slow)."""
        t, n = cuda.threadIdx.x, cuda.blockDim.x
        tmp = cuda.shared.array(TOPK_THREADS, float32)
        tmp[t] = x
        cuda.syncthreads()
        r = tmp[0]
        for j in range(1, n):
            r = max(r, tmp[j]) if is_max else r + tmp[j]
        cuda.syncthreads()
        return r

    def _block_scan(x, wsum, nw):
        """Simulator twin of device.block_scan through shared memory (the warp exchanges are slow there)."""
        t, n = cuda.threadIdx.x, cuda.blockDim.x
        tmp = cuda.shared.array(TOPK_THREADS, int32)
        tmp[t] = x
        cuda.syncthreads()
        incl, tot = 0, 0
        for j in range(n):
            tot += tmp[j]
            incl += tmp[j] if j <= t else 0
        cuda.syncthreads()
        return incl, tot

    def _append(counter, pred):
        """Simulator twin of _append: one atomic per taking thread."""
        return cuda.atomic.add(counter, 0, 1) if pred else 0

    def _append_n(counter, n):
        """Simulator twin of _append_n: one atomic per thread."""
        return cuda.atomic.add(counter, 0, n)


@cuda.jit(device=True, inline="always")
def _block_reduce_gpu(buf, x, is_max, nw):
    """Sum or max of float32 x over the block of nw warps (a constant: the fold below unrolls): warp butterflies,
    then every thread folds the warps' results from buf (one float per warp) in the same order; barriers inside."""
    for off in (16, 8, 4, 2, 1):
        y = shfl_xor(x, int32(off))
        x = max(x, y) if is_max else x + y
    if cuda.threadIdx.x % 32 == 0:
        buf[cuda.threadIdx.x // 32] = x
    cuda.syncthreads()
    r = buf[0]
    for w in range(1, nw):
        r = max(r, buf[w]) if is_max else r + buf[w]
    cuda.syncthreads()
    return r


@cuda.jit(device=True, inline="always")
def _append_gpu(counter, pred):
    """Slot of this lane's item in a shared list whose length is counter[0] (int32), one atomic per warp;
    every lane of the warp must call it (the result is meaningless where pred is False)."""
    bits = uint32(cuda.ballot_sync(0xFFFFFFFF, pred))
    lane = int32(cuda.laneid)
    leader = int32(cuda.ffs(bits)) - 1
    base = int32(0)
    if lane == leader:
        base = cuda.atomic.add(counter, 0, int32(cuda.popc(bits)))
    base = cuda.shfl_sync(0xFFFFFFFF, base, max(leader, 0))
    return base + int32(cuda.popc(bits & ((uint32(1) << uint32(lane)) - uint32(1))))


@cuda.jit(device=True, inline="always")
def _append_n_gpu(counter, n):
    """Slot of this lane's first of n items in a shared list whose length is counter[0] (int32): a warp prefix
    sum, one atomic per warp; every lane of the warp must call it."""
    lane = int32(cuda.laneid)
    x = n
    for off in (1, 2, 4, 8, 16):
        y = cuda.shfl_sync(0xFFFFFFFF, x, max(lane - off, 0))
        if lane >= off:
            x += y
    base = int32(0)
    if lane == 31:
        base = cuda.atomic.add(counter, 0, x)
    return cuda.shfl_sync(0xFFFFFFFF, base, 31) + x - n


if not SIM:
    _block_reduce, _block_scan, _append, _append_n = _block_reduce_gpu, block_scan, _append_gpu, _append_n_gpu


@cuda.jit(device=True, inline="always")
def _bin(x):
    """Histogram bin of value x: the top 12 bits of its order key (larger bin = larger value)."""
    return int32(order_key32(x) >> uint32(20))


@cuda.jit(device=True, inline="always")
def _bin_floor(tb):
    """The least value of bin tb: x >= it exactly when _bin(x) >= tb (x not NaN); -inf for the bins of -inf."""
    key = uint32(tb) << uint32(20)
    if tb < 8:
        return NEG_INF
    return bits_f32(key & uint32(0x7FFFFFFF)) if (key & uint32(0x80000000)) != uint32(0) else bits_f32(~key)


@cuda.jit(device=True, inline="always")
def _threshold_bin(hist, kq, wsum, ctl, per):
    """(bin, above, inside) for counts hist[0:TOPK_BINS] (any number type): the highest bin such that the bins
    from it up hold >= kq items, the items above it and in it; (TOPK_BINS, 0, 0) for kq = 0. Thread t scans
    `per` = TOPK_BINS / blockDim bins from the top, then a block scan; ctl: int32[3] shared. Every thread must
    call it (barriers inside)."""
    t = cuda.threadIdx.x
    top = TOPK_BINS - 1 - t * per
    s = int32(0)
    for j in range(per):
        s += int32(hist[top - j])
    if t == 0:
        ctl[0], ctl[1], ctl[2] = TOPK_BINS, 0, 0
    incl, tot = _block_scan(s, wsum, TOPK_BINS // (32 * per))
    cum = incl - s
    if kq > 0 and cum < kq <= incl:
        for j in range(per):
            c = int32(hist[top - j])
            if cum + c >= kq:
                ctl[0], ctl[1], ctl[2] = top - j, cum, c
                break
            cum += c
    cuda.syncthreads()
    r0, r1, r2 = ctl[0], ctl[1], ctl[2]
    cuda.syncthreads()
    return r0, r1, r2


@cuda.jit(device=True, inline="always")
def _radix_select(row, n, prefix, pmask, need, shift0, hist, wsum, ctl):
    """Exact slow path: refine (prefix, pmask) over the order keys of row f32[n] (read from global memory each
    pass) by 8-bit digits from bit shift0 down, until exactly `need` keys under the starting prefix are kept.
    Returns (prefix, mask): the keys with (key & mask) >= prefix are the ones above the start prefix plus those
    `need`. hist: int32[256] shared; ctl: uint64[4] shared. Every thread must call it (barriers inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    if t == 0:
        ctl[0], ctl[1], ctl[2], ctl[3] = prefix, pmask, uint64(need), uint64(0)
    cuda.syncthreads()
    shift = int32(shift0)
    while shift >= 0 and ctl[3] == uint64(0):
        sh = uint64(shift)
        for i in range(t, 256, nt):
            hist[i] = 0
        cuda.syncthreads()
        prefix, pmask, need = ctl[0], ctl[1], int32(ctl[2])
        for i in range(t, n, nt):
            key = order_key(row[i], i)
            if (key & pmask) == prefix:
                cuda.atomic.add(hist, int32((key >> sh) & uint64(0xFF)), 1)
        cuda.syncthreads()
        carry = int32(0)
        for r in range(0, 256, nt):                  # bins from the top: thread t takes digit 255 - r - t
            dig = 255 - r - t
            cnt = hist[dig] if dig >= 0 else int32(0)
            incl, tot = _block_scan(cnt, wsum, TOPK_WARPS)
            above = carry + incl - cnt
            if dig >= 0 and above < need <= above + cnt:
                ctl[0] = prefix | (uint64(dig) << sh)
                ctl[1] = pmask | (uint64(0xFF) << sh)
                ctl[2] = uint64(need - above)
                ctl[3] = uint64(1) if cnt == need - above else uint64(0)
            carry += tot
        cuda.syncthreads()
        shift = shift - 8 if shift >= 8 else (0 if shift > 0 else -1)   # ..., 12, 4, 0 (overlap is harmless)
    cuda.syncthreads()
    r0, r1 = ctl[0], ctl[1]
    cuda.syncthreads()
    return r0, r1


@cuda.jit(device=True, inline="always")
def _bitonic_desc(sk, n):
    """Sort the uint64 keys sk[0:n] in shared memory, larger first (bitonic network over the next power of two,
    padded with 0). Every thread must call it (barriers inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    n2 = int32(1)
    while n2 < n:
        n2 *= 2
    for i in range(n + t, n2, nt):
        sk[i] = uint64(0)
    cuda.syncthreads()
    k = int32(2)
    while k <= n2:
        j = k >> 1
        while j > 0:
            for p in range(t, n2 >> 1, nt):
                lo = ((p & ~(j - 1)) << 1) | (p & (j - 1))
                a, c = sk[lo], sk[lo + j]
                if (a < c) == ((lo & k) == 0):
                    sk[lo], sk[lo + j] = c, a
            cuda.syncthreads()
            j >>= 1
        k *= 2


REFINE_FROM = 128               # more candidates than this: first cut to the K-th best's sub-bin (_refine)
RANK_MAX = 512                  # up to this many, each candidate's rank is counted (n^2 / P compares per block, no
#                                 barrier); beyond, the block's bitonic network (a barrier per stage). H200, the merge
#                                 at budget 255 with _refine, rank counting and GATHER_UNROLL: 24.3 us against 35.8
#                                 with the bitonic network for every list
_CAP_PER = TOPK_CAP // TOPK_THREADS     # candidates per thread of topk_merge_kernel's compaction
GATHER_UNROLL = 8               # chunk-list keys per thread per round of topk_merge_kernel's gather (loads in flight)


if SIM:
    from numbaengine.kernels.sim import collective
    shfl_xor64 = shfl_xor

    def warp_max_u64(k):
        """Simulator twin of warp_max_u64: one warp exchange instead of five (each is two simulator barriers)."""
        return collective(k, max)[0]
else:
    @cuda.jit(device=True, inline="always")
    def shfl_xor64(x, j):
        """shfl_xor of a uint64 from lane ^ j (numba shuffles 64-bit signed integers only)."""
        return uint64(cuda.shfl_xor_sync(0xFFFFFFFF, int64(x), int32(j)))

    @cuda.jit(device=True, inline="always")
    def warp_max_u64(k):
        """The largest uint64 k of the warp, in every lane (butterfly of 64-bit shuffles)."""
        for off in (16, 8, 4, 2, 1):
            k = max(k, shfl_xor64(k, off))
        return k


@cuda.jit(device=True, inline="always")
def _refine(sk, n, tb, need, hist, wsum, ctl, cnt):
    """Shrink the candidates sk[0:n] (bins >= tb; `need` of those in bin tb are wanted) to the ones at or above the
    sub-bin of bin tb (next 8 key bits) that holds the need-th best: one shared histogram, a digit scan from the
    top, an in-place compaction. Returns the new count (>= the wanted; equal values share a sub-bin). Every
    thread must call it (barriers inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    for i in range(t, 256, nt):
        hist[i] = 0
    if t == 0:
        ctl[0] = 0
    cuda.syncthreads()
    for i in range(t, n, nt):
        key = sk[i]
        if int32(key >> uint64(TOPK_BIN_SHIFT)) == tb:
            cuda.atomic.add(hist, int32((key >> uint64(TOPK_BIN_SHIFT - 8)) & uint64(0xFF)), 1)
    cuda.syncthreads()
    carry = int32(0)
    for r in range(0, 256, nt):                      # digits from the top: thread t takes digit 255 - r - t
        dig = 255 - r - t
        c = hist[dig] if dig >= 0 else int32(0)
        incl, tot = _block_scan(c, wsum, TOPK_WARPS)
        above = carry + incl - c
        if dig >= 0 and above < need <= above + c:
            ctl[0] = dig
        carry += tot
    ks = cuda.local.array(_CAP_PER, uint64)
    for j in range(_CAP_PER):                        # every key read before any is moved
        i = t + j * nt
        ks[j] = sk[i] if i < n else uint64(0)
    if t == 0:
        cnt[0] = 0
    cuda.syncthreads()
    ts = ctl[0]
    for j in range(_CAP_PER):
        key = ks[j]
        kb = int32(key >> uint64(TOPK_BIN_SHIFT))
        keep = t + j * nt < n and (kb > tb or int32((key >> uint64(TOPK_BIN_SHIFT - 8)) & uint64(0xFF)) >= ts)
        slot = _append(cnt, keep)
        if keep:
            sk[slot] = key
    cuda.syncthreads()
    m = cnt[0]
    cuda.syncthreads()
    return m


@cuda.jit(device=True, inline="always")
def _count_above(sk, key, j0, j1):
    """How many of the keys sk[j0:j1] are larger than key (four independent counts: loads in flight)."""
    c0, c1, c2, c3 = int32(0), int32(0), int32(0), int32(0)
    j = j0
    while j + 4 <= j1:
        c0 = int32(c0 + (sk[j] > key))
        c1 = int32(c1 + (sk[j + 1] > key))
        c2 = int32(c2 + (sk[j + 2] > key))
        c3 = int32(c3 + (sk[j + 3] > key))
        j += 4
    while j < j1:
        c0 = int32(c0 + (sk[j] > key))
        j += 1
    return int32(c0 + c1 + int32(c2 + c3))


@cuda.jit(device=True, inline="always")
def _rank_write(sk, n, ids, lp, b, d, lse):
    """The best K = ids.shape[2] of the distinct keys sk[0:n] to ids[b, d, rank] / lp (value - lse), a key's rank
    being the count of larger keys: P = 4, 2 or 1 adjacent lanes per key (as many as the block holds) each count a
    share, summed by shuffles. Broadcast shared loads, no sort, no barrier. Every thread must call it."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    P = 4 if 4 * n <= nt else (2 if 2 * n <= nt else 1)
    m = (n + P - 1) // P
    for base in range(0, n * P, nt):                 # the same trip count in every thread (shuffles inside)
        i, p = (base + t) // P, (base + t) % P
        key = sk[i] if i < n else uint64(0)
        r = _count_above(sk, key, min(p * m, n), min(p * m + m, n))
        if P >= 2:
            r = int32(r + shfl_xor(r, 1))
        if P == 4:
            r = int32(r + shfl_xor(r, 2))
        if p == 0 and i < n and r < ids.shape[2]:
            ids[b, d, r] = key_index(key)
            lp[b, d, r] = key_value(key) - lse


@cuda.jit(device=True, inline="always")
def _part_off(j):
    """Offset of topk_part_kernel's register j from the thread's first id (4 consecutive ids per group)."""
    return int32(4 * (j >> 2) * PART_THREADS + (j & 3))


@kernel(launch_bounds=(PART_THREADS, 3))
def topk_part_kernel(logits, k, cand, ws):
    """Block per (chunk c, depth d, sequence b), PART_THREADS threads, over the TOPK_SPAN ids from c*TOPK_SPAN of
    logits f32[B, L, V] (C-contiguous), PART_IDS per thread in registers (16-byte loads when V % 4 == 0): the
    chunk's max and sum of exp(x - max); a shared histogram of the 12-bit value bins; the chunk's threshold bin
    t_c (its best min(k, n) ids sit at or above it); the counts of the bins >= t_c added to the row's histogram
    ws[b, d, 0:TOPK_BINS] (f32 counts, exact); the order_keys of the ids at or above t_c to cand u64[B, L, C, cap]
    (unordered). ws[b, d, TOPK_STAT + 3c + (0, 1, 2)] = max, sum, candidates (-1: more than cap, the row takes
    the slow path). Bytes: the chunk once, a few hundred atomics, ~(k + one bin) keys out."""
    grid_dep()
    c, d, b = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y), int32(cuda.blockIdx.z)
    t, nt = int32(cuda.threadIdx.x), PART_THREADS
    L, V, cap = int32(logits.shape[1]), int32(logits.shape[2]), int32(cand.shape[3])
    hist = cuda.shared.array(TOPK_BINS, int32)
    red = cuda.shared.array(32, float32)
    wsum = cuda.shared.array(32, int32)
    ctl = cuda.shared.array(3, int32)
    cnt = cuda.shared.array(1, int32)
    lo = c * int32(TOPK_SPAN)
    nv = min(V - lo, int32(TOPK_SPAN)) - 4 * t      # this thread's id j is valid when _part_off(j) < nv
    for j in range(_PART_PER):
        hist[t + j * nt] = 0
    if t == 0:
        cnt[0] = 0
    xs = cuda.local.array(PART_IDS, float32)      # id lo + 4t + _part_off(j)
    for g in range(PART_IDS // 4):                # every load in flight first
        o = int32(4 * g * nt)
        if (V & 3) == 0 and o < nv:
            w0, w1, w2, w3 = ld16(logits, int64(b * L + d) * V + (lo + 4 * t + o))
            xs[4 * g], xs[4 * g + 1], xs[4 * g + 2], xs[4 * g + 3] = as_f32(w0), as_f32(w1), as_f32(w2), as_f32(w3)
        else:
            for e in range(4):
                xs[4 * g + e] = logits[b, d, lo + 4 * t + o + e] if o + e < nv else NEG_INF
    cuda.syncthreads()                            # the histogram is zeroed
    m = NEG_INF
    for j in range(PART_IDS):                     # no branch per id: ids past the row are -inf, counted in -inf's
        m = max(m, xs[j])                         # bin here and taken out of it below
        cuda.atomic.add(hist, _bin(xs[j]), 1)
    m = _block_reduce(red, m, True, PART_THREADS // 32)   # barriers: the histogram is complete
    if t == 0 and nv < TOPK_SPAN:                 # thread 0: nv is the chunk's id count
        hist[_bin(NEG_INF)] -= int32(TOPK_SPAN) - nv
    mz = m if m > NEG_INF else float32(0)         # exp(-inf - mz) = 0, also in a row of -inf
    sx = float32(0)
    for j in range(PART_IDS):                     # ex2.approx (2 instructions; math.exp is libdevice's expf)
        sx += ex2((xs[j] - mz) * LOG2E)
    sx = _block_reduce(red, sx, False, PART_THREADS // 32)   # barriers: the pad count is out
    tc, above, inside = _threshold_bin(hist, min(k, nv + 4 * t), wsum, ctl, _PART_PER)
    for j in range(_PART_PER):
        i = t + j * nt
        h = hist[i]
        if i >= tc and h > 0:
            cuda.atomic.add(ws, (b, d, i), float32(h))
    count = above + inside
    if count <= cap:
        floor = _bin_floor(tc)
        mask = uint32(0)
        for j in range(PART_IDS):
            if _part_off(j) < nv and xs[j] >= floor:
                mask |= uint32(1) << uint32(j)
        slot = _append_n(cnt, int32(cuda.popc(mask)))
        for j in range(PART_IDS):
            if (mask >> uint32(j)) & uint32(1) != uint32(0):
                cand[b, d, c, slot] = order_key(xs[j], lo + 4 * t + _part_off(j))
                slot += 1
    if t == 0:
        ws[b, d, TOPK_STAT + 3 * c] = m
        ws[b, d, TOPK_STAT + 3 * c + 1] = sx
        ws[b, d, TOPK_STAT + 3 * c + 2] = float32(count) if count <= cap else float32(-1)


@kernel(launch_bounds=TOPK_THREADS)
def topk_merge_kernel(logits, cand, ws, ids, lp):
    """Block per (depth d, sequence b): the row's threshold bin t* from its histogram (staged in shared memory,
    zeroed in global memory for the next call; t* >= every chunk's t_c, so the chunk lists hold every id at or
    above t*), the ids at or above t* from the chunk lists into shared memory (dynamic: TOPK_CAP keys), beyond
    REFINE_FROM of them only those at or above the K-th best's sub-bin (_refine), their order (rank counting up to
    RANK_MAX keys, else the block's bitonic sort), the best K to ids i32[B, L, K] in top_logprobs' order
    with log-probs logit - logsumexp (from the chunks' stats) to lp f32[B, L, K]. Slow exact path (a chunk
    overflowed or more than TOPK_CAP ids at or above t*): radix passes over the row's logits under t*'s prefix,
    then the same sort of the K winners.
    Bytes: the histogram (16 KB) and the chunk lists (~C * (K + bin) keys)."""
    grid_dep()
    d, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    V, C, K = logits.shape[2], cand.shape[2], ids.shape[2]
    sk = cuda.shared.array(0, uint64)
    sh = cuda.shared.array(0, int32)                 # the same bytes: the row histogram before the candidates
    red = cuda.shared.array(TOPK_WARPS, float32)
    wsum = cuda.shared.array(TOPK_WARPS, int32)
    ctl = cuda.shared.array(3, int32)
    ctl64 = cuda.shared.array(4, uint64)
    hist = cuda.shared.array(256, int32)
    pre = cuda.shared.array(_PRE, int32)             # chunk list offsets, then the fast-path flag
    cnt = cuda.shared.array(1, int32)
    hv = cuda.local.array(_PER, float32)
    for j in range(_PER):                            # every load in flight (chunk t's stats too), then the stores
        hv[j] = ws[b, d, t + j * nt]
    mc, sc, kc = float32(-math.inf), float32(0), float32(0)
    if t < C:
        mc, sc, kc = ws[b, d, TOPK_STAT + 3 * t], ws[b, d, TOPK_STAT + 3 * t + 1], ws[b, d, TOPK_STAT + 3 * t + 2]
    for j in range(_PER):
        sh[t + j * nt] = int32(hv[j])
        ws[b, d, t + j * nt] = float32(0)            # consumed: ready for the next call
    if t < C:
        pre[t] = int32(kc)
    if t == 0:
        cnt[0] = 0
    mx = _block_reduce(red, mc, True, TOPK_WARPS)    # barriers: sh and pre are complete
    lse = mx + math.log(_block_reduce(red, sc * math.exp(mc - mx) if sc > float32(0) else float32(0), False,
                                      TOPK_WARPS))
    tb, above, inside = _threshold_bin(sh, K, wsum, ctl, _PER)
    n = above + inside
    if t == 0:
        ok = n <= TOPK_CAP
        acc = int32(0)
        for c in range(C):
            kc = pre[c]
            pre[c] = acc
            ok = ok and kc >= 0
            acc += max(kc, 0)
        pre[C] = acc
        pre[C + 1] = 1 if ok else 0
    cuda.syncthreads()
    ks = cuda.local.array(GATHER_UNROLL, uint64)
    fast = pre[C + 1] != 0
    if fast:
        total = pre[C]
        c = 0                                        # the chunk of list slot i: a thread's i only grow
        for base in range(0, total, GATHER_UNROLL * nt):   # uniform trip count per warp (warp-aggregated appends)
            for u in range(GATHER_UNROLL):           # every load in flight first
                i = base + u * nt + t
                ks[u] = uint64(0)
                if i < total:
                    while pre[c + 1] <= i:
                        c += 1
                    ks[u] = cand[b, d, c, i - pre[c]]
            for u in range(GATHER_UNROLL):
                take = base + u * nt + t < total and int32(ks[u] >> uint64(TOPK_BIN_SHIFT)) >= tb
                slot = _append(cnt, take)
                if take and slot < TOPK_CAP:
                    sk[slot] = ks[u]
    else:
        row = logits[b, d]
        prefix, pmask = _radix_select(row, V, uint64(tb) << uint64(TOPK_BIN_SHIFT),
                                      uint64(0xFFF) << uint64(TOPK_BIN_SHIFT), K - above, 44, hist, wsum, ctl64)
        for base in range(0, V, nt):
            i = base + t
            key = order_key(row[min(i, V - 1)], i)
            take = i < V and (key & pmask) >= prefix
            slot = _append(cnt, take)
            if take:
                sk[slot] = key
        n = K
    cuda.syncthreads()
    if fast and n > REFINE_FROM:                     # n, fast: the same in every thread
        n = _refine(sk, n, tb, K - above, hist, wsum, ctl, cnt)
    if n <= RANK_MAX:
        _rank_write(sk, n, ids, lp, b, d, lse)
        return
    _bitonic_desc(sk, n)
    for r in range(t, K, nt):
        key = sk[r]
        ids[b, d, r] = key_index(key)
        lp[b, d, r] = key_value(key) - lse


def topk_chunks(V, K):
    """Vocabulary chunks per row (blocks of topk_part_kernel per row): TOPK_SPAN ids each."""
    if V > TOPK_CHUNKS * TOPK_SPAN:
        raise ValueError(f"DDTree top-K: vocabulary {V} > {TOPK_CHUNKS * TOPK_SPAN}")
    return -(-V // TOPK_SPAN)


def topk_launch(logits, cand, ws, ids, lp, merge=True):
    """DDTree's per-depth top-K: logits f32[B, L, V] -> ids i32[B, L, K], lp f32[B, L, K] (top_logprobs), with the
    workspaces cand u64[B, L, C, topk_cap(K)] and ws f32[B, L, TOPK_STAT + 3C] (zero histogram between calls);
    merge=False: the first launch alone (benchmarks; leaves the histogram dirty)."""
    B, L, V = logits.shape
    K = ids.shape[2]
    launch(topk_part_kernel, (cand.shape[2], L, B), PART_THREADS, logits, np.int32(K), cand, ws)
    if merge:
        launch_smem(topk_merge_kernel, (L, B), TOPK_THREADS, 8 * TOPK_CAP, (logits, cand, ws, ids, lp))
