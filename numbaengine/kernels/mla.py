"""MLA's per-head products for the absorbed (latent) form.

W_kv_b viewed [h, nope + v, kv_lora]: W_UK = rows [:nope], W_UV = rows [nope:]. Decode and tree verify
attend in the latent space: q_lat_h = q_nope_h @ W_UK_h, then o_h = o_lat_h @ W_UV_h^T.
"""
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

import numbaengine.kernels.mla_wg as _wg
from numbaengine.kernels import cache as kernel_cache
from numbaengine.kernels.attention import MERGE_DEFAULT, MergeConfig, merge_splits
from numbaengine.kernels.cluster import max_clusters
from numbaengine.kernels.device import (
    LOG2E,
    NEG_INF,
    as_f32,
    as_u32,
    cp_commit,
    cp_wait,
    grid_dep,
    ld16,
    mma_bf16,
    shfl_xor,
    st_quad,
)
from numbaengine.kernels.launch import (
    kernel,
    launch_smem,
    placeholder,
    raise_smem_limit,
)
from numbaengine.kernels.mla_wg import (
    WG_DEFAULT,
    MlaWgConfig,
    mla_wg_applies,
    mla_wg_kernel,
    mla_wg_launch,
    wg_clusters,
)
from numbaengine.kernels.mma import (
    LAZY,
    bf16_pair,
    ex2,
    frag_a,
    frag_bn,
    frag_bt,
    lds2,
    lds4,
    make_cp_piece,
    opaque0,
    pack2,
    row_addr,
    slot_addr,
    sts2f,
    sts2u,
)

MLA_SMEM = 227 * 1024       # shared memory per block on sm_90
MLA_PTX_SIG = ("void(float32[:,:,:,::1], uint16[:,:,::1], int32[::1], int32[::1], uint32[:,:,::1], float32, int32, "
               "int32, float32[:,:,:,::1], float32[:,:,:,::1], float32[:,:,::1], int32[:,::1])")
# ^ the MLA kernels' argument types (both kernels take the same), for compile_ptx in tests and tools
PARTIAL_DTYPES = {"f32": np.float32, "bf16": np.uint16}


@dataclass(frozen=True)
class MlaConfig:
    """Absorbed MLA's choices (this module's mma.sync kernel, the split rule, the 64-head kernel's in `wg`, the
    merge's in `merge`): the defaults are what the engine runs, each with the measurement behind it. The op table
    holds one (KernelOps.mla); tools and tests pass others. Compiled kernels are keyed by the fields they read."""
    nk: int = 64             # cache rows (keys) per pipeline step where two ring slots fit, else 32 (H200, 8 heads,
    #                          context 4K, batch 64: 63.3% of copy with 32, 72.3% with 64: half the barriers per byte)
    max_stages: int = 4      # most cache tiles in the ring (fewer: smaller blocks, several per SM); 2 stages: 56.9% of
    #                          copy against 72.3% (H200, 8 heads, context 4K, batch 64)
    wide_kg: int = 4         # warps per 16 rows in row tiles of 48 or 64 rows (not measured)
    s_tiles: int = 1         # m16 tiles per warp in S = Q K^T (2: each K fragment feeds two row tiles; not measured)
    min_split: int = 64      # fewest keys per flash-decoding split (H200, 8 heads, 4K x batch 1 decode: 13.94 us
    #                          against 15.16 / 20.37 at 128 / 256)
    split_cost: int = 128    # a split's fixed cost in cache rows for the split rule (q prologue, partial write, merge
    #                          share): ~8 us of a 64-head block at ~2.1 us per 32 rows (H200)
    partials: str = "auto"   # the split partials O (mla_work): "bf16" (half the bytes of the store and the merge's
    #                          loads; each partial rounded once, as P already is), "f32", or "auto": bf16 where the
    #                          64-head wgmma kernel runs (mla_wg_applies), else f32. H200, decode, 64 heads, 16K x
    #                          batch 16: 96.33 us bf16 against 99.30 f32 (73.8 / 71.5% of copy); 8 heads (mma.sync)
    #                          0.4-0.7 us slower with bf16 (16K x 16: 93.61 against 93.22 us)
    max_waves: int = 8       # the split rule adds splits up to this many waves of blocks (bounds the partials' memory)
    wg: MlaWgConfig = WG_DEFAULT     # the 64-head wgmma kernel (kernels/mla_wg.py)
    merge: MergeConfig = MERGE_DEFAULT   # the split merge's launch shape (kernels/attention.py)


MLA_DEFAULT = MlaConfig()
_MLA_KERNELS = {}


def _s_tiles(rg, cfg):
    return cfg.s_tiles if rg % cfg.s_tiles == 0 else 1


def _smem_bytes(rg, kg, stages, D, r, nk, smw):
    """Stats and S partials (f32), then Q, P and the cache ring (bf16); the f32 output tile reuses Q and the ring."""
    mt, dp, nkp = 16 * rg, D + 8, nk + 8
    lg = kg * smw
    kgs = -(-(D // 32) // -(-(D // 32) // lg))
    head = 4 * (3 * mt + kgs * mt * nkp)
    return max(head + 2 * (mt * dp + mt * nkp + stages * nk * dp), head + 4 * mt * (r + 8))


def mla_step_keys(rg, kg, D, r, cfg=MLA_DEFAULT):
    """Keys per step: cfg.nk, or 32 where cfg.nk keys leave no room for two ring slots."""
    return cfg.nk if _smem_bytes(rg, kg, 2, D, r, cfg.nk, _s_tiles(rg, cfg)) <= MLA_SMEM else 32


def mla_geometry(M, D, r, cfg=MLA_DEFAULT):
    """(rg, kg, stages, threads, smem bytes) for M query rows (ntok*h), latent width D and output width r. A block
    holds a row tile of 16*rg rows (rg <= 4: the fewest padded rows, then the fewest tiles) and 32*rg*kg threads:
    kg warps per 16 rows split the latent width for S = Q K^T and the r output columns for O += P V; `stages`
    cache tiles of mla_step_keys rows in flight (cp.async ring, at most cfg.max_stages)."""
    rg = min(range(4, 0, -1), key=lambda g: (-(-M // (16 * g)) * g, -(-M // (16 * g))))
    kg = (8 if r % 128 == 0 else 4) if rg <= 2 else cfg.wide_kg
    nk, smw = mla_step_keys(rg, kg, D, r, cfg), _s_tiles(rg, cfg)
    stages = max([st for st in range(2, max(2, cfg.max_stages) + 1)
                  if _smem_bytes(rg, kg, st, D, r, nk, smw) <= MLA_SMEM], default=0)
    if not stages:
        raise ValueError(f"mla_attention: D = {D}, r = {r} too large for shared memory")
    return rg, kg, stages, 32 * rg * kg, _smem_bytes(rg, kg, stages, D, r, nk, smw)


def mla_kernel(rg, kg, stages, causal, D, r, nk=None, cfg=MLA_DEFAULT):
    """The absorbed-attention kernel for one geometry (mla_geometry), latent width D, output width r, nk keys per
    step (None: mla_step_keys; compiled once per key)."""
    key = (rg, kg, stages, causal, D, r, mla_step_keys(rg, kg, D, r, cfg) if nk is None else nk, _s_tiles(rg, cfg))
    if key not in _MLA_KERNELS:
        _MLA_KERNELS[key] = _make_mla_kernel(*key)
    return _MLA_KERNELS[key]


@dataclass(frozen=True)
class MlaLayout:
    """One mma.sync kernel's compile-time sizes (mla_geometry's rg, kg, stages; NK keys per step; SMW m16 tiles per
    warp in S): roles of the warps, shared memory offsets (f32 stats and S partials, then uint16 Q, P and the ring)
    and the lengths of the register arrays."""
    rg: int
    kg: int
    stages: int
    D: int
    r: int
    NK: int
    SMW: int

    MT = property(lambda k: 16 * k.rg)                  # rows of the tile
    THREADS = property(lambda k: 32 * k.rg * k.kg)
    DP = property(lambda k: k.D + 8)                    # Q/K row stride (conflict-free ldmatrix)
    D8 = property(lambda k: k.D // 8)                   # 16-byte pieces of a cache row
    RGS = property(lambda k: k.rg // k.SMW)             # S = Q K^T: warp (wi, gj) has SMW m16 tiles of row group wi
    KPW = property(lambda k: -(-(k.D // 32) // (k.kg * k.SMW)))     # and k32 steps [gj*KPW, ...)
    KGS = property(lambda k: -(-(k.D // 32) // k.KPW))  # warps per row group with S work (partial sums)
    NKP = property(lambda k: k.NK + 8)                  # row stride of the S partials (f32, 8 mod 32 words: float2
    PM = property(lambda k: 2 if k.rg % 2 == 0 and (k.r // (2 * k.kg)) % 16 == 0 else 1)   # stores conflict-free)
    PR = property(lambda k: k.rg // k.PM)               # O += P V: m16 tiles per warp, row groups of O
    CW = property(lambda k: k.r // (k.kg * k.PM))       # O columns per warp
    NTP = property(lambda k: k.CW // 8)
    TPR = property(lambda k: k.THREADS // k.MT)         # softmax threads per row (2*kg)
    CPT = property(lambda k: k.NK // k.TPR)             # softmax columns per thread: NCH chunks of VW adjacent ones
    VW = property(lambda k: min(4, k.CPT))
    NCH = property(lambda k: k.CPT // k.VW)
    PPT = property(lambda k: -(-(k.NK * k.D8) // k.THREADS))        # 16-byte pieces per thread and tile
    RED = property(lambda k: 3 * k.MT)                  # f32 offsets: stats (max, sum, alpha), then S partials
    U0 = property(lambda k: 2 * (k.RED + k.KGS * k.MT * k.NKP))     # uint16 offsets: Q tile, P tile, cache ring
    PO = property(lambda k: k.U0 + k.MT * k.DP)
    KB = property(lambda k: k.PO + k.MT * k.NKP)
    KSTAGE = property(lambda k: k.NK * k.DP)
    OB = property(lambda k: k.U0 // 2)                  # f32 output tile [MT][r + 8] over the Q tile and the ring
    D4 = property(lambda k: k.D // 4)                   # 16-byte pieces of a q row (f32)
    QPT = property(lambda k: -(-(k.MT * k.D4) // k.THREADS))        # q pieces per thread
    QG = property(lambda k: min(k.QPT, 8))              # q loads in flight per thread
    ACC = property(lambda k: 4 * k.PM * k.NTP)          # local (register) arrays: O, S, A fragments, q
    SACC = property(lambda k: k.SMW * k.NK // 2)
    AFR = property(lambda k: max(4 * k.PM, 8 * k.SMW))
    QV = property(lambda k: 4 * k.QG)


def _mla_prologue(k):
    """load_tile (cp.async of a cache tile into a ring slot, rows past the split as zeros) and q_tile (q tile ->
    bf16 pairs in shared memory, QG 16-byte loads in flight per thread; the row statistics initialized)."""
    NK, THREADS, MT, D, D4, DP, U0, KB, KSTAGE, PPT, QPT, QG = (k.NK, k.THREADS, k.MT, k.D, k.D4, k.DP, k.U0, k.KB,
                                                                 k.KSTAGE, k.PPT, k.QPT, k.QG)
    cp_piece = make_cp_piece(k.D8, NK * k.D8)

    @cuda.jit(device=True, inline="always")
    def load_tile(usm, cache, row0, j0, hi, stage, tid):
        """cp.async of cache rows j0..j0+NK-1 (flat row row0 + j of the cache) into ring slot `stage`, rows >= hi
        as zeros: pieces tid + p*THREADS of the tile (flat 16-byte pieces, 32-bit index math in PTX)."""
        slot = slot_addr(usm, KB + stage * KSTAGE)
        gptr = row_addr(cache, (row0 + j0) * D)
        gsafe = row_addr(cache, row0 * D)
        for p in range(PPT):
            cp_piece(usm, slot, cache, gptr, gsafe, tid + p * THREADS, hi - j0)
        cp_commit()

    @cuda.jit(device=True, inline="always")
    def q_tile(q, fsm, wsm, qv, b, M, mt, tid):
        for p0 in range(0, QPT, QG):                  # q tile: QG 16-byte loads in flight, then bf16 pairs
            for p in range(QG):                       # piece idx: row idx // D4, 4 values at 4 (idx % D4); in
                idx = uint32(tid + (p0 + p) * THREADS)    # unsigned 32 bits the division is a multiply-shift
                qr = idx // uint32(D4)
                m = mt * MT + qr
                qv[4 * p], qv[4 * p + 1], qv[4 * p + 2], qv[4 * p + 3] = uint32(0), uint32(0), uint32(0), uint32(0)
                if idx < MT * D4 and m < M:
                    qv[4 * p], qv[4 * p + 1], qv[4 * p + 2], qv[4 * p + 3] = ld16(
                        q, (b * M + m) * D + 4 * (idx - qr * uint32(D4)))
            for p in range(QG):
                idx = uint32(tid + (p0 + p) * THREADS)
                if idx < MT * D4:
                    qr = idx // uint32(D4)
                    o = uint32((U0 + qr * DP + 4 * (idx - qr * uint32(D4))) // 2)
                    wsm[o] = bf16_pair(as_f32(qv[4 * p]), as_f32(qv[4 * p + 1]))
                    wsm[o + uint32(1)] = bf16_pair(as_f32(qv[4 * p + 2]), as_f32(qv[4 * p + 3]))
        if tid < MT:
            fsm[tid] = NEG_INF
            fsm[MT + tid] = float32(0)
    return load_tile, q_tile


def _mla_scores(k):
    """s_partials: warp (wi, gj)'s share of S = Q K^T (k32 steps [gj*KPW, ...) of SMW m16 row tiles, mma.sync bf16)
    into the f32 S partials in shared memory (float2 stores: rows g, g+8, stride 8 mod 32 words)."""
    NK, D, DP, MT, NKP, SMW, KPW, SACC = k.NK, k.D, k.DP, k.MT, k.NKP, k.SMW, k.KPW, k.SACC

    @cuda.jit(device=True, inline="always")
    def s_partials(usm, fsm, sacc, afr, QO, KO, RZ, wi, gj, g, tq):
        for u in range(SACC):
            sacc[u] = float32(0)
        for c in range(KPW):
            kk = 32 * (gj * KPW + c)
            if kk >= D:
                break
            for mi in range(SMW):                 # Q fragments of k16 steps kk and kk+16
                afr[8 * mi], afr[8 * mi + 1], afr[8 * mi + 2], afr[8 * mi + 3] = frag_a(
                    usm, QO, DP, (wi * SMW + mi) * 16, kk)
                afr[8 * mi + 4], afr[8 * mi + 5], afr[8 * mi + 6], afr[8 * mi + 7] = frag_a(
                    usm, QO, DP, (wi * SMW + mi) * 16, kk + 16)
            for nt in range(NK // 8):
                b0, b1, b2, b3 = frag_bn(usm, KO, DP, nt * 8, kk)
                for mi in range(SMW):
                    x = 4 * (mi * (NK // 8) + nt)
                    s0, s1, s2, s3 = mma_bf16(afr[8 * mi], afr[8 * mi + 1], afr[8 * mi + 2], afr[8 * mi + 3],
                                              b0, b1, sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3])
                    sacc[x], sacc[x + 1], sacc[x + 2], sacc[x + 3] = mma_bf16(
                        afr[8 * mi + 4], afr[8 * mi + 5], afr[8 * mi + 6], afr[8 * mi + 7], b2, b3,
                        s0, s1, s2, s3)
        for mi in range(SMW):                     # float2 stores: rows g, g+8 (stride 8 mod 32 words)
            so = RZ + (gj * MT + (wi * SMW + mi) * 16 + g) * NKP + 2 * tq
            for nt in range(NK // 8):
                x = 4 * (mi * (NK // 8) + nt)
                sts2f(fsm, uint32(so + nt * 8), sacc[x], sacc[x + 1])
                sts2f(fsm, uint32(so + 8 * NKP + nt * 8), sacc[x + 2], sacc[x + 3])
    return s_partials


def _mla_softmax(k, causal):
    """softmax: the online softmax of the step, TPR threads per row (f32, base 2), P as bf16 into its tile; the
    partials of S summed in order, the masks only where the step passes `plain`; the row's thread sc == 0 writes
    the new max, the sum and alpha."""
    NK, MT, NKP, KGS, VW, NCH, CPT, TPR = k.NK, k.MT, k.NKP, k.KGS, k.VW, k.NCH, k.CPT, k.TPR
    LOG_TPR = TPR.bit_length() - 1

    @cuda.jit(device=True, inline="always")
    def softmax(fsm, wsm, sacc, mask, scale, c0, z, RZ, PZ, srow, sc, sm_, tmask, hi, L, plain, M, h, b):
        m_old = fsm[uint32(srow + z)]             # online softmax: TPR threads per row, P as bf16
        mx = m_old
        for c in range(NCH):                      # columns VW*sc + VW*TPR*c + e: 128-byte rows per 8 lanes
            col = VW * sc + VW * TPR * c
            for e in range(VW):
                sacc[VW * c + e] = float32(0)
            for gg in range(KGS):
                o = uint32(RZ + (gg * MT + srow) * NKP + col)
                if VW == 4:
                    x0, x1, x2, x3 = lds4(fsm, o)
                    sacc[VW * c] += x0
                    sacc[VW * c + 1] += x1
                    sacc[VW * c + 2] += x2
                    sacc[VW * c + 3] += x3
                else:
                    x0, x1 = lds2(fsm, o)
                    sacc[VW * c] += x0
                    sacc[VW * c + 1] += x1
            for e in range(VW):
                sacc[VW * c + e] *= scale
        if c0 + NK > plain:                       # the split's end or new tokens in this step: masks
            for c in range(NCH):
                for e in range(VW):
                    j = c0 + VW * sc + VW * TPR * c + e
                    ok = j < hi and sm_ < M
                    if ok and j >= L:
                        jj = j - L
                        if causal:
                            ok = jj * h <= sm_
                        else:
                            ok = ((mask[b, tmask, jj >> 5] >> uint32(jj & 31)) & uint32(1)) != uint32(0)
                    if not ok:
                        sacc[VW * c + e] = NEG_INF
        for c in range(CPT):
            mx = max(mx, sacc[c])
        for c in range(LOG_TPR):
            mx = max(mx, shfl_xor(mx, 1 << c))
        if m_old != NEG_INF and mx <= m_old + LAZY:   # lazy rescale: keep the old max (P <= 2^LAZY)
            mx = m_old
        mz = mx if mx != NEG_INF else float32(0)      # masked scores: 2^-inf = 0
        tot = float32(0)
        for c in range(NCH):
            o = uint32(PZ + srow * NKP + VW * sc + VW * TPR * c) >> uint32(1)
            w0 = pack2(ex2(sacc[VW * c] - mz), ex2(sacc[VW * c + 1] - mz))
            tot += as_f32(w0 << uint32(16)) + as_f32(w0 & uint32(0xFFFF0000))
            if VW == 4:
                w1 = pack2(ex2(sacc[VW * c + 2] - mz), ex2(sacc[VW * c + 3] - mz))
                tot += as_f32(w1 << uint32(16)) + as_f32(w1 & uint32(0xFFFF0000))
                sts2u(wsm, o, w0, w1)
            else:
                wsm[o] = w0
        for c in range(LOG_TPR):
            tot += shfl_xor(tot, 1 << c)
        if sc == 0:
            alpha = ex2(m_old - mx) if mx != m_old else float32(1)
            fsm[uint32(srow + z)] = mx
            fsm[uint32(MT + srow + z)] = fsm[uint32(MT + srow + z)] * alpha + tot
            fsm[uint32(2 * MT + srow + z)] = alpha
    return softmax


def _mla_pv(k):
    """pv: O += P V for warp (pr, pc)'s 16*PM rows and CW columns (mma.sync bf16, f32 accumulators acc), after the
    rescale of its rows by alpha; and out_tile: the accumulators into the f32 output tile in shared memory."""
    NK, MT, NKP, DP, PM, NTP, CW, OB, RS, ACC = k.NK, k.MT, k.NKP, k.DP, k.PM, k.NTP, k.CW, k.OB, k.r + 8, k.ACC

    @cuda.jit(device=True, inline="always")
    def pv(usm, fsm, acc, afr, PZ, KO, z, pr, pc, g):
        for mi in range(PM):                      # O += P V for this warp's rows and columns
            r0 = (pr * PM + mi) * 16
            al0, al1 = fsm[uint32(2 * MT + z + r0 + g)], fsm[uint32(2 * MT + z + r0 + g + 8)]
            if al0 != float32(1) or al1 != float32(1):   # rare with the lazy rescale
                for u in range(NTP):
                    acc[4 * (mi * NTP + u)] *= al0
                    acc[4 * (mi * NTP + u) + 1] *= al0
                    acc[4 * (mi * NTP + u) + 2] *= al1
                    acc[4 * (mi * NTP + u) + 3] *= al1
        for kk in range(0, NK, 16):
            for mi in range(PM):                  # P fragments of this warp's rows, then V pairs of n-tiles
                afr[4 * mi], afr[4 * mi + 1], afr[4 * mi + 2], afr[4 * mi + 3] = frag_a(
                    usm, PZ, NKP, (pr * PM + mi) * 16, kk)
            for u in range(0, NTP, 2):
                b0, b1, b2, b3 = frag_bt(usm, KO, DP, kk, pc * CW + 8 * u)
                for mi in range(PM):
                    x = 4 * (mi * NTP + u)
                    acc[x], acc[x + 1], acc[x + 2], acc[x + 3] = mma_bf16(
                        afr[4 * mi], afr[4 * mi + 1], afr[4 * mi + 2], afr[4 * mi + 3], b0, b1,
                        acc[x], acc[x + 1], acc[x + 2], acc[x + 3])
                    acc[x + 4], acc[x + 5], acc[x + 6], acc[x + 7] = mma_bf16(
                        afr[4 * mi], afr[4 * mi + 1], afr[4 * mi + 2], afr[4 * mi + 3], b2, b3,
                        acc[x + 4], acc[x + 5], acc[x + 6], acc[x + 7])

    @cuda.jit(device=True, inline="always")
    def out_tile(fsm, acc, pr, pc, g, tq):
        for x in range(0, ACC, 2):                # acc pairs: (m16 tile, n-tile, row g or g+8)
            row = (pr * PM + x // (4 * NTP)) * 16 + g + 8 * ((x // 2) & 1)
            col = pc * CW + 8 * ((x // 4) % NTP) + 2 * tq
            fsm[OB + row * RS + col] = acc[x]
            fsm[OB + row * RS + col + 1] = acc[x + 1]
    return pv, out_tile


def _mla_store(k):
    """store_rows: coalesced rows of o_part from the output tile, 4 columns a thread (normalized, or with their
    (max, sum) partials); rows of dead queries get 0."""
    MT, r, R4, THREADS, OB, RS = k.MT, k.r, k.r // 4, k.THREADS, k.OB, k.r + 8

    @cuda.jit(device=True, inline="always")
    def store_rows(fsm, o_part, ml_part, b, s, M, mt, n, h, normalize, tid):
        nlive = n * h                                 # rows m < n*h belong to live queries
        for idx in range(tid, MT * R4, THREADS):      # coalesced rows of o_part, 4 columns a thread
            row = idx // R4
            col = 4 * (idx - row * R4)
            m = mt * MT + row
            if m < M:
                live = m < nlive
                den = fsm[MT + row]
                y = cuda.local.array(4, float32)
                for c in range(4):
                    y[c] = fsm[OB + row * RS + col + c]
                    if normalize:
                        y[c] = y[c] / den if den > float32(0) and live else float32(0)
                    elif not live:
                        y[c] = float32(0)
                st_quad(o_part, ((b * o_part.shape[1] + s) * M + m) * r + col, as_u32(y[0]), as_u32(y[1]),
                        as_u32(y[2]), as_u32(y[3]))       # f32, or bf16 partials (MlaWork)
                if not normalize and col == 0:
                    ml_part[b, s, m, 0] = fsm[row] if live else NEG_INF
                    ml_part[b, s, m, 1] = den if live else float32(0)
    return store_rows


def _make_mla_kernel(rg, kg, stages, causal, D, r, NK, SMW):
    """The kernel of one geometry (mla_kernel's key), from its steps: load_tile, q_tile, s_partials, softmax, pv,
    out_tile, store_rows."""
    k = MlaLayout(rg, kg, stages, D, r, NK, SMW)
    assert k.VW in (2, 4) and k.CPT % k.VW == 0 and NK % 16 == 0
    MT, THREADS, QV, ACC, SACC, AFR, U0, PO, KB, RED, KSTAGE = (k.MT, k.THREADS, k.QV, k.ACC, k.SACC, k.AFR, k.U0,
                                                                 k.PO, k.KB, k.RED, k.KSTAGE)
    RGS, PR, TPR, KGS = k.RGS, k.PR, k.TPR, k.KGS
    cp_wait_ring, cp_wait_all = cp_wait(stages - 2), cp_wait(0)
    load_tile, q_tile = _mla_prologue(k)
    s_partials, softmax = _mla_scores(k), _mla_softmax(k, causal)
    pv, out_tile = _mla_pv(k)
    store_rows = _mla_store(k)

    @kernel(max_registers=min(255, 65536 // THREADS // 8 * 8))   # the block fits the register file
    def mla_attention_kernel(q, cache, lengths, ntok, mask, scale, split, normalize, o_part, ml_part, out, count):
        """Block (row tile, split s, sequence b) of 32*rg*kg threads over cache rows [s*split, +split) of b:
        query rows m = t*h + head of tile mt. Per step of NK rows (a cp.async ring of `stages` tiles, one barrier
        per phase): warp (wi, gj) sums S = Q K^T over its share of the latent width on tensor cores, the partials
        meet in shared memory, an online softmax (f32, base 2: `scale` includes log2 e) leaves P as bf16, and warp
        (pr, pc) adds P V for its 16*PM rows and CW columns (mma.sync bf16, f32 accumulators). Steps wholly inside
        the committed rows skip the masks. Grid (ceil(M / MT), splits, B), mla_geometry's threads and shared
        bytes. Bytes: each cache row of the split once per row tile (tiles of one split run side by side: L2), q
        once, partials MT*r*4 per block. out, count: unread (kernels/mla_wg.py's kernel takes the same arguments:
        its cluster merge's output, MlaWgConfig.stamps' buffer)."""
        grid_dep()
        T, h = q.shape[1], q.shape[2]
        mt, s, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane, w = tid & 31, tid >> 5
        g, tq = lane >> 2, lane & 3
        M = T * h
        fsm = cuda.shared.array(0, float32)
        usm = cuda.shared.array(0, uint16)
        wsm = cuda.shared.array(0, uint32)
        qv = cuda.local.array(QV, uint32)
        L, n = lengths[b], ntok[b]
        lo = s * split
        hi = min(lo + split, L + n)
        if lo >= hi and not normalize:                # an empty split: only its (max, sum) matter
            if tid < MT and mt * MT + tid < M:
                ml_part[b, s, mt * MT + tid, 0] = NEG_INF
                ml_part[b, s, mt * MT + tid, 1] = float32(0)
            return
        row0 = b * cache.shape[1]
        for p in range(stages - 1):                   # the ring's first tiles in flight
            load_tile(usm, cache, row0, lo + p * NK, hi, p, tid)
        q_tile(q, fsm, wsm, qv, b, M, mt, tid)
        acc = cuda.local.array(ACC, float32)
        for u in range(ACC):
            acc[u] = float32(0)
        sacc = cuda.local.array(SACC, float32)
        afr = cuda.local.array(AFR, uint32)
        wi, gj = w % RGS, w // RGS                    # S roles
        pr, pc = w % PR, w // PR                      # P V roles
        srow, sc = tid // TPR, tid % TPR              # softmax role: row, first column chunk
        sm_ = mt * MT + srow
        tmask = min(sm_ // h, T - 1)                  # its query (mask row)
        plain = min(hi, L)                            # steps ending here see no mask
        nsteps = (hi - lo + NK - 1) // NK
        for i in range(nsteps):
            c0 = lo + i * NK
            z = opaque0()                            # addresses below: base + z + constant, made in the loop
            cp_wait_ring()
            cuda.syncthreads()                        # tile i landed; step i-1 done with its slot
            load_tile(usm, cache, row0, c0 + (stages - 1) * NK, hi, (i + stages - 1) % stages, tid)
            KO = KB + (i % stages) * KSTAGE + z
            QO, PZ, RZ = U0 + z, PO + z, RED + z
            if gj < KGS:                              # S partial over k32 steps [gj*KPW, ...)
                s_partials(usm, fsm, sacc, afr, QO, KO, RZ, wi, gj, g, tq)
            cuda.syncthreads()
            softmax(fsm, wsm, sacc, mask, scale, c0, z, RZ, PZ, srow, sc, sm_, tmask, hi, L, plain, M, h, b)
            cuda.syncthreads()
            pv(usm, fsm, acc, afr, PZ, KO, z, pr, pc, g)
        cp_wait_all()
        cuda.syncthreads()                            # the Q tile and the ring become the output tile
        out_tile(fsm, acc, pr, pc, g, tq)
        cuda.syncthreads()
        store_rows(fsm, o_part, ml_part, b, s, M, mt, n, h, normalize, tid)
    return mla_attention_kernel


class MlaWork:
    """Flash-decoding scratch of mla_attention: cache rows per split and the partial buffers (o: f32, or bf16 bits
    as uint16 with partials="bf16")."""

    def __init__(self, zeros, B, M, r, max_keys, split, partials="f32"):
        if partials not in PARTIAL_DTYPES:
            raise ValueError(f"mla_work: partials {partials!r} is not one of {['auto', *sorted(PARTIAL_DTYPES)]}")
        self.split = split
        nsplit = max(1, -(-max_keys // split))
        self.o = zeros((B, nsplit, M, r), PARTIAL_DTYPES[partials])
        self.ml = zeros((B, nsplit, M, 2), np.float32)
        self.count = zeros((1, 1), np.int32)     # the kernels' count argument, unread (tools/mla_stamps.py puts
        #                                          MlaWgConfig.stamps' buffer here)
        self.cluster = 0                         # the cluster size of the last mla_attention call (0: none)


def mla_work(zeros, B, T, h, r, max_keys, split=None, D=576, sms=132, partials=None, cfg=MLA_DEFAULT):
    """Scratch for up to max_keys cache rows per sequence (committed + new); zeros = np.zeros or cupy.zeros;
    partials "f32", "bf16" or "auto" (bf16 for the 64-head wgmma kernel; None: cfg.partials).
    split=None: the split count (at least cfg.min_split keys each, at most cfg.max_waves waves of blocks) that
    minimizes waves x (keys per split + cfg.split_cost). Within one wave that is as many splits as fit beside
    the row tiles; it also takes more waves of many splits where one split per
    tile would leave SMs idle (tiles just above half a wave, or just above a whole one: 68 tiles of a
    4-sequence 17-node tree on 132 SMs ran 1 split at 209 TFLOP/s against 339 at 7 splits for 17 tiles)."""
    rg, kg, _, _, smem = mla_geometry(T * h, D, r, cfg)
    nk = mla_step_keys(rg, kg, D, r, cfg)
    if split is None:
        tiles = B * -(-T * h // (16 * rg))
        slots = sms * max(1, MLA_SMEM // smem)
        most = min(-(-max_keys // cfg.min_split), max(1, cfg.max_waves * slots // tiles))
        nsplit = min(range(1, most + 1),                                 # the fewest splits among equals
                     key=lambda ns: -(-tiles * ns // slots) * (-(-max_keys // ns) + cfg.split_cost))
        split = -(-max_keys // nsplit)
    step = np.lcm(nk, cfg.wg.nk)                  # whole steps of either kernel (mla_wg's for 64-head tiles)
    split = -(-split // step) * step
    partials = partials or cfg.partials
    if partials == "auto":
        partials = "bf16" if mla_wg_applies(h, D, r, cfg.wg) else "f32"
    return MlaWork(zeros, B, T * h, r, max_keys, int(split), partials)


def cluster_pays(blocks, size, fits, slots):
    """Run `blocks` split blocks as clusters of `size` (kernels/mla_wg.py's in-kernel merge) only where they need
    no more waves than a plain launch: `fits` clusters resident at once (cuOccupancyMaxActiveClusters) against
    `slots` block slots. A cluster's blocks must share a GPC, so fewer may fit (H200: 16 clusters of 8 took 196 us
    where 128 plain blocks and the merge launch took 115)."""
    return fits > 0 and -(-blocks // (size * fits)) <= -(-blocks // slots)


_MERGE_PICK = {}


def pick_cluster(sizes, kernel_args, threads, smem, blocks, tag):
    """The first of the candidate cluster sizes that pays (cluster_pays, the driver's count of resident clusters
    of the compiled kernel_args(size) = (kernel, args)), or 0; decided once per (kernel tag, sizes, blocks, shared
    bytes, device): later calls are a dict lookup, no compile or driver query."""
    dev = cuda.get_current_device()
    key = (tag, tuple(sizes), blocks, threads, smem, dev.id)
    if key not in _MERGE_PICK:
        if kernel_cache.dry_run():                # precompile: every candidate to the workers at once, then ask
            for c in sizes:
                kernel_cache.record_launch(*kernel_args(c))
        slots = dev.MULTIPROCESSOR_COUNT * max(1, MLA_SMEM // smem)
        _MERGE_PICK[key] = next((c for c in sizes if cluster_pays(
            blocks, c, max_clusters(raise_smem_limit(*kernel_args(c), smem), threads, smem, (1, c, 1)), slots)), 0)
    return _MERGE_PICK[key]


def mla_attention(q, cache, lengths, ntok, mask, scale, out, work=None, cfg=MLA_DEFAULT):
    """mla_attention_ref on the GPU or the simulator (same arguments). work=None: one split per sequence,
    normalized in place (no scratch); else an MlaWork (splits; read lengths/ntok on the device), merged by
    merge_splits (or, 64-head tiles, inside the kernel by thread-block clusters of the split blocks where they fit:
    kernels/mla_wg.py cluster_merge, cluster_pays).
    Launch: grid (row tiles, splits, B) of mla_geometry's threads and shared memory, or kernels/mla_wg.py's
    (mla_wg_launch) for 64-head tiles on sm_90. cfg: the kernels' choices (MlaConfig)."""
    B, T, h, D = q.shape
    r = out.shape[-1]
    if cache.shape[0] != B or cache.shape[2] != D or out.shape != (B, T, h, r) or D % 32 or r % 64:
        raise ValueError(f"mla_attention: q {q.shape} cache {cache.shape} out {out.shape} do not fit "
                         f"(D % 32 == 0, r % 64 == 0)")
    if mask is not None and (mask.shape[:2] != (B, T) or mask.shape[2] * 32 < T):
        raise ValueError(f"mla_attention: mask {mask.shape} is not [B, T, >= T/32] for T = {T}")
    if not (q.flags["C_CONTIGUOUS"] and cache.flags["C_CONTIGUOUS"]):
        raise ValueError("mla_attention: q and cache must be C-contiguous (16-byte loads at flat offsets)")
    if not out.flags["C_CONTIGUOUS"]:                 # its [B, M, r] view must be itself, not a copy
        raise ValueError(f"mla_attention: out {out.shape} must be C-contiguous (written through a [B, T h, r] view)")
    M = T * h
    nsplit = 1 if work is None else work.o.shape[1]
    tmap, sizes, wg = (), [], mla_wg_applies(h, D, r, cfg.wg)     # the wgmma kernel's tensor map, after the cache
    if wg:                                        # 64-head tiles on an sm_90 GPU: both products on wgmma
        sizes = wg_clusters(nsplit, cfg.wg)       # splits merged in the kernel through distributed shared memory
        kern, tiles, threads, smem, tm = mla_wg_launch(M, D, r, mask is None, work, cache, cfg.wg)
        tmap = (tm,)
    else:
        rg, kg, stages, threads, smem = mla_geometry(M, D, r, cfg)
        kern, tiles = mla_kernel(rg, kg, stages, mask is None, D, r, cfg=cfg), -(-M // (16 * rg))
    if wg and work is not None and work.o.dtype != np.float32 and not cfg.wg.staged:
        raise ValueError("mla_attention: bf16 partials need MlaWgConfig.staged (its register stores are f32)")
    maskarg = mask if mask is not None else placeholder(q, (1, 1, 1), np.uint32)
    if wg and _wg.wg_stamps(0, cfg.wg):           # (stamp mode: every 64-head call brings the stamps' buffer)
        _wg.check_stamps(None if work is None else work.count, tiles * nsplit * B)
    if work is None:                              # out is o_part (out, count: unread)
        args = (q, cache, *tmap, lengths, ntok, maskarg, float32(scale * LOG2E),
                int32(cache.shape[1]), 1, out.reshape(B, 1, M, r), placeholder(q, (1, 1, 1, 2), np.float32),
                placeholder(q, (1, 1, 1), np.float32), placeholder(q, (1, 1), np.int32))
        launch_smem(kern, (tiles, 1, B), threads, smem, args)
        return out
    out3 = out.reshape(B, M, r)

    args = (q, cache, *tmap, lengths, ntok, maskarg, float32(scale * LOG2E), int32(work.split), 0,
            work.o, work.ml, out3, work.count)
    cluster = pick_cluster(
        sizes, lambda c: (mla_wg_kernel(D, r, mask is None, cluster=c, cfg=cfg.wg), args), threads, smem,
        tiles * nsplit * B, (D, r, mask is None)) if sizes else 0
    if cluster:                                   # all the splits of a tile in one cluster: it writes out
        kern = mla_wg_kernel(D, r, mask is None, cluster=cluster, cfg=cfg.wg)
    work.cluster = cluster                        # (what ran: benchmarks report it)
    launch_smem(kern, (tiles, nsplit, B), threads, smem, args, cluster=(1, cluster, 1) if cluster else None)
    if nsplit != cluster:
        merge_splits(work.o, work.ml, out3, cfg.merge)
    return out
