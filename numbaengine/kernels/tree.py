"""DDTree on the GPU: per-depth top-K, the best-first tree build, the walk and the commit, for a batch of sequences.

The reference is numbaengine.ddtree (top_logprobs, build_tree, walk, commit); the outputs here are identical given
the same candidate lists. Top-K: kernels.topk's histogram-threshold select (one block per vocabulary chunk and
depth, then one per depth). Build: the heap of the reference pops nodes in the total order (score descending, rank tuple
ascending) because every pushed entry ranks after the entry that pushed it (log-probs <= 0 and rounding is
monotone), so one warp per sequence pops the best frontier entry with a warp argmax under that order: no heap.
After each argmax the warp also pops, in one step, the run that provably follows: the popped entry's next
siblings (while each beats, by score key, the second-best entry and the popped entry's first child) or its chain
of first children (while each beats the second-best entry and the next siblings the chain leaves behind); ties
end a run, so runs never need the rank tuples. Every buffer is preallocated (TreeBuffers); per-round values
(lengths, bonus, budgets) live in device arrays.
"""
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32, uint32, uint64

from numbaengine.kernels.device import SIM, grid_dep, shfl_xor, syncwarp
from numbaengine.kernels.launch import kernel, launch, launch_smem
from numbaengine.kernels.sample import sample_work
from numbaengine.kernels.topk import (
    TOPK_MAX,
    TOPK_STAT,
    shfl_idx,
    shfl_xor64,
    topk_cap,
    topk_chunks,
    topk_launch,
)

NEG_INF64 = float64(-np.inf)
NODE_MAX = 1025                 # largest tree: MAX_BUDGET 1024 drafted nodes + the root
DEPTH_MAX = 64                  # largest L (drafter block size - 1)
VIS_WORDS = (NODE_MAX + 31) // 32
BUILD_THREADS = 64 if SIM else 256
WALK_THREADS = 32

if SIM:
    def _f64_bits(x):
        return np.uint64(np.array([x], np.float64).view(np.uint64)[0])
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline="always")
    def _f64_bits(x):
        return uint64(libdevice.double_as_longlong(x))


if SIM:
    from numbaengine.kernels.sim import collective

    def _ballot(pred):
        bits, _ = collective(bool(pred), lambda preds: sum(1 << i for i, p in enumerate(preds) if p))
        return np.uint32(bits)
else:
    @cuda.jit(device=True, inline="always")
    def _ballot(pred):
        return uint32(cuda.ballot_sync(0xFFFFFFFF, pred))


@cuda.jit(device=True, inline="always")
def _trailing_ones(bits):
    """Consecutive set bits of a uint32 from bit 0 (bit 31 clear)."""
    return int32(cuda.popc(uint32(bits) ^ (uint32(bits) + uint32(1)))) - 1


@cuda.jit(device=True, inline="always")
def _score_key(s):
    """uint64 key of a float64 score, larger = higher score, equal keys = equal scores (-0.0 as +0.0); > 0."""
    u = _f64_bits(s + float64(0))
    return ~u if (u >> uint64(63)) != uint64(0) else u | (uint64(1) << uint64(63))


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
def _tie_break(fkey, top, live, fpar, frank, fdepth, npar, nrank):
    """The slot, among the frontier entries with score key `top`, of the smallest rank tuple (every lane scans:
    rare, only on equal scores)."""
    be = int32(-1)
    for e in range(live):
        if fkey[e] == top and (be < 0 or _ranks_less(int32(e), be, fpar, frank, fdepth, npar, nrank)):
            be = int32(e)
    return be


@cuda.jit(device=True, inline="always")
def _write_nodes(b, t, nt, nodes, start, N, W, ids, bonus, seq_ids, npar, ndepth, nrank, nscore, tokens, parents,
                 depths, positions, vis, sample_seq, sample_pos, scores):
    """build_kernel's output rows of sequence b from its node arrays (every thread of the block, rows t, t + nt,
    ...): tokens, parents, depths, positions, path scores, the sampling keys, and the visibility bits (one walk to
    the root per node); rows past `nodes` are padding (score -inf)."""
    for i in range(t, N, nt):
        live_i = i < nodes
        dep = ndepth[i] if live_i else 0
        scores[b, i] = nscore[i] if live_i else NEG_INF64
        tok = 0
        if i == 0:
            tok = bonus[b]
        elif live_i:
            tok = ids[b, dep - 1, nrank[i]]
        tokens[b, i] = tok
        parents[b, i] = npar[i] if live_i else -1
        depths[b, i] = dep
        positions[b, i] = start + dep
        sample_seq[b * N + i] = seq_ids[b]
        sample_pos[b * N + i] = start + dep + 1
    words = cuda.local.array(VIS_WORDS, uint32)
    for i in range(t, N, nt):                        # ancestor-or-self bits: one walk to the root per node
        for w in range(W):
            words[w] = uint32(0)
        j = i if i < nodes else -1
        while j >= 0:
            words[j >> 5] |= uint32(1) << uint32(j & 31)
            j = npar[j]
        for w in range(W):
            vis[b, i, w] = words[w]


@cuda.jit(device=True, inline="always")
def _stage_lps(lp, lps, b, t, nt, n, kc):
    """lp[b, :, :kc] -> lps f32[n = L kc] in shared memory, four loads in flight per thread."""
    ws = cuda.local.array(4, float32)
    for i0 in range(t, n, 4 * nt):
        for u in range(4):
            i = i0 + u * nt
            if i < n:
                ws[u] = lp[b, i // kc, i % kc]
        for u in range(4):
            if i0 + u * nt < n:
                lps[i0 + u * nt] = ws[u]


@cuda.jit(device=True, inline="always")
def _root(live, lps, nscore, npar, ndepth, nrank, fscore, fpar, fdepth, frank, fkey):
    """Node 0 is the root (score 0); with a budget the frontier holds its first child (depth 1, rank 0)."""
    nscore[0], npar[0], ndepth[0], nrank[0] = float64(0), -1, 0, 0
    if live:
        fscore[0], fpar[0], fdepth[0], frank[0] = float64(lps[0]), 0, 1, 0
        fkey[0] = _score_key(fscore[0])


@cuda.jit(device=True, inline="always")
def _push(add, lane, live, be, g, K, es, ep, ed, er, ps, lps, row, fscore, fkey, fpar, fdepth, frank):
    """The frontier after a pop (warp 0, every lane): lanes with `add` append entry (es, ep, ed, er); the popped
    slot be takes its group's next sibling g (parent score ps + lps[row + g]) while g < K, else the last entry
    (when nothing joins).
    Returns the new frontier size."""
    bits = _ballot(add)
    new = int32(cuda.popc(bits))
    if add:                                   # the popped entry's slot is reused when its group ends
        idx = int32(cuda.popc(bits & ((uint32(1) << uint32(lane)) - uint32(1))))
        e = live + idx if g < K else (be if idx == 0 else live + idx - 1)
        fscore[e], fkey[e], fpar[e], fdepth[e], frank[e] = es, _score_key(es), ep, ed, er
    if lane == 0:
        if g < K:                             # the group's next sibling stays in the popped slot
            gs = ps + float64(lps[row + g])
            fscore[be], fkey[be], frank[be] = gs, _score_key(gs), g
        elif new == 0:                        # the group ends and nothing joins: the last entry moves
            j = live - 1
            fscore[be], fkey[be], fpar[be] = fscore[j], fkey[j], fpar[j]
            fdepth[be], frank[be] = fdepth[j], frank[j]
    return live + (new - (0 if g < K else 1))


@kernel()
def build_kernel(ids, lp, budgets, lengths, bonus, seq_ids, tokens, parents, depths, positions, vis, ntok,
                 sample_seq, sample_pos, scores):
    """Block per sequence b (BUILD_THREADS): warp 0 pops the budgets[b] best prefixes of the candidate lists
    ids/lp i32/f32[B, L, K] in the reference heap's pop order (scores summed root to leaf in float64, compared
    as uint64 keys; rank tuples only on equal scores), one argmax plus a sibling or chain run (up to 31 more
    pops) per step (module docstring), then the block writes tokens, parents, depths, positions
    (= lengths[b] + depth) i32[B, N], vis u32[B, N, W] (bit j of row i: node j is i or an ancestor),
    ntok[b] = nodes incl. the root, per node the sampling keys sample_seq / sample_pos (= position + 1)
    i32[B*N] and its path log-probability scores f64[B, N] (budget auto's expected acceptance). Rows past
    ntok[b] are padding (token 0, parent -1, no visibility, score -inf). Dynamic shared memory (build_smem):
    frontier and node arrays (48 B per node) and lp[b, :, :min(K, N)]. Launch: grid B, block BUILD_THREADS.
    Moves lp[b, :, :min(K, N)] (4 L min(K, N) bytes) and the N popped ids in, N*(8 + W)*4 out."""
    grid_dep()
    b, t, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    lane = t & 31
    L, K = ids.shape[1], ids.shape[2]
    N, W = tokens.shape[1], vis.shape[2]
    kc = min(K, N)
    d64 = cuda.shared.array(0, float64)
    du64 = cuda.shared.array(0, uint64)
    d32 = cuda.shared.array(0, int32)
    dff = cuda.shared.array(0, float32)
    fscore, nscore, fkey = d64[0:N], d64[N:2 * N], du64[2 * N:3 * N]   # frontier (the heap's content) / nodes
    fpar, fdepth, frank = d32[6 * N:7 * N], d32[7 * N:8 * N], d32[8 * N:9 * N]
    npar, ndepth, nrank = d32[9 * N:10 * N], d32[10 * N:11 * N], d32[11 * N:12 * N]
    lps = dff[12 * N:12 * N + L * kc]                    # the ranks a tree of N nodes can reach
    nsh = cuda.shared.array(1, int32)
    _stage_lps(lp, lps, b, t, nt, L * kc, kc)
    budget = min(budgets[b], N - 1)
    live = 1 if budget > 0 and L > 0 and K > 0 else 0
    cuda.syncthreads()
    if t == 0:
        _root(live, lps, nscore, npar, ndepth, nrank, fscore, fpar, fdepth, frank, fkey)
    nodes = 1
    if t < 32:                                          # warp 0: the pops
        syncwarp()
        while nodes <= budget and live > 0:
            bk, be, sk = uint64(0), int32(-1), uint64(0)   # best key and its slot, the second-best key
            for e in range(lane, live, 32):
                k = fkey[e]
                if k > bk:
                    sk, bk, be = bk, k, int32(e)
                elif k > sk:
                    sk = k
            top = bk
            for off in (16, 8, 4, 2, 1):              # warp top-2 of the keys (equal keys: second = best)
                ok, os_ = shfl_xor64(top, int32(off)), shfl_xor64(sk, int32(off))
                sk = max(min(top, ok), max(sk, os_))
                top = max(top, ok)
            owner = _ballot(bk == top)
            if sk < top:                              # one entry has the best score: it pops
                be = shfl_idx(be, int32(cuda.ffs(owner) - 1))
            else:                                     # equal best scores: the smallest rank tuple pops
                be = _tie_break(fkey, top, live, fpar, frank, fdepth, npar, nrank)
            par, dep, rk, sc = fpar[be], fdepth[be], frank[be], fscore[be]
            n0, room, ps, row = nodes, min(budget - nodes, 31), nscore[par], (dep - 1) * kc
            ck = _score_key(sc + float64(lps[dep * kc])) if dep < L else uint64(0)       # first child
            gk = _score_key(ps + float64(lps[row + rk + 1])) if rk + 1 < K else uint64(0)  # next sibling
            # a run: the next pops need no argmax while each beats, by key, every other entry there will be
            s = float64(0)                            # sibling run: lane l pops sibling rk+1+l too
            hit = False
            if lane < room and rk + 1 + lane < K:
                s = ps + float64(lps[row + rk + 1 + lane])
                hit = _score_key(s) > max(sk, ck)
            run = _trailing_ones(_ballot(hit))
            chain = run == 0 and ck > max(sk, gk)
            cs, cand = sc, float64(0)                 # chain run: lane l pops c_(l+1), the first child of c_l
            if chain:
                hit = False
                if dep + lane < L:
                    bound = max(sk, gk)
                    for i in range(lane):             # the next siblings of c_1..c_lane join the frontier
                        if K > 1:
                            bound = max(bound, _score_key(cs + float64(lps[(dep + i) * kc + 1])))
                        cs = cs + float64(lps[(dep + i) * kc])
                    cand = cs + float64(lps[(dep + lane) * kc])
                    hit = lane < room and _score_key(cand) > bound
                run = _trailing_ones(_ballot(hit))
            syncwarp()                               # every lane has read the frontier: write
            if lane == 0:
                nscore[n0], npar[n0], ndepth[n0], nrank[n0] = sc, par, dep, rk
            if chain:                                 # node c_(l+1); entries: sibling of c_(l+1), child of c_run
                if lane < run:
                    n = n0 + 1 + lane
                    nscore[n], npar[n], ndepth[n], nrank[n] = cand, n0 + lane, dep + 1 + lane, 0
                add = (lane < run and K > 1) or (lane == run and dep + run < L)
                es = cs + float64(lps[(dep + lane) * kc + 1]) if add and lane < run else cand
                ep, ed, er = n0 + lane, dep + 1 + lane, (1 if lane < run else 0)
                g = rk + 1
            else:                                     # node: sibling rk+1+l; entries: child of every node
                if lane < run:
                    n = n0 + 1 + lane
                    nscore[n], npar[n], ndepth[n], nrank[n] = s, par, dep, rk + 1 + lane
                add = lane <= run and dep < L
                es = float64(0)
                if add:
                    es = (sc if lane == 0 else ps + float64(lps[row + rk + lane])) + float64(lps[dep * kc])
                ep, ed, er = n0 + lane, dep + 1, 0
                g = rk + 1 + run
            live = _push(add, lane, live, be, g, K, es, ep, ed, er, ps, lps, row, fscore, fkey, fpar, fdepth, frank)
            nodes = n0 + 1 + run
            syncwarp()
        if t == 0:
            nsh[0] = nodes
    cuda.syncthreads()
    nodes = nsh[0]
    _write_nodes(b, t, nt, nodes, lengths[b], N, W, ids, bonus, seq_ids, npar, ndepth, nrank, nscore, tokens,
                 parents, depths, positions, vis, sample_seq, sample_pos, scores)
    if t == 0:
        ntok[b] = nodes


@kernel()
def walk_kernel(tokens, parents, ntok, post, lengths, bonus, path, nacc, start_out, out_tokens):
    """One warp per sequence: follow the children whose token equals the target's sample post[b*N + node]
    (i32[B*N]); path i32[B, P] (accepted node ids, root first), nacc[b] = m, start_out[b] = the old length
    (for commit), out_tokens i32[B, P+1] = [m, accepted drafts..., new bonus]; then lengths[b] += m and
    bonus[b] = the new bonus. The host reads only out_tokens. Launch: grid B, block 32. Moves the walked
    nodes' rows of tokens and parents (at most the whole tree: N*8 bytes) and their samples in, P*12 out."""
    grid_dep()
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


COMMIT_THREADS = 64 if SIM else 256
GATHER_THREADS = 64 if SIM else 256


@kernel()
def commit_kernel(cache, path, nacc, start):
    """Block per (layer, sequence): cache rows start+path[i] move to start+i (0 < i < nacc), all rows read into
    shared memory before any is written, four independent loads in flight per thread. cache u32[layers, B, cap,
    D/2] (bf16 pairs); dynamic shared memory P*D/2 words. Bytes: 2 * 2D per accepted row per layer."""
    grid_dep()
    layer, b = cuda.blockIdx.x, cuda.blockIdx.y
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    D2 = cache.shape[3]
    buf = cuda.shared.array(0, uint32)
    s0, m = start[b], nacc[b]
    n = (m - 1) * D2                                   # words of rows 1..m-1, row-major
    for k in range(t, n, 4 * nt):
        w = cuda.local.array(4, uint32)
        for u in range(4):
            ku = k + u * nt
            if ku < n:
                w[u] = cache[layer, b, s0 + path[b, 1 + ku // D2], ku % D2]
        for u in range(4):
            if k + u * nt < n:
                buf[k + u * nt] = w[u]
    cuda.syncthreads()
    for k in range(t, n, nt):
        i = 1 + k // D2
        if path[b, i] != i:
            cache[layer, b, s0 + i, k % D2] = buf[k]


@kernel()
def gather_kernel(hidden, path, nacc, start, feats, feat_pos, base, done, track):
    """Block per (column chunk, accepted slot i, sequence b), 4 * blockDim columns per block: row r = i + start[b]
    - base[b] of feats gets concat_f hidden[f, b, path[b, i]] (the drafter context's new rows, target_layer_ids
    order) and feat_pos[b, r] = start[b] + i, for i < nacc[b] and r < P; base = start: rows from 0, else the rows
    of a backlog that starts at context row base[b]. track: done[b] = start[b] + nacc[b] (the context rows made
    whole by this round). hidden f32[F, B, N, H] -> feats f32[B, P, F*H]. Bytes: 2 * 4 * F*H per accepted row."""
    grid_dep()
    g, i, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    F, H = hidden.shape[0], hidden.shape[3]
    if track and g == 0 and i == 0 and t == 0:
        done[b] = start[b] + nacc[b]
    r = i + start[b] - base[b]
    if i >= nacc[b] or r < 0 or r >= feats.shape[1]:
        return
    node = path[b, i]
    w = cuda.local.array(4, float32)
    for u in range(4):                                 # four independent loads in flight per thread
        c = (4 * g + u) * nt + t
        if c < F * H:
            w[u] = hidden[c // H, b, node, c % H]
    for u in range(4):
        c = (4 * g + u) * nt + t
        if c < F * H:
            feats[b, r, c] = w[u]
    if g == 0 and t == 0:
        feat_pos[b, r] = start[b] + i


@dataclass
class TreeBuffers:
    """Every device buffer of one DDTree round for B sequences, L depths, K candidates, N = budget+1 nodes."""
    ids: object          # i32[B, L, K]
    lp: object           # f32[B, L, K]
    cand: object         # u64[B, L, C, topk_cap(K)] top-K candidates per vocabulary chunk (order keys)
    cstats: object       # f32[B, L, TOPK_STAT + 3C] row histogram (zero between calls), per chunk: max, sum, count
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
    sample_work: object  # u64[B*N, SAMPLE_CHUNKS] kernels.sample.sample's workspace for the B*N node rows
    scores: object       # f64[B, N] path log-probability of each node (pop order), -inf past ntok


def tree_buffers(zeros, B, L, K, N, V, topk=None):
    """Allocate TreeBuffers for vocabulary V (zeros = np.zeros, cupy.zeros or a numba allocator); topk: buffers
    whose top-K part (ids, lp, cand, cstats) these share (trees of another size over the same candidate lists)."""
    if K > TOPK_MAX or N > NODE_MAX or L > DEPTH_MAX or K > V:
        raise ValueError(f"tree_buffers: K {K} > min(V {V}, {TOPK_MAX}), N {N} > {NODE_MAX} or L {L} > {DEPTH_MAX}")
    i32, C = np.int32, topk_chunks(V, K)
    if topk is not None and topk.ids.shape != (B, L, K):
        raise ValueError(f"tree_buffers: shared top-K lists {topk.ids.shape} are not [{B}, {L}, {K}]")
    part = ((topk.ids, topk.lp, topk.cand, topk.cstats) if topk is not None else
            (zeros((B, L, K), i32), zeros((B, L, K), np.float32), zeros((B, L, C, topk_cap(K)), np.uint64),
             zeros((B, L, TOPK_STAT + 3 * C), np.float32)))
    return TreeBuffers(*part, zeros((B, N), i32), zeros((B, N), i32),
                       zeros((B, N), i32), zeros((B, N), i32), zeros((B, N, -(-N // 32)), np.uint32),
                       zeros(B, i32), zeros(B * N, i32), zeros(B * N, i32), zeros(B * N, i32),
                       zeros((B, L + 1), i32), zeros(B, i32), zeros(B, i32), zeros((B, L + 2), i32),
                       sample_work(zeros, B * N), zeros((B, N), np.float64))


def tree_topk(logits, tb: TreeBuffers):
    """top_logprobs for every (sequence, depth): logits f32[B, L, V] -> tb.ids i32[B, L, K], tb.lp f32[B, L, K]."""
    B, L, V = logits.shape
    C, K = tb.cand.shape[2], tb.ids.shape[2]
    if tb.ids.shape != (B, L, K) or C != topk_chunks(V, K) or tb.cstats.shape[2] != TOPK_STAT + 3 * C:
        raise ValueError(f"tree_topk: logits {logits.shape} do not match buffers ids {tb.ids.shape}, "
                         f"{C} chunks (made for another vocabulary?)")
    if B and L:
        topk_launch(logits, tb.cand, tb.cstats, tb.ids, tb.lp)


def build_smem(L, K, N):
    """Dynamic shared memory bytes of build_kernel."""
    return 48 * N + 4 * L * min(K, N)


def tree_build(tb: TreeBuffers, budgets, lengths, bonus, seq_ids):
    """build_tree for every sequence from tb.ids / tb.lp; budgets, lengths, bonus, seq_ids i32[B] on the device."""
    (B, L, K), N = tb.ids.shape, tb.tokens.shape[1]
    smem = build_smem(L, K, N)
    launch_smem(build_kernel, B, BUILD_THREADS, smem if smem + 64 <= 48 * 1024 else max(smem, 48 * 1024 + 8),
                (tb.ids, tb.lp, budgets, lengths, bonus, seq_ids, tb.tokens, tb.parents, tb.depths, tb.positions,
                 tb.vis, tb.ntok, tb.sample_seq, tb.sample_pos, tb.scores))


def tree_walk(tb: TreeBuffers, lengths, bonus):
    """walk for every sequence from tb.post (the target's samples); advances lengths and bonus in place."""
    B = tb.tokens.shape[0]
    launch(walk_kernel, B, WALK_THREADS, tb.tokens, tb.parents, tb.ntok, tb.post, lengths, bonus, tb.path, tb.nacc,
           tb.start, tb.out_tokens)


def tree_commit(tb: TreeBuffers, cache, hidden=None, feats=None, feat_pos=None, ctx_from=None, backlog=False):
    """commit: move the accepted latent rows of every layer (cache u16[layers, B, cap, D], or its bf16-pair view
    u32[layers, B, cap, D/2]: a slot prefix of a larger cache) and, with a drafter, gather the accepted nodes'
    features hidden f32[F, B, N, H] into feats f32[B, L+1, F*H] at feat_pos. ctx_from i32[B] (budget auto's first
    context row not yet in the drafter context): set past this round's rows; or, backlog, feats f32[B, R, F*H] is
    the backlog of rows from ctx_from on and this round's rows go to their places in it (a coasting round)."""
    B, P = tb.path.shape
    words = cache if cache.dtype == np.uint32 else cache.view(np.uint32)
    launch_smem(commit_kernel, (cache.shape[0], B), COMMIT_THREADS, 4 * P * words.shape[3],
                (words, tb.path, tb.nacc, tb.start))
    if hidden is not None:
        chunks = -(-hidden.shape[0] * hidden.shape[3] // (4 * GATHER_THREADS))
        base = ctx_from if backlog else tb.start
        done = ctx_from if ctx_from is not None else tb.start       # (not written without ctx_from)
        launch(gather_kernel, (chunks, P, B), GATHER_THREADS, hidden, tb.path, tb.nacc, tb.start, feats, feat_pos,
               base, done, ctx_from is not None and not backlog)
