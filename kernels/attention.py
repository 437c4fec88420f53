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

from kernels.device import SIM, current_stream, launch  # noqa: E402,F401

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
def attention_split_kernel(q, k, v, kv_len, has_len, vis, has_vis, scale, split, normalize, o_part, ml_part):
    """One (split, row tile, sequence * kv head) per block, ATT_THREADS threads: rows r = i*g + gh of kv head j are
    query i, head j*g + gh. q f32[B, n, h, d], k f32[B, S, hk, d], v f32[B, S, hk, dv]; sequence b sees keys
    [0, kv_len[b]) (read on the device when has_len, else all S); vis bool[n, S] (read when has_vis; B = 1).
    Writes o_part f32[B, nsplit, n*h, dv] (unnormalized) and ml_part f32[B, nsplit, n*h, 2] (max, sum) of keys
    [s*split, (s+1)*split) (a split past kv_len[b] writes the neutral (0, -inf, 0)); normalize=1 (one split):
    o_part[b, 0] = the attention output. Grid (nsplit, ceil(n*g / ATT_ROWS), B*hk). Bytes: K/V of the split once
    per row tile (L2), q rows once; keys past kv_len[b] are never read."""
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
                    ml_part[b, s, row, 0] = stat[0, pr]
                    ml_part[b, s, row, 1] = stat[1, pr]
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
    """Flash-decoding scratch for `attention` / `kv_attention`: keys per split and the partial buffers
    o f32[B, nsplit, n*h, dv], ml f32[B, nsplit, n*h, 2] (allocated once)."""

    def __init__(self, zeros, n, h, dv, S, split, B=1):
        nsplit = -(-S // split)
        self.split = split
        self.o = zeros((B, nsplit, n * h, dv), np.float32)
        self.ml = zeros((B, nsplit, n * h, 2), np.float32)


def attention_work(zeros, n, h, dv, S, target_blocks=264):
    """Scratch sized so that about `target_blocks` blocks run; zeros = np.zeros or cupy.zeros."""
    return kv_attention_work(zeros, 1, n, h, dv, S, target_blocks)


def kv_attention_work(zeros, B, n, h, dv, max_keys, target_blocks=264):
    """Scratch for `kv_attention` at up to `max_keys` keys per sequence: splits sized so that about
    `target_blocks` blocks (2 per SM of an H200) run when every sequence has max_keys keys; sequences with
    fewer keys leave their last splits empty (neutral partials)."""
    blocks = B * -(-n * h // ATT_ROWS)
    nsplit = max(1, min(-(-target_blocks // blocks), -(-max_keys // ATT_KEYS)))
    split = -(-(-(-max_keys // nsplit)) // ATT_KEYS) * ATT_KEYS
    return AttnWork(zeros, n, h, dv, max_keys, split, B)


_PLACEHOLDERS = {}


def placeholder(like, shape, dtype):
    """A small array standing in for an unused kernel argument, made once per (array kind, shape, dtype)."""
    key = (isinstance(like, np.ndarray), shape, np.dtype(dtype).str)
    if key not in _PLACEHOLDERS:
        a = np.zeros(shape, dtype)
        _PLACEHOLDERS[key] = a if key[0] else cuda.to_device(a)
    return _PLACEHOLDERS[key]


def strided(a, shape, strides):
    """A view of a with the given shape and element strides (no copy): NumPy, CuPy or numba device arrays."""
    nbytes = tuple(int(x) * a.dtype.itemsize for x in strides)
    if isinstance(a, np.ndarray):
        return np.lib.stride_tricks.as_strided(a, shape, nbytes)
    if hasattr(a, "gpu_data"):                                  # numba device array
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        return DeviceNDArray(shape, nbytes, a.dtype, gpu_data=a.gpu_data)
    import cupy
    return cupy.lib.stride_tricks.as_strided(a, shape, nbytes)


def elem_strides(a):
    return tuple(x // a.dtype.itemsize for x in a.strides)


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
    hk, dv = v.shape[2], v.shape[3]
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
    launch(merge_splits_kernel, (n * h, B), MERGE_THREADS, work.o, work.ml, rows_view(out))
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


def kv_attention(q, k, v, kv_len, scale, out, work=None):
    """kv_attention_ref on the GPU (or the simulator), one launch for the batch (+ one merge with work):
    q f32[B, n, h, d], k f32[B, S, hk, d], v f32[B, S, hk, dv] (e.g. context caches of capacity S; only keys
    [0, kv_len[b]) are read), kv_len i32[B] read on the device (graph-capturable: no host sync), out f32[B, n, h, dv]
    (every row written; contiguous within a sequence). Views with a leading batch stride are fine.
    work=None: one split per (sequence, kv head, row tile); else a kv_attention_work(zeros, B, n, h, dv, max_keys)
    with max_keys >= every kv_len[b] (splits + merge_splits)."""
    check_shapes("kv_attention", q, k, v, out)
    if tuple(kv_len.shape) != (q.shape[0],):
        raise ValueError(f"kv_attention: kv_len {kv_len.shape} is not [B] = {(q.shape[0],)}")
    if work is not None and (work.o.shape[0] != q.shape[0] or work.o.shape[2:] != (q.shape[1] * q.shape[2],
                                                                                      v.shape[3])):
        raise ValueError(f"kv_attention: work {work.o.shape} does not fit q {q.shape}, v {v.shape}")
    return launch_attention(q, k, v, kv_len, None, scale, out, work)


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
