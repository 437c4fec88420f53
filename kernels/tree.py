"""DDTree on the GPU: per-depth top-K, the best-first tree build, the walk and the commit, for a batch of sequences.

The reference is numbaengine.ddtree (top_logprobs, build_tree, walk, commit); the outputs here are identical given
the same candidate lists. Build: the heap of the reference pops nodes in the total order (score descending, rank
tuple ascending) because every pushed entry ranks after the entry that pushed it (log-probs <= 0 and rounding is
monotone), so one warp per sequence pops the best frontier entry with a warp argmax under that order: no heap.
Every buffer is preallocated (TreeBuffers); per-round values (lengths, bonus, budgets) live in device arrays.
"""
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, uint32, uint64

from kernels.attention import launch_smem, shfl_xor
from kernels.device import SIM, current_stream, kernel

TOPK_THREADS = 64 if SIM else 512
TOPK_MAX = 1024                 # largest K (candidates per depth)
TOPK_CHUNKS = 8                 # vocabulary chunks per row at most (blocks of the first stage)
TOPK_MERGE = 2048               # chunk candidates sorted per row at most
NODE_MAX = 1025                 # largest tree: MAX_BUDGET 1024 drafted nodes + the root
DEPTH_MAX = 64                  # largest L (drafter block size - 1)
WALK_THREADS = 32

if SIM:
    def _f32_bits(x):
        return np.uint32(np.array([x], np.float32).view(np.uint32)[0])
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def _f32_bits(x):
        return uint32(libdevice.float_as_int(x))


@cuda.jit(device=True, inline="always")
def _order_key(x, v):
    """Unique uint64 key, larger = earlier in top_logprobs' order (larger logit, then lower id)."""
    u = _f32_bits(x + float32(0))                   # -0.0 -> +0.0: numpy ranks them equal
    u = ~u if (u & uint32(0x80000000)) != uint32(0) else u | uint32(0x80000000)
    return (uint64(u) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(v))


@cuda.jit(device=True, inline="always")
def _block_reduce(buf, x, is_max):
    """Sum or max of x over the block (power-of-two size); every thread gets the result."""
    t, n = cuda.threadIdx.x, cuda.blockDim.x
    buf[t] = x
    step = n // 2
    while step > 0:
        cuda.syncthreads()
        if t < step:
            buf[t] = max(buf[t], buf[t + step]) if is_max else buf[t] + buf[t + step]
        step //= 2
    cuda.syncthreads()
    r = buf[0]
    cuda.syncthreads()
    return r


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


@kernel(launch_bounds=TOPK_THREADS)
def topk_part_kernel(logits, keys, stats):
    """Block per (chunk c, depth d, sequence b), blockDim a power of two <= TOPK_THREADS: the best
    min(K, chunk) keys of logits[b, d, chunk] (unique 64-bit keys, larger = earlier in top_logprobs' order) by
    an 8-bit radix select with warp-private, warp-aggregated histograms; written unsorted to keys u64[B, L, C, K]
    (rest 0), with the chunk's max and sum of exp(x - max) in stats f32[B, L, C, 2]. Bytes: the chunk 3-6
    times (L2 after the first)."""
    c, d, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    w = t >> 5
    V, C, K = logits.shape[2], keys.shape[2], keys.shape[3]
    red = cuda.shared.array(TOPK_THREADS, float32)
    hist = cuda.shared.array((32, 256), int32)
    hsum = cuda.shared.array(257, int32)             # [256] = gather counter
    ctl = cuda.shared.array(4, uint64)               # prefix, mask, remaining k, done
    span = (V + C - 1) // C
    lo = c * span
    hi = min(lo + span, V)
    m = float32(-math.inf)
    for v in range(lo + t, hi, nt):
        m = max(m, logits[b, d, v])
    m = _block_reduce(red, m, True)
    sx = float32(0)
    for v in range(lo + t, hi, nt):
        sx += math.exp(logits[b, d, v] - m)
    sx = _block_reduce(red, sx, False)
    kc = min(K, max(hi - lo, 0))
    if t == 0:
        stats[b, d, c, 0], stats[b, d, c, 1] = m, sx
        ctl[0], ctl[1], ctl[2], ctl[3] = uint64(0), uint64(0), uint64(kc), uint64(0)
        hsum[256] = 0
    for p in range(8 if kc > 0 else 0):              # radix select of the kc-th largest key, 8 bits per pass
        shift = uint64(56 - 8 * p)
        for i in range(t, 32 * 256, nt):
            hist[i // 256, i % 256] = 0
        cuda.syncthreads()
        prefix, pmask = ctl[0], ctl[1]
        for base in range(lo, hi, nt):               # uniform trip count per warp (aggregated atomics)
            v = base + t
            bn = int32(-1)
            if v < hi:
                key = _order_key(logits[b, d, v], v)
                if (key & pmask) == prefix:
                    bn = int32((key >> shift) & uint64(0xFF))
            _hist_add(hist, w, bn)
        cuda.syncthreads()
        for i in range(t, 256, nt):
            tot = 0
            for ww in range(nt // 32):
                tot += hist[ww, i]
            hsum[i] = tot
        cuda.syncthreads()
        if t == 0:
            kq, above, sel = int32(ctl[2]), int32(0), int32(0)
            for dig in range(255, -1, -1):
                if above + hsum[dig] >= kq:
                    sel = int32(dig)
                    break
                above += hsum[dig]
            kq -= above
            ctl[0] = prefix | (uint64(sel) << shift)
            ctl[1] = pmask | (uint64(0xFF) << shift)
            ctl[2] = uint64(kq)
            ctl[3] = uint64(1) if hsum[sel] == kq else uint64(0)
        cuda.syncthreads()
        if ctl[3] != uint64(0):                      # every key under the prefix is in: stop early
            break
    prefix, pmask = ctl[0], ctl[1]
    for v in range(lo + t, hi, nt):                  # exactly kc keys satisfy this
        key = _order_key(logits[b, d, v], v)
        if kc > 0 and (key & pmask) >= prefix:
            keys[b, d, c, cuda.atomic.add(hsum, 256, 1)] = key
    for i in range(kc + t, K, nt):
        keys[b, d, c, i] = uint64(0)


@kernel(launch_bounds=TOPK_THREADS)
def topk_merge_kernel(logits, keys, stats, ids, lp):
    """Block per (depth d, sequence b): sort the C*K chunk candidates (bitonic, descending, in shared memory),
    keep the first K as ids i32[B, L, K] and their log-probs logit - logsumexp (from the chunks' stats)."""
    d, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    C, K = keys.shape[2], keys.shape[3]
    sk = cuda.shared.array(TOPK_MERGE, uint64)
    lse = cuda.shared.array(1, float32)
    n = C * K
    kp = 1
    while kp < n:
        kp *= 2
    for i in range(t, kp, nt):
        sk[i] = keys[b, d, i // K, i % K] if i < n else uint64(0)
    if t == 0:
        mx = float32(-math.inf)
        for c in range(C):
            mx = max(mx, stats[b, d, c, 0])
        tot = float32(0)
        for c in range(C):
            if stats[b, d, c, 1] > float32(0):
                tot += stats[b, d, c, 1] * math.exp(stats[b, d, c, 0] - mx)
        lse[0] = mx + math.log(tot)
    k = 2
    while k <= kp:
        j = k // 2
        while j > 0:
            cuda.syncthreads()
            for i in range(t, kp, nt):
                ixj = i ^ j
                if ixj > i:
                    a, e = sk[i], sk[ixj]
                    if ((i & k) == 0 and a < e) or ((i & k) != 0 and a > e):
                        sk[i], sk[ixj] = e, a
            j //= 2
        k *= 2
    cuda.syncthreads()
    for r in range(t, K, nt):
        v = int32(uint32(0xFFFFFFFF) - uint32(sk[r] & uint64(0xFFFFFFFF)))
        ids[b, d, r] = v
        lp[b, d, r] = logits[b, d, v] - lse[0]


def topk_chunks(V, K):
    """Vocabulary chunks per row: enough blocks to fill the GPU, C*K candidates fitting the merge sort."""
    kp = 1
    while kp < K:
        kp *= 2
    return max(1, min(TOPK_CHUNKS, TOPK_MERGE // kp, -(-V // 2048)))


@cuda.jit(device=True, inline="always")
def _ranks_less(ea, eb, fpar, frank, fdepth, npar, nrank):
    """Rank tuple of frontier entry ea < that of eb, lexicographically (a proper prefix is smaller)."""
    ra = cuda.local.array(DEPTH_MAX, int32)
    rb = cuda.local.array(DEPTH_MAX, int32)
    da, db = fdepth[ea], fdepth[eb]
    ra[da - 1], rb[db - 1] = frank[ea], frank[eb]
    j = fpar[ea]
    for i in range(da - 2, -1, -1):
        ra[i] = nrank[j]
        j = npar[j]
    j = fpar[eb]
    for i in range(db - 2, -1, -1):
        rb[i] = nrank[j]
        j = npar[j]
    for i in range(min(da, db)):
        if ra[i] != rb[i]:
            return ra[i] < rb[i]
    return da < db


@cuda.jit(device=True, inline="always")
def _better(sa, ea, sb, eb, fpar, frank, fdepth, npar, nrank):
    """Entry (score sa, slot ea) pops before (sb, eb): higher score, then smaller rank tuple; slot -1 = none."""
    if ea < 0:
        return False
    if eb < 0:
        return True
    if sa != sb:
        return sa > sb
    return _ranks_less(ea, eb, fpar, frank, fdepth, npar, nrank)


@cuda.jit
def build_kernel(ids, lp, budgets, lengths, bonus, seq_ids, tokens, parents, depths, positions, vis, ntok,
                 sample_seq, sample_pos):
    """One warp per sequence b: the budgets[b] best prefixes of the candidate lists ids/lp i32/f32[B, L, K], in
    the reference heap's pop order (scores summed root to leaf in float64). Writes tokens, parents, depths,
    positions (= lengths[b] + depth) i32[B, N], vis u32[B, N, W] (bit j of row i: node j is i or an ancestor),
    ntok[b] = nodes incl. the root, and per node the sampling keys sample_seq / sample_pos (= position + 1)
    i32[B*N]. Rows past ntok[b] are padding (token 0, parent -1, no visibility). Dynamic shared memory
    (build_smem): frontier and node arrays (40 B per node) and lp[b, :, :min(K, N)]."""
    b, lane = cuda.blockIdx.x, cuda.threadIdx.x
    L, K = ids.shape[1], ids.shape[2]
    N, W = tokens.shape[1], vis.shape[2]
    kc = min(K, N)
    d64 = cuda.shared.array(0, float64)
    d32 = cuda.shared.array(0, int32)
    dff = cuda.shared.array(0, float32)
    fscore, nscore = d64[0:N], d64[N:2 * N]             # frontier (the reference's heap content) / popped nodes
    fpar, fdepth, frank = d32[4 * N:5 * N], d32[5 * N:6 * N], d32[6 * N:7 * N]
    npar, ndepth, nrank = d32[7 * N:8 * N], d32[8 * N:9 * N], d32[9 * N:10 * N]
    lps = dff[10 * N:10 * N + L * kc]                    # the ranks a tree of N nodes can reach
    for d in range(L):
        for r in range(lane, kc, 32):
            lps[d * kc + r] = lp[b, d, r]
    budget = min(budgets[b], N - 1)
    size = 0
    if budget > 0 and L > 0 and K > 0:
        size = 1
        if lane == 0:
            fscore[0], fpar[0], fdepth[0], frank[0] = float64(lps[0]), 0, 1, 0
    if lane == 0:
        nscore[0], npar[0], ndepth[0], nrank[0] = float64(0), -1, 0, 0
    cuda.syncthreads()
    nodes = 1
    while nodes <= budget and size > 0:
        bs, be = float64(-math.inf), int32(-1)
        for e in range(lane, size, 32):
            if _better(fscore[e], int32(e), bs, be, fpar, frank, fdepth, npar, nrank):
                bs, be = fscore[e], int32(e)
        for off in (16, 8, 4, 2, 1):                  # warp argmax under the pop order
            os_, oe = shfl_xor(bs, int32(off)), shfl_xor(be, int32(off))
            if _better(os_, oe, bs, be, fpar, frank, fdepth, npar, nrank):
                bs, be = os_, oe
        par, dep, rk = fpar[be], fdepth[be], frank[be]
        cuda.syncthreads()
        if lane == 0:
            nscore[nodes], npar[nodes], ndepth[nodes], nrank[nodes] = bs, par, dep, rk
            if rk + 1 < K:                            # next sibling replaces the popped entry
                fscore[be] = nscore[par] + float64(lps[(dep - 1) * kc + rk + 1])
                frank[be] = rk + 1
            else:
                last = size - 1
                fscore[be], fpar[be], fdepth[be], frank[be] = fscore[last], fpar[last], fdepth[last], frank[last]
        size += (0 if rk + 1 < K else -1)
        if dep < L:                                   # first child joins the frontier
            if lane == 0:
                fscore[size] = bs + float64(lps[dep * kc])
                fpar[size], fdepth[size], frank[size] = nodes, dep + 1, 0
            size += 1
        nodes += 1
        cuda.syncthreads()
    start = lengths[b]
    for i in range(lane, N, 32):
        live = i < nodes
        dep = ndepth[i] if live else 0
        tok = 0
        if i == 0:
            tok = bonus[b]
        elif live:
            tok = ids[b, dep - 1, nrank[i]]
        tokens[b, i] = tok
        parents[b, i] = npar[i] if live else -1
        depths[b, i] = dep
        positions[b, i] = start + dep
        sample_seq[b * N + i] = seq_ids[b]
        sample_pos[b * N + i] = start + dep + 1
    for iw in range(lane, N * W, 32):                 # ancestor-or-self bits, one word per step
        i, w = iw // W, iw % W
        word = uint32(0)
        j = i if i < nodes else -1
        while j >= 0:
            if j // 32 == w:
                word |= uint32(1) << uint32(j % 32)
            j = npar[j]
        vis[b, i, w] = word
    if lane == 0:
        ntok[b] = nodes


@cuda.jit
def walk_kernel(tokens, parents, ntok, post, lengths, bonus, path, nacc, start_out, out_tokens):
    """One warp per sequence: follow the children whose token equals the target's sample post[b*N + node]
    (i32[B*N]); path i32[B, P] (accepted node ids, root first), nacc[b] = m, start_out[b] = the old length
    (for commit), out_tokens i32[B, P+1] = [m, accepted drafts..., new bonus]; then lengths[b] += m and
    bonus[b] = the new bonus. The host reads only out_tokens."""
    b, lane = cuda.blockIdx.x, cuda.threadIdx.x
    N, P = tokens.shape[1], path.shape[1]
    n = ntok[b]
    cur, m = 0, 1
    if lane == 0:
        path[b, 0] = 0
    while True:
        want = post[b * N + cur]
        hit = int32(N)
        for c in range(cur + 1 + lane, n, 32):       # siblings differ: at most one child matches
            if parents[b, c] == cur and tokens[b, c] == want:
                hit = int32(c)
        for off in (16, 8, 4, 2, 1):
            hit = min(hit, shfl_xor(hit, int32(off)))
        if hit >= N or m >= P:
            break
        cur = hit
        if lane == 0:
            path[b, m] = cur
            out_tokens[b, m] = tokens[b, cur]
        m += 1
    if lane == 0:
        out_tokens[b, 0] = m
        out_tokens[b, m] = post[b * N + cur]
        nacc[b] = m
        start_out[b] = lengths[b]
        lengths[b] += m
        bonus[b] = post[b * N + cur]


@cuda.jit
def commit_kernel(cache, path, nacc, start):
    """Block per (layer, sequence): cache rows start+path[i] move to start+i (i < nacc), all rows read into
    shared memory before any is written. cache u32[layers, B, cap, D/2] (bf16 pairs); dynamic shared memory
    P*D/2 words. Bytes: 2 * 2D per accepted row per layer."""
    layer, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    D2 = cache.shape[3]
    buf = cuda.shared.array(0, uint32)
    s0, m = start[b], nacc[b]
    for i in range(1, m):
        src = s0 + path[b, i]
        for c in range(t, D2, nt):
            buf[i * D2 + c] = cache[layer, b, src, c]
    cuda.syncthreads()
    for i in range(1, m):
        if path[b, i] != i:
            for c in range(t, D2, nt):
                cache[layer, b, s0 + i, c] = buf[i * D2 + c]


@cuda.jit
def gather_kernel(hidden, path, nacc, start, feats, feat_pos):
    """Block per (accepted slot i, sequence b): feats[b, i] = concat_f hidden[f, b, path[b, i]] (the drafter
    context's new rows, target_layer_ids order) and feat_pos[b, i] = start[b] + i, for i < nacc[b].
    hidden f32[F, B, N, H] -> feats f32[B, P, F*H]."""
    i, b = cuda.blockIdx.x, cuda.blockIdx.y
    F, H = hidden.shape[0], hidden.shape[3]
    if i >= nacc[b]:
        return
    node = path[b, i]
    for c in range(cuda.threadIdx.x, F * H, cuda.blockDim.x):
        feats[b, i, c] = hidden[c // H, b, node, c % H]
    if cuda.threadIdx.x == 0:
        feat_pos[b, i] = start[b] + i


@dataclass
class TreeBuffers:
    """Every device buffer of one DDTree round for B sequences, L depths, K candidates, N = budget+1 nodes."""
    ids: object          # i32[B, L, K]
    lp: object           # f32[B, L, K]
    cand: object         # u64[B, L, C, K] top-K candidates per vocabulary chunk
    cstats: object       # f32[B, L, C, 2] per chunk: max, sum of exp(x - max)
    tokens: object       # i32[B, N]
    parents: object      # i32[B, N]
    depths: object       # i32[B, N]
    positions: object    # i32[B, N]
    vis: object          # u32[B, N, W]
    ntok: object         # i32[B]
    sample_seq: object   # i32[B*N]
    sample_pos: object   # i32[B*N]
    post: object         # i32[B*N]
    path: object         # i32[B, L+1]
    nacc: object         # i32[B]
    start: object        # i32[B]
    out_tokens: object   # i32[B, L+2]


def tree_buffers(zeros, B, L, K, N, V):
    """Allocate TreeBuffers for vocabulary V (zeros = np.zeros, cupy.zeros or a numba allocator)."""
    if K > TOPK_MAX or N > NODE_MAX or L > DEPTH_MAX or K > V:
        raise ValueError(f"tree_buffers: K {K} > min(V {V}, {TOPK_MAX}), N {N} > {NODE_MAX} or L {L} > {DEPTH_MAX}")
    i32, C = np.int32, topk_chunks(V, K)
    return TreeBuffers(zeros((B, L, K), i32), zeros((B, L, K), np.float32), zeros((B, L, C, K), np.uint64),
                       zeros((B, L, C, 2), np.float32), zeros((B, N), i32), zeros((B, N), i32),
                       zeros((B, N), i32), zeros((B, N), i32), zeros((B, N, -(-N // 32)), np.uint32),
                       zeros(B, i32), zeros(B * N, i32), zeros(B * N, i32), zeros(B * N, i32),
                       zeros((B, L + 1), i32), zeros(B, i32), zeros(B, i32), zeros((B, L + 2), i32))


def tree_topk(logits, tb: TreeBuffers):
    """top_logprobs for every (sequence, depth): logits f32[B, L, V] -> tb.ids i32[B, L, K], tb.lp f32[B, L, K]."""
    B, L, V = logits.shape
    C, K = tb.cand.shape[2], tb.cand.shape[3]
    if tb.ids.shape != (B, L, K) or C != topk_chunks(V, K):
        raise ValueError(f"tree_topk: logits {logits.shape} do not match buffers ids {tb.ids.shape}, "
                         f"{C} chunks (made for another vocabulary?)")
    if B and L:
        stream = current_stream()
        topk_part_kernel[(C, L, B), TOPK_THREADS, stream](logits, tb.cand, tb.cstats)
        topk_merge_kernel[(L, B), TOPK_THREADS, stream](logits, tb.cand, tb.cstats, tb.ids, tb.lp)


def build_smem(L, K, N):
    """Dynamic shared memory bytes of build_kernel."""
    return 40 * N + 4 * L * min(K, N)


def tree_build(tb: TreeBuffers, budgets, lengths, bonus, seq_ids):
    """build_tree for every sequence from tb.ids / tb.lp; budgets, lengths, bonus, seq_ids i32[B] on the device."""
    (B, L, K), N = tb.ids.shape, tb.tokens.shape[1]
    launch_smem(build_kernel, B, 32, build_smem(L, K, N),
                (tb.ids, tb.lp, budgets, lengths, bonus, seq_ids, tb.tokens, tb.parents, tb.depths, tb.positions,
                 tb.vis, tb.ntok, tb.sample_seq, tb.sample_pos))


def tree_walk(tb: TreeBuffers, lengths, bonus):
    """walk for every sequence from tb.post (the target's samples); advances lengths and bonus in place."""
    B = tb.tokens.shape[0]
    walk_kernel[B, WALK_THREADS, current_stream()](tb.tokens, tb.parents, tb.ntok, tb.post, lengths, bonus, tb.path,
                                                   tb.nacc, tb.start, tb.out_tokens)


def tree_commit(tb: TreeBuffers, cache, hidden=None, feats=None, feat_pos=None):
    """commit: move the accepted latent rows of every layer (cache u16[layers, B, cap, D]) and, with a drafter,
    gather the accepted nodes' features hidden f32[F, B, N, H] into feats f32[B, L+1, F*H] at feat_pos."""
    B, P = tb.path.shape
    launch_smem(commit_kernel, (cache.shape[0], B), 128, 2 * P * cache.shape[3],
                (cache.view(np.uint32), tb.path, tb.nacc, tb.start))
    if hidden is not None:
        gather_kernel[(tb.path.shape[1], B), 256, current_stream()](hidden, tb.path, tb.nacc, tb.start, feats,
                                                                    feat_pos)
