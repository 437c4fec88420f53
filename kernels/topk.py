"""Argmax and top-k over the vocabulary, per row: greedy tokens and the drafter's candidate ids.

Order: larger value first; among equal values the lower index first (matches np.argmax and a stable sort).
DDTree's per-depth top-K (kernels.tree.tree_topk) is at the end, two launches: every (vocabulary chunk, row)
block histograms its values by 12-bit order-key bins, keeps the ids at or above its own K-th best's bin as
candidates and adds those bins to the row's histogram; one block per row finds the row's K-th best bin, which
is at or above every chunk's, gathers the candidates at or above it and sorts them (bitonic). Rows whose
candidates overflow (many equal values) take an exact radix select over the row instead.
"""
import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from kernels.attention import shfl_xor
from kernels.device import SIM, block_argmax, kernel, launch

TOPK_THREADS = 64 if SIM else 512
TOPK_WARPS = TOPK_THREADS // 32
TOPK_MAX = 1024                 # largest K (candidates per depth)
TOPK_CHUNKS = 32                # vocabulary chunks per row at most (blocks of the first stage)
TOPK_SPAN = 1024 if SIM else 4096  # vocabulary ids per chunk at least

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
    from kernels.device import shfl_idx

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


# --- DDTree per-depth top-K: histogram threshold, filtered candidates, one sort per row --------------------------

TOPK_BINS = 4096                # bins of the top 12 bits of a value's order key (1/8 octave each)
TOPK_BIN_SHIFT = 52             # bin of an order_key = key >> 52
TOPK_CAP = 4096                 # candidates a row's merge sorts in shared memory (8 B each)
TOPK_STAT = TOPK_BINS           # cstats row: TOPK_BINS histogram counts, then per chunk (max, sum exp, count)
_PRE = TOPK_CHUNKS + 2


def topk_cap(K):
    """Candidates per vocabulary chunk (beyond it the chunk, and its row, take the exact slow path)."""
    return 2 * K + 64


if SIM:
    def _block_reduce(buf, x, is_max):
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

    def _block_scan(x, wsum):
        """Simulator twin of _block_scan_gpu through shared memory."""
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


@cuda.jit(device=True, inline="always")
def _block_reduce_gpu(buf, x, is_max):
    """Sum or max of float32 x over the block (blockDim a multiple of 32): warp butterflies, then every thread
    folds the warps' results from buf (one float per warp) in the same order; barriers inside."""
    for off in (16, 8, 4, 2, 1):
        y = shfl_xor(x, int32(off))
        x = max(x, y) if is_max else x + y
    if cuda.threadIdx.x % 32 == 0:
        buf[cuda.threadIdx.x // 32] = x
    cuda.syncthreads()
    r = buf[0]
    for w in range(1, cuda.blockDim.x // 32):
        r = max(r, buf[w]) if is_max else r + buf[w]
    cuda.syncthreads()
    return r


@cuda.jit(device=True, inline="always")
def _block_scan_gpu(x, wsum):
    """Inclusive prefix sum of int32 x over the block's threads (blockDim a multiple of 32) and the total; every
    thread must call it (barriers inside). wsum: int32 shared scratch, one per warp."""
    t = cuda.threadIdx.x
    lane, w = t & 31, t >> 5
    for off in (1, 2, 4, 8, 16):
        y = shfl_idx(x, int32(max(lane - off, 0)))
        if lane >= off:
            x += y
    if lane == 31:
        wsum[w] = x
    cuda.syncthreads()
    base, tot = int32(0), int32(0)
    for j in range(cuda.blockDim.x >> 5):
        s = wsum[j]
        tot += s
        if j < w:
            base += s
    cuda.syncthreads()
    return base + x, tot


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


if not SIM:
    _block_reduce, _block_scan, _append = _block_reduce_gpu, _block_scan_gpu, _append_gpu


@cuda.jit(device=True, inline="always")
def _bin(x):
    """Histogram bin of value x: the top 12 bits of its order key (larger bin = larger value)."""
    return int32(order_key(x, 0) >> uint64(TOPK_BIN_SHIFT))


@cuda.jit(device=True, inline="always")
def _threshold_bin(hist, kq, wsum, ctl):
    """(bin, above, inside) for counts hist[0:TOPK_BINS] (any number type): the highest bin such that the bins
    from it up hold >= kq items, the items above it and in it; (TOPK_BINS, 0, 0) for kq = 0. Thread t scans a
    run of bins from the top, then a block scan; ctl: int32[3] shared. Every thread must call it (barriers)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    per = TOPK_BINS // nt
    top = TOPK_BINS - 1 - t * per
    s = int32(0)
    for j in range(per):
        s += int32(hist[top - j])
    if t == 0:
        ctl[0], ctl[1], ctl[2] = TOPK_BINS, 0, 0
    incl, tot = _block_scan(s, wsum)
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
            incl, tot = _block_scan(cnt, wsum)
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


@kernel(launch_bounds=TOPK_THREADS)
def topk_part_kernel(logits, k, cand, ws):
    """Block per (chunk c, depth d, sequence b), blockDim TOPK_THREADS, over the chunk's ids of logits f32[B, L, V]
    (staged in dynamic shared memory, 4 B per id): the chunk's max and sum of exp(x - max); a shared histogram of
    the 12-bit value bins; the chunk's threshold bin t_c (its best min(k, n) sit at or above it); the counts of
    bins >= t_c added to the row histogram ws[b, d, 0:TOPK_BINS] (f32 counts, exact); the order_keys of the ids
    at or above t_c to cand u64[B, L, C, cap] (unordered). ws[b, d, TOPK_STAT + 3c + (0, 1, 2)] = max, sum,
    candidates (-1: more than cap, the row takes the slow path). Bytes: the chunk once, ~(2k + bin) keys out."""
    c, d, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    V, C, cap = logits.shape[2], cand.shape[2], cand.shape[3]
    sv = cuda.shared.array(0, float32)
    hist = cuda.shared.array(TOPK_BINS, int32)
    red = cuda.shared.array(TOPK_WARPS, float32)
    wsum = cuda.shared.array(TOPK_WARPS, int32)
    ctl = cuda.shared.array(3, int32)
    cnt = cuda.shared.array(1, int32)
    span = (V + C - 1) // C
    lo = c * span
    n = max(min(lo + span, V) - lo, 0)
    for i in range(t, TOPK_BINS, nt):
        hist[i] = 0
    if t == 0:
        cnt[0] = 0
    m = float32(-math.inf)
    xs = cuda.local.array(4, float32)
    for i0 in range(t, n, 4 * nt):                   # four loads in flight per thread
        for u in range(4):
            if i0 + u * nt < n:
                xs[u] = logits[b, d, lo + i0 + u * nt]
        for u in range(4):
            if i0 + u * nt < n:
                sv[i0 + u * nt] = xs[u]
                m = max(m, xs[u])
    m = _block_reduce(red, m, True)
    sx = float32(0)
    for i in range(t, n, nt):
        x = sv[i]
        sx += math.exp(x - m)
        cuda.atomic.add(hist, _bin(x), 1)
    sx = _block_reduce(red, sx, False)               # barriers: the histogram is complete
    tc, above, inside = _threshold_bin(hist, min(k, n), wsum, ctl)
    for i in range(tc + t, TOPK_BINS, nt):
        h = hist[i]
        if h > 0:
            cuda.atomic.add(ws, (b, d, i), float32(h))
    count = above + inside
    if count <= cap:
        for base in range(0, n, nt):                 # uniform trip count per warp (warp-aggregated appends)
            i = base + t
            take = i < n and _bin(sv[min(i, n - 1)]) >= tc
            slot = _append(cnt, take)
            if take:
                cand[b, d, c, slot] = order_key(sv[i], lo + i)
    if t == 0:
        ws[b, d, TOPK_STAT + 3 * c] = m
        ws[b, d, TOPK_STAT + 3 * c + 1] = sx
        ws[b, d, TOPK_STAT + 3 * c + 2] = float32(count) if count <= cap else float32(-1)


@kernel(launch_bounds=TOPK_THREADS)
def topk_merge_kernel(logits, cand, ws, ids, lp):
    """Block per (depth d, sequence b): the row's threshold bin t* from the histogram (t* >= every chunk's t_c,
    so the chunk lists hold every id at or above t*; the histogram is zeroed after), the ids at or above t* from
    the chunk lists into shared memory (dynamic: TOPK_CAP keys), a bitonic sort, the best K to ids i32[B, L, K]
    in top_logprobs' order with log-probs logit - logsumexp (from the chunks' stats) to lp f32[B, L, K]. Slow
    exact path (a chunk overflowed or more than TOPK_CAP ids at or above t*): radix passes over the row's logits
    below t*'s prefix, then the same sort of the K winners."""
    d, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    V, C, K = logits.shape[2], cand.shape[2], ids.shape[2]
    sk = cuda.shared.array(0, uint64)
    red = cuda.shared.array(TOPK_WARPS, float32)
    wsum = cuda.shared.array(TOPK_WARPS, int32)
    ctl = cuda.shared.array(3, int32)
    ctl64 = cuda.shared.array(4, uint64)
    hist = cuda.shared.array(256, int32)
    pre = cuda.shared.array(_PRE, int32)             # chunk list offsets, then the fast-path flag
    cnt = cuda.shared.array(1, int32)
    mx = float32(-math.inf)
    for c in range(t, C, nt):
        mx = max(mx, ws[b, d, TOPK_STAT + 3 * c])
    mx = _block_reduce(red, mx, True)
    tot = float32(0)
    for c in range(t, C, nt):
        s = ws[b, d, TOPK_STAT + 3 * c + 1]
        if s > float32(0):
            tot += s * math.exp(ws[b, d, TOPK_STAT + 3 * c] - mx)
    lse = mx + math.log(_block_reduce(red, tot, False))
    tb, above, inside = _threshold_bin(ws[b, d], K, wsum, ctl)
    for i in range(t, TOPK_BINS, nt):                # consumed: ready for the next call
        ws[b, d, i] = float32(0)
    n = above + inside
    if t == 0:
        ok = n <= TOPK_CAP
        acc = int32(0)
        for c in range(C):
            pre[c] = acc
            kc = int32(ws[b, d, TOPK_STAT + 3 * c + 2])
            ok = ok and kc >= 0
            acc += max(kc, 0)
        pre[C] = acc
        pre[C + 1] = 1 if ok else 0
        cnt[0] = 0
    cuda.syncthreads()
    if pre[C + 1] != 0:
        total = pre[C]
        for base in range(0, total, nt):             # uniform trip count per warp (warp-aggregated appends)
            i = base + t
            key = uint64(0)
            if i < total:
                c = 0
                while pre[c + 1] <= i:
                    c += 1
                key = cand[b, d, c, i - pre[c]]
            take = i < total and int32(key >> uint64(TOPK_BIN_SHIFT)) >= tb
            slot = _append(cnt, take)
            if take and slot < TOPK_CAP:
                sk[slot] = key
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
    _bitonic_desc(sk, n)
    for r in range(t, K, nt):
        key = sk[r]
        ids[b, d, r] = key_index(key)
        lp[b, d, r] = key_value(key) - lse


def topk_chunks(V, K):
    """Vocabulary chunks per row: up to TOPK_CHUNKS of >= TOPK_SPAN ids."""
    return max(1, min(TOPK_CHUNKS, V // TOPK_SPAN))


TOPK_STATIC = (4 * TOPK_BINS + 8 * TOPK_WARPS + 64, 1024 + 8 * TOPK_WARPS + 4 * TOPK_CHUNKS + 128)


def topk_smem(V, K):
    """Dynamic shared memory bytes of (topk_part_kernel, topk_merge_kernel). Static plus dynamic above 48 KB
    needs the opt-in, which launch_smem makes for dynamic sizes above 48 KB: such sizes are rounded up to it."""
    C = topk_chunks(V, K)
    return tuple(b if b + s <= 48 * 1024 else max(b, 48 * 1024 + 8)
                 for b, s in zip((4 * (-(-V // C)), 8 * TOPK_CAP), TOPK_STATIC))
