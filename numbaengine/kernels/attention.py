"""Softmax attention with an explicit visibility mask; GQA/MQA when k has fewer heads than q.

One op (reference.attention_ref on the host) serves every attention of the engine: MLA prefill (naive form,
hk = h), MLA decode and tree verify in the absorbed form (MQA over the latent cache: hk = 1, d = kv_lora + rope,
v = the c_kv part), and the DFlash drafter (GQA, no mask).
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from numbaengine.kernels.device import (
    LOG2E,
    NEG_INF,
    SIM,
    as_f32,
    device,
    grid_dep,
    ld4,
    ld16,
    ld_quad,
    mma_bf16,
)
from numbaengine.kernels.launch import (
    data_ptr,
    elem_strides,
    kernel,
    launch,
    launch_smem,
    placeholder,
    strided,
)
from numbaengine.kernels.mma import frag_a, frag_bn, frag_bt, to_bf16

# Flash-decoding: a block per (kv head, tile of query rows, split of the keys) writes an unnormalized partial
# (o, max, sum); merge_splits combines the splits. With one split the block writes the normalized rows directly.

if SIM:
    from numbaengine.kernels.device import shfl_xor
else:
    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, mask):
        """device.shfl_xor inlined in numba IR (compile_ptx of NVVM-inlined device functions needs a GPU)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, mask)
ATT_THREADS = 128          # threads per block
ATT_ROWS = 8               # query rows (query, head) per block
ATT_KEYS = 16              # keys staged in shared memory per step: ATT_ROWS * ATT_KEYS == ATT_THREADS
ATT_DMAX = 256             # largest q/k and v head dim
ATT_KPAD = ATT_DMAX + 1       # padded key rows: no bank conflicts across keys
ATT_ACC = ATT_ROWS * ATT_DMAX // ATT_THREADS


@kernel()
def attention_split_kernel(q, k, v, kv_len, has_len, vis, has_vis, scale, split, normalize, o_part, ml_part):
    """One (split, row tile, sequence * kv head) per block, ATT_THREADS threads: rows r = i*g + gh of kv head j are
    query i, head j*g + gh. q f32[B, n, h, d], k f32[B, S, hk, d], v f32[B, S, hk, dv]; sequence b sees keys
    [0, kv_len[b]) (read on the device when has_len, else all S); vis bool[n, S] (read when has_vis; B = 1).
    Writes o_part f32[B, nsplit, n*h, dv] (unnormalized) and ml_part f32[B, nsplit, n*h, 2] (max, sum) of keys
    [s*split, (s+1)*split) (a split past kv_len[b] writes the neutral (0, -inf, 0)); normalize=1 (one split):
    o_part[b, 0] = the attention output. Grid (nsplit, ceil(n*g / ATT_ROWS), B*hk). Bytes: K/V of the split once
    per row tile (L2), q rows once; keys past kv_len[b] are never read."""
    grid_dep()
    n, h, d = q.shape[1], q.shape[2], q.shape[3]
    S, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hk
    s, tile = cuda.blockIdx.x, cuda.blockIdx.y
    b, j = cuda.blockIdx.z // hk, cuda.blockIdx.z % hk
    t = cuda.threadIdx.x
    qs = cuda.shared.array((ATT_ROWS, ATT_DMAX), float32)
    ks = cuda.shared.array((ATT_KEYS, ATT_KPAD), float32)
    vs = cuda.shared.array((ATT_KEYS, ATT_DMAX), float32)
    sc = cuda.shared.array((ATT_ROWS, ATT_KEYS), float32)
    stat = cuda.shared.array((3, ATT_ROWS), float32)          # running max, running sum, rescale factor
    acc = cuda.local.array(ATT_ACC, float32)
    for u in range(ATT_ACC):
        acc[u] = float32(0)
    r0 = tile * ATT_ROWS
    for rr in range(ATT_ROWS):                                # stage the q rows
        r = r0 + rr
        qi, qh = r // g, j * g + r % g
        for c in range(t, d, ATT_THREADS):
            qs[rr, c] = q[b, qi, qh, c] if r < n * g else float32(0)
    if t < ATT_ROWS:
        stat[0, t] = NEG_INF
        stat[1, t] = float32(0)
    if has_len:
        S = min(S, kv_len[b])
    lo = s * split
    hi = min(lo + split, S)
    rr, kk = t // ATT_KEYS, t % ATT_KEYS
    r = r0 + rr
    vis_row = r // g
    for c0 in range(lo, hi, ATT_KEYS):
        cuda.syncthreads()
        for kr in range(ATT_KEYS):                            # stage keys and values of this step
            live = c0 + kr < hi
            for c in range(t, d, ATT_THREADS):
                ks[kr, c] = k[b, c0 + kr, j, c] if live else float32(0)
            for c in range(t, dv, ATT_THREADS):
                vs[kr, c] = v[b, c0 + kr, j, c] if live else float32(0)
        cuda.syncthreads()
        key = c0 + kk                                         # score of (row rr, key kk)
        ok = key < hi and r < n * g
        if ok and has_vis:
            ok = vis[vis_row, key]
        x = NEG_INF
        if ok:
            x = float32(0)
            for c in range(d):
                x += qs[rr, c] * ks[kk, c]
            x *= scale
        sc[rr, kk] = x
        cuda.syncthreads()
        if t < ATT_ROWS:                                      # online softmax, one thread per row
            m_old = stat[0, t]
            m = m_old
            for c in range(ATT_KEYS):
                m = max(m, sc[t, c])
            alpha = float32(1)
            total = float32(0)
            if m != NEG_INF:
                alpha = math.exp(m_old - m)
                for c in range(ATT_KEYS):
                    p = math.exp(sc[t, c] - m)
                    sc[t, c] = p
                    total += p
            else:
                for c in range(ATT_KEYS):
                    sc[t, c] = float32(0)
            stat[0, t] = m
            stat[1, t] = stat[1, t] * alpha + total
            stat[2, t] = alpha
        cuda.syncthreads()
        u = 0
        for pr in range(ATT_ROWS):                            # o = o * alpha + p @ v
            alpha = stat[2, pr]
            for c in range(t, dv, ATT_THREADS):
                y = acc[u] * alpha
                for c1 in range(ATT_KEYS):
                    y += sc[pr, c1] * vs[c1, c]
                acc[u] = y
                u += 1
    cuda.syncthreads()
    u = 0
    for pr in range(ATT_ROWS):
        r = r0 + pr
        row = (r // g) * h + j * g + r % g
        for c in range(t, dv, ATT_THREADS):
            if r < n * g:
                y = acc[u]
                if normalize:
                    y = y / stat[1, pr] if stat[1, pr] > float32(0) else float32(0)
                o_part[b, s, row, c] = y
                if c == 0 and not normalize:
                    ml_part[b, s, row, 0] = stat[0, pr] * LOG2E             # log2 units for merge_splits
                    ml_part[b, s, row, 1] = stat[1, pr]
            u += 1


@dataclass(frozen=True)
class MergeConfig:
    """merge_splits' launch shape rule (merge_shape): the defaults are what the engine runs."""
    rows: int = 4            # rows per merge block at <= `rows` splits: their loads are in flight together
    groups: int = 8          # above that, one row per block, up to this many split groups (a tree of folds) ...
    splits: int = 4          # ... up to this many of a thread's splits loaded together ...
    cols: int = 32           # ... and this many column quads per block: a row's r/4 quads over r/(4 cols) blocks
    wave_threads: int = 132 * 2048   # ... and no more groups than keep the launch within one wave of threads
    # (H200, 64 heads, 16K x batch 16, 8 splits, mla_attention with its split kernel: 103.3 us = 68.3% of copy with
    # the rule, 112.6 us = 63.2% with 8 groups of one split; H100: 128.3 against 137.2 us)


MERGE_DEFAULT = MergeConfig()


@device
def _fold(acc, k, ms, ls, u0, u1, u2, u3):
    """Online merge of one partial (max ms in log2 units, sum ls, 4 values) into acc[k] = (y0..y3, den, max)."""
    if ms != NEG_INF:
        mx = acc[k, 5]
        mn = max(mx, ms)
        a, wgt = math.exp2(mx - mn), math.exp2(ms - mn)
        acc[k, 4] = acc[k, 4] * a + ls * wgt
        acc[k, 0], acc[k, 1] = acc[k, 0] * a + u0 * wgt, acc[k, 1] * a + u1 * wgt
        acc[k, 2], acc[k, 3] = acc[k, 2] * a + u2 * wgt, acc[k, 3] * a + u3 * wgt
        acc[k, 5] = mn


@functools.cache
def merge_kernel(RB, SU=1):
    """merge_splits_kernel for RB rows per block, or one row (RB = 1) and SU of a thread's splits per load round
    (compiled once per pair)."""
    if SU > 1 and RB != 1:
        raise ValueError(f"merge_kernel: {SU} splits per round need one row per block, not {RB}")

    @kernel(max_registers=64)                    # up to 1024 threads per block
    def merge_splits_kernel(o_part, ml_part, out):
        """Flash-decoding merge: out[b, m] = sum_s 2^(max_s - max) o_part[b, s, m] / sum_s 2^(max_s - max) sum_s
        (maxes in log2 units). Block (RB rows from m0, sequence b, X column quads of chunk z) of (X, G) threads:
        thread (x, y) folds splits y, y+G, ... of each row for its 4 columns (16-byte loads, an online max: one
        pass), the loads of RB rows x SU of its splits in flight together, then folded in split order; the G
        partial folds meet in shared memory as a tree (log2 G rounds). H200, 65 splits of 8 rows of 512 (batch-1
        decode, 8 heads): blocks of (128, 8) threads, one per row, took 12.2K cycles (ncu: 32 warps of ~670
        instructions on each of 8 SMs); (32, 32) threads over 4 column blocks per row 15.3K (each block as many
        instructions, 4x the work); (32, 8) over 4 column blocks (the default): the whole 4K x 8-head decode
        (split kernel + merge, graph) 13.94 us against 15.37 with (128, 8). o_part f32 or bf16 (u16 bits: ld_quad widens
        them) [B, nsplit, M, r] and ml_part f32[B, nsplit, M, 2] contiguous (r % 4X == 0), out f32[B, M, r] (any
        strides); rows whose splits saw no key get 0. Bytes: the partials once, the output once."""
        grid_dep()
        x, y = cuda.threadIdx.x, cuda.threadIdx.y
        X, G = cuda.blockDim.x, cuda.blockDim.y
        nsplit, M, r = o_part.shape[1], o_part.shape[2], o_part.shape[3]
        m0, b = cuda.blockIdx.x * RB, cuda.blockIdx.y
        c = 4 * (cuda.blockIdx.z * X + x)              # this thread's first column
        red = cuda.shared.array(0, float32)
        acc = cuda.local.array((RB, 6), float32)        # per row: y0..y3, den, max (registers)
        got = cuda.local.array((SU, 6), float32)        # one load round (RB = 1): max, sum, 4 values each
        for k in range(RB):
            for j in range(5):
                acc[k, j] = float32(0)
            acc[k, 5] = NEG_INF
        for s0 in range(y, nsplit, G * SU):       # online over this thread's splits, SU per round
            if SU == 1:                           # fold each row as it loads (staging RB = 4 rows spills at 64 regs)
                for k in range(RB):               # rows past M re-read row M - 1 (never written)
                    row = (b * nsplit + s0) * M + min(m0 + k, M - 1)     # flat row of o_part / ml_part
                    ms, ls = as_f32(ld4(ml_part, 2 * row)), as_f32(ld4(ml_part, 2 * row + 1))
                    u0, u1, u2, u3 = ld_quad(o_part, row * r + c)
                    _fold(acc, k, ms, ls, as_f32(u0), as_f32(u1), as_f32(u2), as_f32(u3))
                continue
            for u in range(SU):                   # one row (RB = 1): SU splits' loads, then their folds
                s = min(s0 + u * G, nsplit - 1)   # a round past the last split re-reads it (not folded)
                row = (b * nsplit + s) * M + min(m0, M - 1)
                got[u, 0], got[u, 1] = as_f32(ld4(ml_part, 2 * row)), as_f32(ld4(ml_part, 2 * row + 1))
                u0, u1, u2, u3 = ld_quad(o_part, row * r + c)
                got[u, 2], got[u, 3], got[u, 4], got[u, 5] = as_f32(u0), as_f32(u1), as_f32(u2), as_f32(u3)
            for u in range(SU):
                if s0 + u * G < nsplit:
                    _fold(acc, 0, got[u, 0], got[u, 1], got[u, 2], got[u, 3], got[u, 4], got[u, 5])
        yu, Gu, step = uint32(y), uint32(G), uint32(1)   # unsigned 32-bit: no int64 / uint64 compare (float64)
        while step < Gu:                          # tree: group y takes group y + step's folds (y % 2 step == 0)
            span = uint32(step + step)
            low = uint32(yu & uint32(span - uint32(1)))
            if low == step:
                o = uint32(6 * RB * (y * X + x))
                for k in range(RB):
                    for j in range(6):
                        red[o + 6 * k + j] = acc[k, j]
            cuda.syncthreads()                    # the next round writes other slots than this one reads
            if low == uint32(0) and uint32(yu + step) < Gu:
                o = uint32(6 * RB * ((y + step) * X + x))
                for k in range(RB):
                    _fold(acc, k, red[o + 6 * k + 5], red[o + 6 * k + 4], red[o + 6 * k], red[o + 6 * k + 1],
                          red[o + 6 * k + 2], red[o + 6 * k + 3])
            step = span
        if y == 0:
            for k in range(RB):
                if m0 + k < M:
                    den = acc[k, 4]
                    inv = float32(1) / den if den > float32(0) else float32(0)
                    out[b, m0 + k, c], out[b, m0 + k, c + 1] = acc[k, 0] * inv, acc[k, 1] * inv
                    out[b, m0 + k, c + 2], out[b, m0 + k, c + 3] = acc[k, 2] * inv, acc[k, 3] * inv
    return merge_splits_kernel


def merge_shape(B, nsplit, M, r, cfg=MERGE_DEFAULT):
    """merge_splits' launch shape for partials [B, nsplit, M, r] -> (rows per block, split groups, a thread's splits
    per load round, column quads per block X). Where the splits are few (<= cfg.rows, 48 KB of shared memory)
    cfg.rows rows per block of (r/4, nsplit) threads; else one row per block, its columns over r / (4 cfg.cols)
    blocks (where r/4 divides), min(cfg.groups, nsplit) split groups, but no more than keep the B M r/4 quads'
    threads within cfg.wave_threads (many rows: a thread takes more splits), and up to cfg.splits of a thread's
    splits loaded per round."""
    if r % 4:
        raise ValueError(f"merge_splits: value width {r} is not a multiple of 4 (16-byte partial loads)")
    if nsplit <= cfg.rows and 24 * cfg.rows * r // 4 * nsplit <= 48 * 1024:
        return cfg.rows, nsplit, 1, r // 4
    X = cfg.cols if (r // 4) % cfg.cols == 0 else r // 4
    groups = max(1, min(nsplit, cfg.groups, 1024 // X, cfg.wave_threads // (B * M * r // 4)))
    return 1, groups, min(cfg.splits, -(-nsplit // groups)), X


def merge_splits(o_part, ml_part, out, cfg=MERGE_DEFAULT):
    """One launch of merge_splits_kernel over the partials o_part f32 or bf16 [B, nsplit, M, r], ml_part
    f32[B, nsplit, M, 2] into out f32[B, M, r], shaped by merge_shape. Shared memory: 24 bytes per thread and row."""
    B, nsplit, M, r = o_part.shape
    rows, groups, per_round, X = merge_shape(B, nsplit, M, r, cfg)
    launch(merge_kernel(rows, per_round), (-(-M // rows), B, r // (4 * X)), (X, groups), o_part, ml_part, out,
           shmem=24 * rows * X * groups)


class AttnWork:
    """Flash-decoding scratch for `attention` / `kv_attention`: keys per split and the partial buffers
    o f32[B, nsplit, n*h, dv], ml f32[B, nsplit, n*h, 2] (allocated once)."""

    def __init__(self, zeros, n, h, dv, S, split, B=1):
        nsplit = -(-S // split)
        self.split = split
        self.o = zeros((B, nsplit, n * h, dv), np.float32)
        self.ml = zeros((B, nsplit, n * h, 2), np.float32)


def attention_work(zeros, n, h, dv, S, target_blocks=264):
    """Scratch sized so that about `target_blocks` blocks run; zeros = np.zeros or cupy.zeros."""
    return kv_attention_work(zeros, 1, n, h, dv, S, target_blocks, tensor_cores=False)


def kv_attention_work(zeros, B, n, h, dv, max_keys, target_blocks=264, tensor_cores=True, min_split=0):
    """Scratch for `kv_attention` at up to `max_keys` keys per sequence: splits sized so that about
    `target_blocks` blocks (2 per SM of an H200) run when every sequence has max_keys keys (row tiles of 64 rows
    for the tensor-core kernel, ATT_ROWS for the f32 one), at least `min_split` keys each; shorter sequences leave
    their last splits empty (neutral partials)."""
    rows, step = (64, KV_NK) if tensor_cores else (ATT_ROWS, ATT_KEYS)
    blocks = B * -(-n * h // rows)
    nsplit = max(1, min(-(-target_blocks // blocks), -(-max_keys // max(step, min_split))))
    split = -(-(-(-max_keys // nsplit)) // step) * step
    return AttnWork(zeros, n, h, dv, max_keys, split, B)


def rows_view(out, splits=None):
    """out f32[B, n, h, dv] with contiguous [n, h, dv] per sequence -> a view [B, n*h, dv], or
    [B, splits, n*h, dv] (splits = 1: the single-split kernel writes the output in place)."""
    B, n, h, dv = out.shape
    st = elem_strides(out)
    if st[1:] != (h * dv, dv, 1) and n * h * dv > 0:
        raise ValueError(f"kv_attention: out {out.shape} strides {st} must be contiguous within a sequence")
    if splits is None:
        return strided(out, (B, n * h, dv), (st[0], dv, 1))
    return strided(out, (B, splits, n * h, dv), (st[0], n * h * dv, dv, 1))


def batch1(a):
    """A [1, ...] view of a (no copy)."""
    st = elem_strides(a)
    return strided(a, (1,) + tuple(a.shape), (max(1, a.shape[0] * st[0]),) + st)


def launch_attention(q, k, v, kv_len, vis, scale, out, work):
    """The launches behind `attention` and `kv_attention` (shapes already checked; 4-D q, k, v, out)."""
    B, n, h, _ = q.shape
    hk = v.shape[2]
    tiles = -(-n * (h // hk) // ATT_ROWS)
    has_len, has_vis = kv_len is not None, vis is not None
    lens = placeholder(q, (1,), np.int32) if kv_len is None else kv_len
    vis = placeholder(q, (1, 1), np.bool_) if vis is None else vis
    if work is None:
        launch(attention_split_kernel, (1, tiles, B * hk), ATT_THREADS,
               q, k, v, lens, has_len, vis, has_vis, float32(scale), int32(max(k.shape[1], 1)), 1,
               rows_view(out, 1), placeholder(q, (1, 1, 1, 2), np.float32))
        return out
    nsplit = work.o.shape[1]
    launch(attention_split_kernel, (nsplit, tiles, B * hk), ATT_THREADS,
           q, k, v, lens, has_len, vis, has_vis, float32(scale), int32(work.split), 0, work.o, work.ml)
    merge_splits(work.o, work.ml, rows_view(out))
    return out


def check_shapes(name, q, k, v, out):
    B, n, h, d = q.shape
    S, hk, dv = v.shape[1:]
    if (k.shape != (B, S, hk, d) or v.shape[0] != B or out.shape != (B, n, h, dv) or h % hk or d > ATT_DMAX
            or dv > ATT_DMAX):
        raise ValueError(f"{name}: shapes q {q.shape} k {k.shape} v {v.shape} out {out.shape} do not fit "
                         f"(GQA needs hk | h, head dims <= {ATT_DMAX})")


def attention(q, k, v, visible, scale, out, work=None):
    """attention_ref on the GPU (or the simulator): q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv],
    visible bool[n, S] or None, out f32[n, h, dv] (contiguous). work=None: one split per row tile (no scratch);
    else an AttnWork from attention_work (long contexts: splits + merge_splits)."""
    q, k, v, out4 = batch1(q), batch1(k), batch1(v), batch1(out)
    check_shapes("attention", q, k, v, out4)
    if visible is not None and tuple(visible.shape) != (q.shape[1], k.shape[1]):
        raise ValueError(f"attention: visible {visible.shape} is not [n, S] = {(q.shape[1], k.shape[1])}")
    launch_attention(q, k, v, None, visible, scale, out4, work)
    return out


def kv_attention(q, k, v, kv_len, scale, out, work=None, tensor_cores=True):
    """kv_attention_ref on the GPU (or the simulator), one launch for the batch (+ one merge with work):
    q f32[B, n, h, d], k f32[B, S, hk, d], v f32[B, S, hk, dv] (e.g. context caches of capacity S; only keys
    [0, kv_len[b]) are read), kv_len i32[B] read on the device (graph-capturable: no host sync), out f32[B, n, h, dv]
    (every row written; contiguous within a sequence). Views with a leading batch stride are fine.
    work=None: one split per (sequence, kv head, row tile); else a kv_attention_work(zeros, B, n, h, dv, max_keys)
    with max_keys >= every kv_len[b] (splits + merge_splits). tensor_cores: kv_attention_kernel (q, K, V and the
    probabilities rounded to bf16, f32 accumulation) where the shapes allow it (d % 32 == 0, dv % 16 == 0, unit-
    stride rows on 16-byte boundaries); else / False: attention_split_kernel in f32."""
    check_shapes("kv_attention", q, k, v, out)
    if tuple(kv_len.shape) != (q.shape[0],):
        raise ValueError(f"kv_attention: kv_len {kv_len.shape} is not [B] = {(q.shape[0],)}")
    if work is not None and (work.o.shape[0] != q.shape[0] or work.o.shape[2:] != (q.shape[1] * q.shape[2],
                                                                                      v.shape[3])):
        raise ValueError(f"kv_attention: work {work.o.shape} does not fit q {q.shape}, v {v.shape}")
    if tensor_cores and tc_fits(k, v):
        return launch_kv_tc(q, k, v, kv_len, scale, out, work)
    return launch_attention(q, k, v, kv_len, None, scale, out, work)


def tc_fits(k, v):
    """The tensor-core kernel's requirements: head dims, 16-byte loads of unit-stride rows."""
    d, dv = k.shape[3], v.shape[3]
    rows_ok = all(a.strides[3] == 4 and all(x % 16 == 0 for x in a.strides[:3]) and data_ptr(a) % 16 == 0
                  for a in (k, v))
    return d % 32 == 0 and dv % 16 == 0 and d <= ATT_DMAX and dv <= ATT_DMAX and rows_ok


def launch_kv_tc(q, k, v, kv_len, scale, out, work):
    B, n, h, d = q.shape
    hk, dv = v.shape[2], v.shape[3]
    wm, wn, pf, threads, smem = kv_geometry(n * (h // hk), d, dv)
    kern = kv_kernel(wm, wn, pf, d, dv)
    tiles = -(-n * (h // hk) // (16 * wm))
    if work is None:
        args = (q, k, v, kv_len, float32(scale * LOG2E), int32(max(k.shape[1], 1)), 1, rows_view(out, 1),
                placeholder(q, (1, 1, 1, 2), np.float32))
        nsplit = 1
    else:
        args = (q, k, v, kv_len, float32(scale * LOG2E), int32(work.split), 0, work.o, work.ml)
        nsplit = work.o.shape[1]
    if SIM:
        launch(kern, (nsplit, tiles, B * hk), threads, *args, shmem=smem)
    else:
        launch_smem(kern, (nsplit, tiles, B * hk), threads, smem, args)
    if work is not None:
        merge_splits(work.o, work.ml, rows_view(out))
    return out


# --- tensor-core kernel for kv_attention (f32 K/V rounded to bf16 in shared memory) ----------------------------------

KV_NK = 32          # keys staged per step
_KV_KERNELS = {}


def kv_geometry(M, d, dv):
    """(wm, wn, pf, threads, smem bytes) for M = n*g query rows per kv head: wm warps down the rows (16 each, a
    row tile of 16*wm <= 64 rows), wn warps across the dv output columns, pf 16-byte loads per thread and step (K
    then V)."""
    wm = min(4, -(-M // 16))
    wn = max(1, min(dv // 16, 8 // wm))
    while dv % (16 * wn):
        wn -= 1
    threads = 32 * wm * wn
    pf = -(-KV_NK * d // 4 // threads) + -(-KV_NK * dv // 4 // threads)
    mt = 16 * wm
    smem = 4 * (mt * KV_NK + 3 * mt) + 2 * (mt * (d + 8) + KV_NK * (d + 8) + KV_NK * (dv + 8) + mt * (KV_NK + 8))
    return wm, wn, pf, threads, smem


def kv_kernel(wm, wn, pf, d, dv):
    """The tensor-core kv_attention kernel for one tile geometry and head dims (compiled once)."""
    key = (wm, wn, pf, d, dv)
    if key not in _KV_KERNELS:
        _KV_KERNELS[key] = _make_kv_kernel(wm, wn, pf, d, dv)
    return _KV_KERNELS[key]


if SIM:
    from numbaengine.kernels.device import pack_bf16x2 as bf16_pair
else:
    from numbaengine.kernels.device import cvt_pair

    @cuda.jit(device=True, inline="always")
    def bf16_pair(lo, hi):
        """Two float32 -> one word of two bf16 (one cvt.rn.bf16x2), lo in the low half (numba-IR inlined, so
        compile_ptx works without a GPU; device.pack_bf16x2 is NVVM-inlined)."""
        return cvt_pair(hi, lo)


@dataclass(frozen=True)
class KvLayout:
    """The tensor-core kv_attention kernel's compile-time sizes: wm x wn warps, head dims D, DV; shared memory: f32
    scores [MT][nk] and row stats, then uint16 Q, K, V (rows padded by 8: conflict-free ldmatrix) and P tiles."""
    wm: int
    wn: int
    pf: int
    D: int
    DV: int

    nk = KV_NK                                           # keys per step
    MT = property(lambda k: 16 * k.wm)
    THREADS = property(lambda k: 32 * k.wm * k.wn)
    CW = property(lambda k: k.DV // k.wn)                # O columns per warp
    NTP = property(lambda k: k.CW // 8)
    NKP = property(lambda k: k.nk + 8)                   # P row stride
    ST = property(lambda k: k.MT * k.nk)                 # f32 offset of the row stats (max, sum, alpha)
    DP = property(lambda k: k.D + 8)
    VP = property(lambda k: k.DV + 8)
    U0 = property(lambda k: 2 * (k.MT * k.nk + 3 * k.MT))   # first uint16 of the Q/K/V/P area
    KO = property(lambda k: k.U0 + k.MT * k.DP)
    VO = property(lambda k: k.KO + k.nk * k.DP)
    PO = property(lambda k: k.VO + k.nk * k.VP)
    C4 = property(lambda k: k.D // 4)                    # 16-byte chunks per key row of K, of V
    CV = property(lambda k: k.DV // 4)
    PK = property(lambda k: -(-k.nk * k.C4 // k.THREADS))   # 16-byte loads per thread and step: K, V
    PV = property(lambda k: -(-k.nk * k.CV // k.THREADS))


def _kv_loads(kl):
    """fetch (a step's K then V rows, f32, into registers: 16-byte loads, zeros past hi), q_tile (q rows -> bf16 in
    shared memory; the row stats initialized) and stage_kv (the fetched registers -> bf16 K and V tiles)."""
    nk, MT, D, THREADS, ST, U0, DP, VP, KO, VO, C4, CV, PK, PV = (kl.nk, kl.MT, kl.D, kl.THREADS, kl.ST, kl.U0, kl.DP,
                                                                   kl.VP, kl.KO, kl.VO, kl.C4, kl.CV, kl.PK, kl.PV)

    @cuda.jit(device=True, inline="always")
    def fetch(k, v, kbase, vbase, kss, vss, c0, hi, tid, regs):
        """16-byte loads of K rows then V rows c0..c0+nk-1 (zeros past hi) into regs (PK, then PV per thread)."""
        for p in range(PK):
            idx = tid + p * THREADS
            x, y, z, e = uint32(0), uint32(0), uint32(0), uint32(0)
            if idx < nk * C4 and c0 + idx // C4 < hi:
                x, y, z, e = ld16(k, kbase + (c0 + idx // C4) * kss + 4 * (idx % C4))
            regs[4 * p], regs[4 * p + 1], regs[4 * p + 2], regs[4 * p + 3] = x, y, z, e
        for p in range(PV):
            idx = tid + p * THREADS
            x, y, z, e = uint32(0), uint32(0), uint32(0), uint32(0)
            if idx < nk * CV and c0 + idx // CV < hi:
                x, y, z, e = ld16(v, vbase + (c0 + idx // CV) * vss + 4 * (idx % CV))
            q = 4 * (PK + p)
            regs[q], regs[q + 1], regs[q + 2], regs[q + 3] = x, y, z, e

    @cuda.jit(device=True, inline="always")
    def q_tile(q, usm, fsm, b, j, g, M, mt, tid):
        for idx in range(tid, MT * D // 2, THREADS):  # q tile -> bf16 in shared memory
            i, c = idx // (D // 2), 2 * (idx % (D // 2))
            m = mt * MT + i
            x0, x1 = float32(0), float32(0)
            if m < M:
                x0 = q[b, m // g, j * g + m % g, c]
                x1 = q[b, m // g, j * g + m % g, c + 1]
            usm[U0 + i * DP + c] = to_bf16(x0)
            usm[U0 + i * DP + c + 1] = to_bf16(x1)
        if tid < MT:
            fsm[ST + tid] = NEG_INF
            fsm[ST + MT + tid] = float32(0)

    @cuda.jit(device=True, inline="always")
    def stage_kv(wsm, regs, tid):
        for p in range(PK + PV):                     # registers -> bf16 in shared memory
            idx = tid + (p if p < PK else p - PK) * THREADS
            if p < PK and idx < nk * C4:
                at = KO + (idx // C4) * DP + 4 * (idx % C4)
            elif p >= PK and idx < nk * CV:
                at = VO + (idx // CV) * VP + 4 * (idx % CV)
            else:
                continue
            wsm[at // 2] = bf16_pair(as_f32(regs[4 * p]), as_f32(regs[4 * p + 1]))
            wsm[at // 2 + 1] = bf16_pair(as_f32(regs[4 * p + 2]), as_f32(regs[4 * p + 3]))
    return fetch, q_tile, stage_kv


def _kv_math(kl):
    """scores (S = Q K^T of the step, scaled, -inf past hi, into f32 rows), softmax_rows (the online softmax, 4
    threads per row; P as bf16) and pv (O += P V for a warp's columns after the rescale by alpha)."""
    nk, D, MT, THREADS, ST, U0, DP, VP, KO, VO, PO, NKP, NTP, wn, cw = (
        kl.nk, kl.D, kl.MT, kl.THREADS, kl.ST, kl.U0, kl.DP, kl.VP, kl.KO, kl.VO, kl.PO, kl.NKP, kl.NTP, kl.wn, kl.CW)
    CPT = nk // 4                                    # softmax: 4 threads per row, CPT columns each

    @cuda.jit(device=True, inline="always")
    def scores(usm, fsm, scale2, c0, hi, wi, wj, gq, tq):
        for nt in range(wj, nk // 8, wn):        # S = Q K^T for n-tile nt of this warp's rows
            s0, s1, s2, s3 = float32(0), float32(0), float32(0), float32(0)
            t0, t1, t2, t3 = float32(0), float32(0), float32(0), float32(0)   # second chain: half the latency
            for kk in range(0, D, 32):
                b0, b1, b2, b3 = frag_bn(usm, KO, DP, nt * 8, kk)
                a0, a1, a2, a3 = frag_a(usm, U0, DP, wi * 16, kk)
                s0, s1, s2, s3 = mma_bf16(a0, a1, a2, a3, b0, b1, s0, s1, s2, s3)
                a0, a1, a2, a3 = frag_a(usm, U0, DP, wi * 16, kk + 16)
                t0, t1, t2, t3 = mma_bf16(a0, a1, a2, a3, b2, b3, t0, t1, t2, t3)
            s0, s1, s2, s3 = s0 + t0, s1 + t1, s2 + t2, s3 + t3
            for e in range(4):
                row = wi * 16 + gq + 8 * (e >> 1)
                col = nt * 8 + 2 * tq + (e & 1)
                x = s0 if e == 0 else s1 if e == 1 else s2 if e == 2 else s3
                fsm[row * nk + col] = x * scale2 if c0 + col < hi else NEG_INF

    @cuda.jit(device=True, inline="always")
    def softmax_rows(fsm, wsm, tid):
        for task in range(tid, 4 * MT, THREADS):  # online softmax, 4 threads per row; P as bf16
            row, c1 = task >> 2, (task & 3) * CPT
            m_old = fsm[ST + row]
            mx = m_old
            for c in range(c1, c1 + CPT):
                mx = max(mx, fsm[row * nk + c])
            mx = max(mx, shfl_xor(mx, 1))
            mx = max(mx, shfl_xor(mx, 2))
            tot = float32(0)
            for c in range(c1, c1 + CPT, 2):     # scores in log2 units: p = 2^(x - max)
                pw = uint32(0)
                if mx != NEG_INF:
                    pw = bf16_pair(math.exp2(fsm[row * nk + c] - mx), math.exp2(fsm[row * nk + c + 1] - mx))
                    tot += as_f32(pw << uint32(16)) + as_f32(pw & uint32(0xFFFF0000))
                wsm[(PO + row * NKP + c) // 2] = pw
            tot += shfl_xor(tot, 1)
            tot += shfl_xor(tot, 2)
            alpha = math.exp2(m_old - mx) if mx != NEG_INF else float32(1)
            if c1 == 0:
                fsm[ST + row] = mx
                fsm[ST + MT + row] = fsm[ST + MT + row] * alpha + tot
                fsm[ST + 2 * MT + row] = alpha

    @cuda.jit(device=True, inline="always")
    def pv(usm, fsm, acc, wi, wj, gq):
        al0, al1 = fsm[ST + 2 * MT + wi * 16 + gq], fsm[ST + 2 * MT + wi * 16 + gq + 8]
        for u in range(NTP):
            acc[4 * u] *= al0
            acc[4 * u + 1] *= al0
            acc[4 * u + 2] *= al1
            acc[4 * u + 3] *= al1
        for kk in range(0, nk, 16):              # O += P V for this warp's columns
            a0, a1, a2, a3 = frag_a(usm, PO, NKP, wi * 16, kk)
            for u in range(0, NTP, 2):
                b0, b1, b2, b3 = frag_bt(usm, VO, VP, kk, wj * cw + 8 * u)
                acc[4 * u], acc[4 * u + 1], acc[4 * u + 2], acc[4 * u + 3] = mma_bf16(
                    a0, a1, a2, a3, b0, b1, acc[4 * u], acc[4 * u + 1], acc[4 * u + 2], acc[4 * u + 3])
                acc[4 * u + 4], acc[4 * u + 5], acc[4 * u + 6], acc[4 * u + 7] = mma_bf16(
                    a0, a1, a2, a3, b2, b3, acc[4 * u + 4], acc[4 * u + 5], acc[4 * u + 6], acc[4 * u + 7])
    return scores, softmax_rows, pv


def _make_kv_kernel(wm, wn, pf, D, DV):
    """The kernel of one geometry (kv_kernel's key), from its steps: fetch, q_tile, stage_kv, scores, softmax_rows,
    pv."""
    kl = KvLayout(wm, wn, pf, D, DV)
    nk, MT, THREADS, ST, NTP, cw, ACC, PF4 = kl.nk, kl.MT, kl.THREADS, kl.ST, kl.NTP, kl.CW, 4 * kl.NTP, 4 * pf
    fetch, q_tile, stage_kv = _kv_loads(kl)
    scores, softmax_rows, pv = _kv_math(kl)

    @kernel(max_registers=min(255, 65536 // (2 * THREADS)))   # two blocks per SM
    def kv_attention_kernel(q, k, v, kv_len, scale2, split, normalize, o_part, ml_part):
        """Block (split s, row tile, sequence b * kv head j) of 32*wm*wn threads; warp (wi, wj) owns rows
        16wi..16wi+15 of the tile (row m = i*g + gh: query i, head j*g + gh) and output columns wj*cw..+cw.
        Per step of nk keys: 16-byte loads of K and V rows (f32) into registers one step ahead, rounded to bf16
        into shared memory; S = Q K^T and O += P V on tensor cores (mma.sync bf16, f32 accumulate; q and p
        rounded to bf16). Arrays as attention_split_kernel's, but scale2 = scale * log2(e) (softmax in base 2);
        k/v rows need 16-byte aligned, unit-stride rows. Grid (splits, ceil(n g / 16 wm), B hk), kv_geometry's
        threads and shared bytes.
        Bytes: K/V rows [s*split, min((s+1)*split, kv_len[b])) of kv head j once per row tile, q once."""
        grid_dep()
        n, h = q.shape[1], q.shape[2]
        hk = k.shape[2]
        g = h // hk
        M = n * g
        s, mt = cuda.blockIdx.x, cuda.blockIdx.y
        b, j = cuda.blockIdx.z // hk, cuda.blockIdx.z % hk
        tid = cuda.threadIdx.x
        lane, w = tid & 31, tid >> 5
        wi, wj = w // wn, w % wn
        gq, tq = lane >> 2, lane & 3
        fsm = cuda.shared.array(0, float32)
        usm = cuda.shared.array(0, uint16)
        wsm = cuda.shared.array(0, uint32)
        ksb, kss, ksj = k.strides[0] // 4, int32(k.strides[1] // 4), k.strides[2] // 4
        vsb, vss, vsj = v.strides[0] // 4, int32(v.strides[1] // 4), v.strides[2] // 4
        lo = int32(s * split)
        hi = int32(min(lo + split, min(int32(k.shape[1]), kv_len[b])))
        if lo >= hi and not normalize:               # an empty split: only its (max, sum) matter
            if tid < MT and mt * MT + tid < M:
                m = mt * MT + tid
                row = (m // g) * h + j * g + m % g
                ml_part[b, s, row, 0] = NEG_INF
                ml_part[b, s, row, 1] = float32(0)
            return
        q_tile(q, usm, fsm, b, j, g, M, mt, tid)
        acc = cuda.local.array(ACC, float32)
        for u in range(ACC):
            acc[u] = float32(0)
        regs = cuda.local.array(PF4, uint32)
        kbase, vbase = b * ksb + j * ksj, b * vsb + j * vsj
        fetch(k, v, kbase, vbase, kss, vss, lo, hi, tid, regs)   # first step's K/V rows into registers
        for c0 in range(lo, hi, nk):
            cuda.syncthreads()
            stage_kv(wsm, regs, tid)
            cuda.syncthreads()
            fetch(k, v, kbase, vbase, kss, vss, c0 + nk, hi, tid, regs)   # next step's rows in flight
            scores(usm, fsm, scale2, c0, hi, wi, wj, gq, tq)
            cuda.syncthreads()
            softmax_rows(fsm, wsm, tid)
            cuda.syncthreads()
            pv(usm, fsm, acc, wi, wj, gq)
        cuda.syncthreads()
        for half in range(2):                        # rows gq and gq+8 of this warp's 16
            r = wi * 16 + gq + 8 * half
            m = mt * MT + r
            if m < M:
                row = (m // g) * h + j * g + m % g
                den = fsm[ST + MT + r]
                inv = float32(1) / den if den > float32(0) else float32(0)
                for u in range(NTP):
                    col = wj * cw + 8 * u + 2 * tq
                    y0, y1 = acc[4 * u + 2 * half], acc[4 * u + 2 * half + 1]
                    if normalize:
                        y0, y1 = y0 * inv, y1 * inv
                    o_part[b, s, row, col] = y0
                    o_part[b, s, row, col + 1] = y1
                if not normalize and wj == 0 and tq == 0:
                    ml_part[b, s, row, 0] = fsm[ST + r]              # log2 units (merge_splits)
                    ml_part[b, s, row, 1] = den
    return kv_attention_kernel
