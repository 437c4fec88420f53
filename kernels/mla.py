"""MLA's per-head products for the absorbed (latent) form.

W_kv_b viewed [h, nope + v, kv_lora]: W_UK = rows [:nope], W_UV = rows [nope:]. Decode and tree verify
attend in the latent space: q_lat_h = q_nope_h @ W_UK_h, then o_h = o_lat_h @ W_UV_h^T.
"""
import numpy as np

from kernels.memo import memo_f32
from weights.dtypes import bf16_to_f32, f32_to_bf16


def head_gemm_ref(x, w, out, transpose_w):
    """Per-head GEMM. x f32[n, h, a]; w u16[h, a, b] (transpose_w=False) or u16[h, b, a] (True) -> out f32[n, h, b]."""
    np.einsum("nha,hba->nhb" if transpose_w else "nha,hab->nhb", x, memo_f32(w, lambda: bf16_to_f32(w)), out=out)
    return out


# --- absorbed-form attention over the latent cache (decode, tree verify, prefill) ------------------------------------

def mask_bits(mask, n):
    """Packed visibility u32[T, W] (bit j of word w: sees new token 32w+j) -> bool[n, n] for the first n rows."""
    words = np.ascontiguousarray(mask[:n]).astype("<u4").view(np.uint8).reshape(n, -1)
    return np.unpackbits(words, axis=1, bitorder="little")[:, :n].astype(bool)


def mla_attention_ref(q, cache, lengths, ntok, mask, scale, out, work=None):
    """Batched MQA over the bf16 latent cache. q f32[B, T, h, D] ([q_lat | q_pe] per head); cache u16[B, cap, D]
    (rows [0, lengths[b]) committed, the ntok[b] new tokens' rows right after); mask u32[B, T, W] packed
    visibility among new tokens (mask_bits) or None = causal; out f32[B, T, h, r] = softmax @ c_kv (r = kv_lora).
    Query rows t >= ntok[b] get 0. `work` is the GPU launcher's scratch (unused here)."""
    r = out.shape[-1]
    out[:] = 0
    for b in range(q.shape[0]):
        L, n = int(lengths[b]), int(ntok[b])
        if n == 0:
            continue
        lat = bf16_to_f32(cache[b, :L + n])                                   # [L+n, D]
        vis = np.ones((n, L + n), bool)
        vis[:, L:] = np.tril(np.ones((n, n), bool)) if mask is None else mask_bits(mask[b], n)
        attention_ref(q[b, :n], lat[:, None, :], lat[:, None, :r], vis, scale, out[b, :n])
    return out


import math  # noqa: E402

from numba import cuda, float32, int32, uint16, uint32  # noqa: E402

from kernels.attention import (NEG_INF, attention_ref, launch_smem, merge_splits_kernel, placeholder,  # noqa: E402
                               shfl_xor)
from kernels.device import SIM, current_stream, kernel, ld16, mma_bf16  # noqa: E402,F401

if not SIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    def _smem_addr(context, builder, aryty, ary, idxty, idx):
        """i64 address of element idx of a 1-D shared array."""
        arr = context.make_array(aryty)(context, builder, value=ary)
        i = context.cast(builder, idx, idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [i])
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _make_ldsm(trans):
        """ldmatrix .x4 (optionally .trans): this lane passes the address of its row (uint16 element idx)."""
        op = "ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"

        @intrinsic
        def ldsm(typingctx, ary, idx):
            sig = types.UniTuple(types.uint32, 4)(ary, idx)

            def codegen(context, builder, sig, args):
                a = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                i32 = ir.IntType(32)
                fn = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
                asm = "{ .reg .u64 sa; cvta.to.shared.u64 sa, $4; " + op + " {$0,$1,$2,$3}, [sa]; }"
                r = builder.call(ir.InlineAsm(fn, asm, "=r,=r,=r,=r,l", side_effect=True), [a])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, k) for k in range(4)])
            return sig, codegen
        return ldsm

    @intrinsic
    def _sts(typingctx, ary, idx, x, y, z, w):
        """st.shared.v4.u32 of four words at uint16 element idx of a 1-D shared array (16-byte aligned)."""
        sig = types.void(ary, idx, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            a = _smem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [ir.IntType(32)] * 4)
            asm = "{ .reg .u64 sa; cvta.to.shared.u64 sa, $0; st.shared.v4.u32 [sa], {$1,$2,$3,$4}; }"
            builder.call(ir.InlineAsm(fn, asm, "l,r,r,r,r", side_effect=True), [a] + list(args[2:]))
        return sig, codegen

    _ldsm, _ldsm_t = _make_ldsm(False), _make_ldsm(True)

    @cuda.jit(device=True, inline="always")
    def _to_bf16(x):
        """float32 -> bf16 bits, round to nearest even."""
        u = uint32(libdevice.float_as_int(x))
        return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))

    @cuda.jit(device=True, inline="always")
    def _from_bf16(u):
        return libdevice.int_as_float(int32(uint32(u) << uint32(16)))

    @cuda.jit(device=True, inline="always")
    def _frag_a(sm, base, stride, r0, c0):
        """A fragment of the 16x16 tile at (r0, c0) of a row-major tile sm[base + r*stride + c] (one ldmatrix.x4)."""
        lane = cuda.threadIdx.x & 31
        return _ldsm(sm, base + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + c0 + (lane >> 4) * 8)

    @cuda.jit(device=True, inline="always")
    def _frag_bt(sm, base, stride, k0, n0):
        """B fragments of n-tiles n0 and n0+8, k rows k0..k0+15 of a row-major [k][n] tile (ldmatrix.x4.trans)."""
        lane = cuda.threadIdx.x & 31
        return _ldsm_t(sm, base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + n0 + (lane >> 4) * 8)

    @cuda.jit(device=True, inline="always")
    def _frag_bn(sm, base, stride, n0, k0):
        """B fragments of k-steps k0 and k0+16 for rows n0..n0+7 of a row-major [n][k] tile (ldmatrix.x4)."""
        lane = cuda.threadIdx.x & 31
        return _ldsm(sm, base + (n0 + (lane & 7)) * stride + k0 + (lane >> 3) * 8)
else:
    # Simulator twins: each lane reads exactly the registers ldmatrix would hand it.
    def _to_bf16(x):
        return f32_to_bf16(np.array([x], np.float32))[0]

    def _from_bf16(u):
        return bf16_to_f32(np.array([u], np.uint16))[0]

    def _pair(sm, i, j):
        return np.uint32(int(sm[i]) | (int(sm[j]) << 16))

    def _frag_a(sm, base, stride, r0, c0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (r0 + g + 8 * (k & 1)) * stride + c0 + 2 * t + 8 * (k >> 1) for k in range(4)]
        return tuple(_pair(sm, a, a + 1) for a in at)

    def _frag_bt(sm, base, stride, k0, n0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (k0 + 2 * t + 8 * (k & 1)) * stride + n0 + g + 8 * (k >> 1) for k in range(4)]
        return tuple(_pair(sm, a, a + stride) for a in at)

    def _frag_bn(sm, base, stride, n0, k0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (n0 + g) * stride + k0 + 2 * t + 8 * k for k in range(4)]
        return tuple(_pair(sm, a, a + 1) for a in at)

    def _sts(sm, idx, x, y, z, w):
        sm[idx:idx + 8] = np.array([x, y, z, w], np.uint32).view(np.uint16)


MLA_NK = 32         # keys staged per step
_MLA_KERNELS = {}


def mla_geometry(M, D, r):
    """(wm, wn, pf, threads, smem bytes) for M query rows (ntok*h), latent width D and output width r: wm warps
    down the rows (16 each), wn across the r output columns, pf 16-byte prefetches per thread and step."""
    wm = 1 if M <= 16 else 2 if M <= 32 else 4
    wn = 8 if wm == 1 and r % 128 == 0 else 4        # decode: more warps, fewer registers per thread
    threads = 32 * wm * wn
    pf = -(-MLA_NK * D // 8 // threads)
    mt, dp = 16 * wm, D + 8
    smem = 4 * (mt * MLA_NK + 3 * mt) + 2 * (mt * dp + MLA_NK * dp + mt * (MLA_NK + 8))
    return wm, wn, pf, threads, smem


def mla_kernel(wm, wn, pf, causal, D, r):
    """The absorbed-attention kernel for one tile geometry, latent width D and output width r (compiled once)."""
    key = (wm, wn, pf, causal, D, r)
    if key not in _MLA_KERNELS:
        _MLA_KERNELS[key] = _make_mla_kernel(wm, wn, MLA_NK, r // wn, pf, causal, D)
    return _MLA_KERNELS[key]


def _make_mla_kernel(wm, wn, nk, cw, pf, causal, D):
    MT, THREADS, NTP = 16 * wm, 32 * wm * wn, cw // 8
    ACC, NKP, ST = 4 * NTP, nk + 8, MT * nk         # accumulators per lane; P row stride; stats offset (f32)
    PF4 = 4 * pf                                     # prefetch registers per thread
    U0 = 2 * (MT * nk + 3 * MT)                      # first uint16 of the Q/K/P area
    DP, D2, D8 = D + 8, D // 2, D // 8               # Q/K row stride (conflict-free ldmatrix), pairs, 16 B chunks
    CPT = nk // 4                                    # softmax: 4 threads per row, CPT columns each

    @kernel(max_registers=min(255, 65536 // THREADS))   # the whole block fits the register file
    def mla_attention_kernel(q, cache, lengths, ntok, mask, scale, split, normalize, o_part, ml_part):
        """Block (split s, row tile, sequence b) of 32*wm*wn threads; warp (wi, wj) owns query rows
        16wi..16wi+15 of the tile (row m = t*h + head) and latent columns wj*cw..+cw. Per step of nk cache
        rows: 16-byte loads into registers one step ahead, stored to shared memory; S = Q K^T and O += P V on
        tensor cores (mma.sync bf16, f32 accumulate; q and p rounded to bf16). Bytes: every cache row of the
        split once per row tile (one tile when ntok*h <= 64), q once, partials MT*r*4 per block."""
        T, h = q.shape[1], q.shape[2]
        cap = cache.shape[1]
        s, mt, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane, w = tid & 31, tid >> 5
        wi, wj = w // wn, w % wn
        g, tq = lane >> 2, lane & 3
        M = T * h
        KO = U0 + MT * DP
        PO = KO + nk * DP
        fsm = cuda.shared.array(0, float32)
        usm = cuda.shared.array(0, uint16)
        L, n = lengths[b], ntok[b]
        lo = s * split
        hi = min(lo + split, L + n)
        if lo >= hi and not normalize:                # an empty split: only its (max, sum) matter
            if tid < MT and mt * MT + tid < M:
                ml_part[b, s, mt * MT + tid, 0] = NEG_INF
                ml_part[b, s, mt * MT + tid, 1] = float32(0)
            return
        for idx in range(tid, MT * D2, THREADS):       # q tile -> bf16 in shared memory
            i, c = idx // D2, 2 * (idx % D2)
            m = mt * MT + i
            x0, x1 = float32(0), float32(0)
            if m < M:
                x0 = q[b, m // h, m % h, c]
                x1 = q[b, m // h, m % h, c + 1]
            usm[U0 + i * DP + c] = _to_bf16(x0)
            usm[U0 + i * DP + c + 1] = _to_bf16(x1)
        if tid < MT:
            fsm[ST + tid] = NEG_INF
            fsm[ST + MT + tid] = float32(0)
        acc = cuda.local.array(ACC, float32)
        for u in range(ACC):
            acc[u] = float32(0)
        regs = cuda.local.array(PF4, uint32)
        for p in range(pf):                           # first step's rows into registers
            idx = tid + p * THREADS
            kr, c = idx // D8, 8 * (idx % D8)
            j = lo + kr
            x, y, z, v = uint32(0), uint32(0), uint32(0), uint32(0)
            if idx < nk * D8 and j < hi:
                x, y, z, v = ld16(cache, (b * cap + j) * D + c)
            regs[4 * p], regs[4 * p + 1], regs[4 * p + 2], regs[4 * p + 3] = x, y, z, v
        for c0 in range(lo, hi, nk):
            cuda.syncthreads()
            for p in range(pf):                       # registers -> shared memory
                idx = tid + p * THREADS
                if idx < nk * D8:
                    kr, c = idx // D8, 8 * (idx % D8)
                    _sts(usm, KO + kr * DP + c, regs[4 * p], regs[4 * p + 1], regs[4 * p + 2], regs[4 * p + 3])
            cuda.syncthreads()
            for p in range(pf):                       # next step's rows in flight during this step's math
                idx = tid + p * THREADS
                kr, c = idx // D8, 8 * (idx % D8)
                j = c0 + nk + kr
                x, y, z, v = uint32(0), uint32(0), uint32(0), uint32(0)
                if idx < nk * D8 and j < hi:
                    x, y, z, v = ld16(cache, (b * cap + j) * D + c)
                regs[4 * p], regs[4 * p + 1], regs[4 * p + 2], regs[4 * p + 3] = x, y, z, v
            for nt in range(wj, nk // 8, wn):         # S = Q K^T for n-tile nt of this warp's rows
                s0, s1, s2, s3 = float32(0), float32(0), float32(0), float32(0)
                t0, t1, t2, t3 = float32(0), float32(0), float32(0), float32(0)   # second chain: half the latency
                for kk in range(0, D, 32):
                    b0, b1, b2, b3 = _frag_bn(usm, KO, DP, nt * 8, kk)
                    a0, a1, a2, a3 = _frag_a(usm, U0, DP, wi * 16, kk)
                    s0, s1, s2, s3 = mma_bf16(a0, a1, a2, a3, b0, b1, s0, s1, s2, s3)
                    a0, a1, a2, a3 = _frag_a(usm, U0, DP, wi * 16, kk + 16)
                    t0, t1, t2, t3 = mma_bf16(a0, a1, a2, a3, b2, b3, t0, t1, t2, t3)
                s0, s1, s2, s3 = s0 + t0, s1 + t1, s2 + t2, s3 + t3
                for e in range(4):
                    row = wi * 16 + g + 8 * (e >> 1)
                    col = nt * 8 + 2 * tq + (e & 1)
                    x = s0 if e == 0 else s1 if e == 1 else s2 if e == 2 else s3
                    m, j = mt * MT + row, c0 + col
                    ok = j < hi and m < M
                    if ok and j >= L:
                        jj = j - L
                        if causal:
                            ok = jj <= m // h
                        else:
                            ok = ((mask[b, m // h, jj >> 5] >> uint32(jj & 31)) & uint32(1)) != uint32(0)
                    fsm[row * nk + col] = x * scale if ok else NEG_INF
            cuda.syncthreads()
            if tid < 4 * MT:                          # online softmax, 4 threads per row; P as bf16
                row, c1 = tid >> 2, (tid & 3) * CPT
                m_old = fsm[ST + row]
                mx = m_old
                for c in range(c1, c1 + CPT):
                    mx = max(mx, fsm[row * nk + c])
                mx = max(mx, shfl_xor(mx, 1))
                mx = max(mx, shfl_xor(mx, 2))
                tot = float32(0)
                for c in range(c1, c1 + CPT):
                    pb = uint16(0)
                    if mx != NEG_INF:
                        pb = _to_bf16(math.exp(fsm[row * nk + c] - mx))
                        tot += _from_bf16(pb)
                    usm[PO + row * NKP + c] = pb
                tot += shfl_xor(tot, 1)
                tot += shfl_xor(tot, 2)
                alpha = math.exp(m_old - mx) if mx != NEG_INF else float32(1)
                if c1 == 0:
                    fsm[ST + row] = mx
                    fsm[ST + MT + row] = fsm[ST + MT + row] * alpha + tot
                    fsm[ST + 2 * MT + row] = alpha
            cuda.syncthreads()
            al0, al1 = fsm[ST + 2 * MT + wi * 16 + g], fsm[ST + 2 * MT + wi * 16 + g + 8]
            for u in range(NTP):
                acc[4 * u] *= al0
                acc[4 * u + 1] *= al0
                acc[4 * u + 2] *= al1
                acc[4 * u + 3] *= al1
            for kk in range(0, nk, 16):               # O += P V for this warp's columns
                a0, a1, a2, a3 = _frag_a(usm, PO, NKP, wi * 16, kk)
                for u in range(0, NTP, 2):
                    b0, b1, b2, b3 = _frag_bt(usm, KO, DP, kk, wj * cw + 8 * u)
                    acc[4 * u], acc[4 * u + 1], acc[4 * u + 2], acc[4 * u + 3] = mma_bf16(
                        a0, a1, a2, a3, b0, b1, acc[4 * u], acc[4 * u + 1], acc[4 * u + 2], acc[4 * u + 3])
                    acc[4 * u + 4], acc[4 * u + 5], acc[4 * u + 6], acc[4 * u + 7] = mma_bf16(
                        a0, a1, a2, a3, b2, b3, acc[4 * u + 4], acc[4 * u + 5], acc[4 * u + 6], acc[4 * u + 7])
        cuda.syncthreads()
        for half in range(2):                         # rows g and g+8 of this warp's 16
            row = wi * 16 + g + 8 * half
            m = mt * MT + row
            if m < M:
                live = m // h < n
                den = fsm[ST + MT + row]
                inv = float32(1) / den if den > float32(0) and live else float32(0)
                for u in range(NTP):
                    col = wj * cw + 8 * u + 2 * tq
                    y0, y1 = acc[4 * u + 2 * half], acc[4 * u + 2 * half + 1]
                    if normalize:
                        y0, y1 = y0 * inv, y1 * inv
                    elif not live:
                        y0, y1 = float32(0), float32(0)
                    o_part[b, s, m, col] = y0
                    o_part[b, s, m, col + 1] = y1
                if not normalize and wj == 0 and tq == 0:
                    ml_part[b, s, m, 0] = fsm[ST + row] if live else NEG_INF
                    ml_part[b, s, m, 1] = den if live else float32(0)
    return mla_attention_kernel


class MlaWork:
    """Flash-decoding scratch of mla_attention: cache rows per split and the partial buffers."""

    def __init__(self, zeros, B, M, r, max_keys, split):
        self.split = split
        nsplit = max(1, -(-max_keys // split))
        self.o = zeros((B, nsplit, M, r), np.float32)
        self.ml = zeros((B, nsplit, M, 2), np.float32)


def mla_work(zeros, B, T, h, r, max_keys, split=None, D=576, sms=132):
    """Scratch for up to max_keys cache rows per sequence (committed + new). split=None: about one wave of
    blocks at full length (partials cost 2 * 64*r*4 bytes per block); zeros = np.zeros or cupy.zeros."""
    if split is None:
        wm, _, _, threads, smem = mla_geometry(T * h, D, r)
        per_sm = max(1, min(227 * 1024 // smem, 2048 // threads))
        tiles = B * -(-T * h // (16 * wm))
        nsplit = max(1, min(-(-per_sm * sms // tiles), -(-max_keys // 256)))
        split = -(-max_keys // nsplit)
    split = -(-split // MLA_NK) * MLA_NK
    return MlaWork(zeros, B, T * h, r, max_keys, split)


def mla_attention(q, cache, lengths, ntok, mask, scale, out, work=None):
    """mla_attention_ref on the GPU or the simulator (same arguments). work=None: one split per sequence,
    normalized in place (no scratch); else an MlaWork (splits + merge_splits; read lengths/ntok on the device)."""
    B, T, h, D = q.shape
    r = out.shape[-1]
    if cache.shape[0] != B or cache.shape[2] != D or out.shape != (B, T, h, r) or D % 32 or r % 64:
        raise ValueError(f"mla_attention: q {q.shape} cache {cache.shape} out {out.shape} do not fit "
                         f"(D % 32 == 0, r % 64 == 0)")
    if mask is not None and (mask.shape[:2] != (B, T) or mask.shape[2] * 32 < T):
        raise ValueError(f"mla_attention: mask {mask.shape} is not [B, T, >= T/32] for T = {T}")
    M = T * h
    wm, wn, pf, threads, smem = mla_geometry(M, D, r)
    kern = mla_kernel(wm, wn, pf, mask is None, D, r)
    maskarg = mask if mask is not None else placeholder(q, (1, 1, 1), np.uint32)
    tiles = -(-M // (16 * wm))
    if work is None:
        o4 = out.reshape(B, 1, M, r)
        args = (q, cache, lengths, ntok, maskarg, float32(scale), int32(cache.shape[1]), 1, o4,
                placeholder(q, (1, 1, 1, 2), np.float32))
        launch_smem(kern, (1, tiles, B), threads, smem, args)
        return out
    nsplit = work.o.shape[1]
    args = (q, cache, lengths, ntok, maskarg, float32(scale), int32(work.split), 0, work.o, work.ml)
    launch_smem(kern, (nsplit, tiles, B), threads, smem, args)
    merge_splits_kernel[(M, B), 128, current_stream()](work.o, work.ml, out.reshape(B, M, r))
    return out
