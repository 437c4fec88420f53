"""Argmax and top-k over the vocabulary, per row: greedy tokens and the drafter's candidate ids.

Order: larger value first; among equal values the lower index first (matches np.argmax and a stable sort).
DDTree's per-depth top-K (kernels.tree.tree_topk) is the chunked radix select at the end: every (vocabulary
chunk, row) block radix-selects its chunk's best K keys in shared memory, then one block per row radix-selects
the best K of the chunks' candidates and ranks them by counting.
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
TOPK_MERGE = 16384              # chunk candidates per row at most (8 B each in the merge's shared memory)

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


# --- DDTree per-depth top-K: chunked radix select ---------------------------------------------------------------

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




if SIM:
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


if not SIM:
    _block_reduce, _block_scan = _block_reduce_gpu, _block_scan_gpu


if SIM:
    def _hist_add(hist, w, bin_):
        if bin_ >= 0:
            cuda.atomic.add(hist, (w, bin_), 1)
else:
    @cuda.jit(device=True, inline="always")
    def _hist_add(hist, w, bin_):
        """Warp-aggregated histogram increment into warp w's private histogram (bin -1: nothing); every lane
        of the warp must call it."""
        peers = cuda.match_any_sync(0xFFFFFFFF, bin_)
        below = (uint32(1) << uint32(cuda.laneid)) - uint32(1)
        if bin_ >= 0 and (uint32(peers) & below) == uint32(0):
            cuda.atomic.add(hist, (w, bin_), cuda.popc(peers))


@cuda.jit(device=True, inline="always")
def _radix_select(keys, n, kq, hist, wsum, ctl):
    """The best kq of the unique keys u64[n] (shared memory, larger first) by 8-bit radix passes from the top,
    warp-private histograms and a block scan over the bins. Returns (prefix, mask): exactly kq keys satisfy
    (key & mask) >= prefix (kq <= n; kq = 0: none). Every thread must call it (barriers inside)."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    w = t >> 5
    if t == 0:
        ctl[0], ctl[1], ctl[2], ctl[3] = uint64(0), uint64(0), uint64(kq), uint64(0)
    for p in range(8 if kq > 0 else 0):
        shift = uint64(56 - 8 * p)
        for i in range(t, (nt >> 5) * 256, nt):
            hist[i >> 8, i & 255] = 0
        cuda.syncthreads()
        prefix, pmask, need = ctl[0], ctl[1], int32(ctl[2])
        for base in range(0, n, nt):                 # uniform trip count per warp (aggregated atomics)
            i = base + t
            bn = int32(-1)
            if i < n:
                key = keys[i]
                if (key & pmask) == prefix:
                    bn = int32((key >> shift) & uint64(0xFF))
            _hist_add(hist, w, bn)
        cuda.syncthreads()
        carry = int32(0)
        for r in range(0, 256, nt):                  # bins from the top: thread t takes digit 255 - r - t
            dig = 255 - r - t
            cnt = int32(0)
            if dig >= 0:
                for ww in range(nt >> 5):
                    cnt += hist[ww, dig]
            incl, tot = _block_scan(cnt, wsum)
            above = carry + incl - cnt               # keys in the bins above this digit
            if dig >= 0 and above < need <= above + cnt:
                ctl[0] = prefix | (uint64(dig) << shift)
                ctl[1] = pmask | (uint64(0xFF) << shift)
                ctl[2] = uint64(need - above)
                ctl[3] = uint64(1) if cnt == need - above else uint64(0)
            carry += tot
        cuda.syncthreads()
        if ctl[3] != uint64(0):                      # every key under the prefix is in: stop
            break
    cuda.syncthreads()
    return ctl[0], ctl[1]


@cuda.jit(device=True, inline="always")
def _gather(keys, n, prefix, pmask, out, counter):
    """out[...] = the keys with (key & pmask) >= prefix, unordered; counter: int32 shared, zeroed before."""
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        key = keys[i]
        if (key & pmask) >= prefix:
            out[cuda.atomic.add(counter, 0, 1)] = key


@kernel(launch_bounds=TOPK_THREADS)
def topk_part_kernel(logits, keys, stats):
    """Block per (chunk c, depth d, sequence b), blockDim TOPK_THREADS: the best min(K, chunk) order_keys of
    logits[b, d, chunk] (unique 64-bit keys, larger = earlier in top_logprobs' order), radix-selected in shared
    memory (dynamic: 8 B per chunk id) and written unsorted to keys u64[B, L, C, K] (rest 0), with the chunk's
    max and sum of exp(x - max) in stats f32[B, L, C, 2]. Bytes: the chunk twice (L2 the second time)."""
    c, d, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    V, C, K = logits.shape[2], keys.shape[2], keys.shape[3]
    sk = cuda.shared.array(0, uint64)
    red = cuda.shared.array(TOPK_WARPS, float32)
    hist = cuda.shared.array((TOPK_WARPS, 256), int32)
    wsum = cuda.shared.array(TOPK_WARPS, int32)
    ctl = cuda.shared.array(4, uint64)
    cnt = cuda.shared.array(1, int32)
    span = (V + C - 1) // C
    lo = c * span
    n = max(min(lo + span, V) - lo, 0)
    m = float32(-math.inf)
    xs = cuda.local.array(4, float32)
    for i0 in range(t, n, 4 * nt):                   # four loads in flight per thread
        for u in range(4):
            if i0 + u * nt < n:
                xs[u] = logits[b, d, lo + i0 + u * nt]
        for u in range(4):
            if i0 + u * nt < n:
                sk[i0 + u * nt] = order_key(xs[u], lo + i0 + u * nt)
                m = max(m, xs[u])
    m = _block_reduce(red, m, True)
    sx = float32(0)
    for i in range(t, n, nt):
        sx += math.exp(key_value(sk[i]) - m)
    sx = _block_reduce(red, sx, False)
    kc = min(K, n)
    if t == 0:
        stats[b, d, c, 0], stats[b, d, c, 1] = m, sx
        cnt[0] = 0
    prefix, pmask = _radix_select(sk, n, kc, hist, wsum, ctl)
    if kc > 0:
        _gather(sk, n, prefix, pmask, keys[b, d, c], cnt)
    for i in range(kc + t, K, nt):
        keys[b, d, c, i] = uint64(0)


@kernel(launch_bounds=TOPK_THREADS)
def topk_merge_kernel(logits, keys, stats, ids, lp):
    """Block per (depth d, sequence b): the best K of the C*K chunk candidates (radix select in shared memory,
    dynamic: 8 B per candidate + 8 B per K), ranked by counting; ids i32[B, L, K] in top_logprobs' order and
    their log-probs logit - logsumexp (from the chunks' stats)."""
    d, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    C, K = keys.shape[2], keys.shape[3]
    n = C * K
    sk = cuda.shared.array(0, uint64)
    red = cuda.shared.array(TOPK_WARPS, float32)
    hist = cuda.shared.array((TOPK_WARPS, 256), int32)
    wsum = cuda.shared.array(TOPK_WARPS, int32)
    ctl = cuda.shared.array(4, uint64)
    cnt = cuda.shared.array(1, int32)
    ws = cuda.local.array(4, uint64)
    for i0 in range(t, n, 4 * nt):                   # four loads in flight per thread
        for u in range(4):
            i = i0 + u * nt
            if i < n:
                ws[u] = keys[b, d, i // K, i % K]
        for u in range(4):
            if i0 + u * nt < n:
                sk[i0 + u * nt] = ws[u]
    mx = float32(-math.inf)
    for c in range(t, C, nt):
        mx = max(mx, stats[b, d, c, 0])
    mx = _block_reduce(red, mx, True)
    tot = float32(0)
    for c in range(t, C, nt):
        if stats[b, d, c, 1] > float32(0):
            tot += stats[b, d, c, 1] * math.exp(stats[b, d, c, 0] - mx)
    lse = mx + math.log(_block_reduce(red, tot, False))
    if t == 0:
        cnt[0] = 0
    cuda.syncthreads()
    prefix, pmask = _radix_select(sk, n, K, hist, wsum, ctl)   # padding keys are 0, below every real key
    sel = sk[n:n + K]
    _gather(sk, n, prefix, pmask, sel, cnt)
    cuda.syncthreads()
    for r in range(t, K, nt):
        key = sel[r]
        rank = 0
        for j in range(K):
            rank += 1 if sel[j] > key else 0
        v = key_index(key)
        ids[b, d, rank] = v
        lp[b, d, rank] = logits[b, d, v] - lse


def topk_chunks(V, K):
    """Vocabulary chunks per row: up to TOPK_CHUNKS of >= TOPK_SPAN ids, C*K candidates within TOPK_MERGE."""
    kp = 1
    while kp < K:
        kp *= 2
    return max(1, min(TOPK_CHUNKS, TOPK_MERGE // kp, V // TOPK_SPAN))


TOPK_STATIC = 1024 * TOPK_WARPS + 8 * TOPK_WARPS + 64     # the kernels' static shared bytes


def topk_smem(V, K):
    """Dynamic shared memory bytes of (topk_part_kernel, topk_merge_kernel). Static plus dynamic above 48 KB
    needs the opt-in, which launch_smem makes for dynamic sizes above 48 KB: such sizes are rounded up to it."""
    C = topk_chunks(V, K)
    return tuple(b if b + TOPK_STATIC <= 48 * 1024 else max(b, 48 * 1024 + 8) for b in (8 * (-(-V // C)),
                                                                                      8 * (C * K + K)))
