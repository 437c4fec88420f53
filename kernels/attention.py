"""Softmax attention with an explicit visibility mask; GQA/MQA when k has fewer heads than q.

One reference serves every attention of the engine: MLA prefill (naive form, hk = h), MLA decode and tree
verify in the absorbed form (MQA over the latent cache: hk = 1, d = kv_lora + rope, v = the c_kv part), and the
DFlash drafter (GQA, no mask).
"""
import numpy as np


def attention_ref(q, k, v, visible, scale, out):
    """q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv], visible bool[n, S] or None -> out f32[n, h, dv]."""
    h, hk = q.shape[1], k.shape[1]
    g = h // hk
    for j in range(hk):
        qj = q[:, j * g:(j + 1) * g]                                   # [n, g, d]
        s = np.einsum("ngd,sd->gns", qj, k[:, j]) * np.float32(scale)  # [g, n, S]
        if visible is not None:
            s = np.where(visible[None], s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[:, j * g:(j + 1) * g] = np.einsum("gns,se->nge", p, v[:, j])
    return out



def kv_attention_ref(q, k, v, kv_len, scale, out):
    """Batched attention without a mask (the DFlash drafter's block over its context plus itself): q f32[B, n, h, d],
    k f32[B, S, hk, d], v f32[B, S, hk, dv], kv_len i32[B]: the queries of sequence b see keys [0, kv_len[b])
    -> out f32[B, n, h, dv]."""
    for b in range(q.shape[0]):
        S = int(kv_len[b])
        attention_ref(q[b], k[b, :S], v[b, :S], None, scale, out[b])
    return out

# --- numba.cuda kernels ---------------------------------------------------------------------------------------------
# Flash-decoding: a block per (kv head, tile of query rows, split of the keys) writes an unnormalized partial
# (o, max, sum); merge_splits combines the splits. With one split the block writes the normalized rows directly.

import math  # noqa: E402

from numba import cuda, float32, int32  # noqa: E402

from kernels.device import SIM, current_stream  # noqa: E402,F401

if SIM:
    from kernels.device import shfl_xor  # noqa: E402,F401
else:
    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, mask):
        """device.shfl_xor inlined in numba IR (compile_ptx of NVVM-inlined device functions needs a GPU)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, mask)
NEG_INF = float32(-math.inf)
ATT_THREADS = 128          # threads per block
ATT_ROWS = 8               # query rows (query, head) per block
ATT_KEYS = 16              # keys staged in shared memory per step: ATT_ROWS * ATT_KEYS == ATT_THREADS
ATT_DMAX = 256             # largest q/k and v head dim
ATT_KPAD = ATT_DMAX + 1       # padded key rows: no bank conflicts across keys
ATT_ACC = ATT_ROWS * ATT_DMAX // ATT_THREADS
MERGE_THREADS = 128


@cuda.jit
def attention_split_kernel(q, k, v, vis, has_vis, scale, split, normalize, o_part, ml_part):
    """One (split, row tile, kv head) per block, ATT_THREADS threads: rows r = i*g + gh of kv head j are query i,
    head j*g + gh. q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv], vis bool[n, S] (read when has_vis).
    Writes o_part f32[nsplit, n*h, dv] (unnormalized) and ml_part f32[nsplit, n*h, 2] (max, sum) of keys
    [s*split, (s+1)*split); normalize=1 (one split): o_part[0] = the attention output. Bytes: K/V of the split
    once per row tile (L2), q rows once."""
    n, h, d = q.shape[0], q.shape[1], q.shape[2]
    S, hk, dv = k.shape[0], k.shape[1], v.shape[2]
    g = h // hk
    s, tile, j = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
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
            qs[rr, c] = q[qi, qh, c] if r < n * g else float32(0)
    if t < ATT_ROWS:
        stat[0, t] = NEG_INF
        stat[1, t] = float32(0)
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
                ks[kr, c] = k[c0 + kr, j, c] if live else float32(0)
            for c in range(t, dv, ATT_THREADS):
                vs[kr, c] = v[c0 + kr, j, c] if live else float32(0)
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
                o_part[s, row, c] = y
                if c == 0 and not normalize:
                    ml_part[s, row, 0] = stat[0, pr]
                    ml_part[s, row, 1] = stat[1, pr]
            u += 1


@cuda.jit
def merge_splits_kernel(o_part, ml_part, out):
    """Combine flash-decoding partials: block (row, group) of MERGE_THREADS threads over dv.
    o_part f32[G, nsplit, rows, dv], ml_part f32[G, nsplit, rows, 2] -> out f32[G, rows, dv]; rows whose
    splits saw no key get 0. Bytes: the partials once, the output once."""
    row, gi = cuda.blockIdx.x, cuda.blockIdx.y
    nsplit, dv = o_part.shape[1], o_part.shape[3]
    m = NEG_INF
    for s in range(nsplit):
        m = max(m, ml_part[gi, s, row, 0])
    den = float32(0)
    for s in range(nsplit):
        ms = ml_part[gi, s, row, 0]
        if ms != NEG_INF:
            den += ml_part[gi, s, row, 1] * math.exp(ms - m)
    inv = float32(1) / den if den > float32(0) else float32(0)
    for c in range(cuda.threadIdx.x, dv, MERGE_THREADS):
        y = float32(0)
        for s in range(nsplit):
            ms = ml_part[gi, s, row, 0]
            if ms != NEG_INF:
                y += o_part[gi, s, row, c] * math.exp(ms - m)
        out[gi, row, c] = y * inv


class AttnWork:
    """Flash-decoding scratch for `attention`: keys per split and the partial buffers (allocated once)."""

    def __init__(self, zeros, n, h, dv, S, split):
        nsplit = -(-S // split)
        self.split = split
        self.o = zeros((1, nsplit, n * h, dv), np.float32)
        self.ml = zeros((1, nsplit, n * h, 2), np.float32)


def attention_work(zeros, n, h, dv, S, target_blocks=264):
    """Scratch sized so that about `target_blocks` blocks run; zeros = np.zeros or cupy.zeros."""
    blocks = -(-n * h // ATT_ROWS)
    nsplit = max(1, min(-(-target_blocks // blocks), -(-S // ATT_KEYS)))
    split = -(-(-(-S // nsplit)) // ATT_KEYS) * ATT_KEYS
    return AttnWork(zeros, n, h, dv, S, split)


_PLACEHOLDERS = {}


def placeholder(like, shape, dtype):
    """A small array standing in for an unused kernel argument, made once per (array kind, shape, dtype)."""
    key = (isinstance(like, np.ndarray), shape, np.dtype(dtype).str)
    if key not in _PLACEHOLDERS:
        a = np.zeros(shape, dtype)
        _PLACEHOLDERS[key] = a if key[0] else cuda.to_device(a)
    return _PLACEHOLDERS[key]


def attention(q, k, v, visible, scale, out, work=None):
    """attention_ref on the GPU (or the simulator): q f32[n, h, d], k f32[S, hk, d], v f32[S, hk, dv],
    visible bool[n, S] or None, out f32[n, h, dv]. work=None: one split per row tile (no scratch); else an
    AttnWork from attention_work (long contexts: splits + merge_splits)."""
    n, h, d = q.shape
    S, hk, dv = v.shape
    if k.shape != (S, hk, d) or out.shape != (n, h, dv) or h % hk or d > ATT_DMAX or dv > ATT_DMAX:
        raise ValueError(f"attention: shapes q {q.shape} k {k.shape} v {v.shape} out {out.shape} do not fit "
                         f"(GQA needs hk | h, head dims <= {ATT_DMAX})")
    if visible is not None and tuple(visible.shape) != (n, S):
        raise ValueError(f"attention: visible {visible.shape} is not [n, S] = {(n, S)}")
    vis = placeholder(q, (1, 1), np.bool_) if visible is None else visible
    tiles = -(-n * (h // hk) // ATT_ROWS)
    stream, has_vis = current_stream(), visible is not None
    if work is None:
        attention_split_kernel[(1, tiles, hk), ATT_THREADS, stream](
            q, k, v, vis, has_vis, float32(scale), int32(max(S, 1)), 1, out.reshape(1, n * h, dv),
            placeholder(q, (1, 1, 2), np.float32))
        return out
    nsplit = work.o.shape[1]
    attention_split_kernel[(nsplit, tiles, hk), ATT_THREADS, stream](
        q, k, v, vis, has_vis, float32(scale), int32(work.split), 0, work.o[0], work.ml[0])
    merge_splits_kernel[(n * h, 1), MERGE_THREADS, stream](work.o, work.ml, out.reshape(1, n * h, dv))
    return out


_SMEM_SET = set()


def launch_smem(kern, grid, threads, smem, args):
    """Launch on the current stream with `smem` bytes of dynamic shared memory, raising the kernel's limit above
    48 KB first (once per compiled overload; numba has no API for the attribute)."""
    if not SIM and smem > 48 * 1024:
        types_ = tuple(kern.typeof_pyval(a) for a in args)
        key = (id(kern), types_, smem)
        if key not in _SMEM_SET:
            from numba.cuda.cudadrv.driver import binding, driver
            cf = kern.compile(types_)._codelibrary.get_cufunc()
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, smem, cf.handle, cf.device.id)
            _SMEM_SET.add(key)
    kern[grid, threads, current_stream(), smem](*args)
