"""Dense GEMM on warpgroup MMA (sm_90a) for bf16 weights: out f32[m, n] = x f32[m, k] @ bf16(W u16[n, k])^T.

Why: the mma.sync GEMM of kernels/gemm.py carries its weights through registers, so the bytes a warp keeps in
flight are capped by its registers; at 17-33 token rows it reaches 33-64% of copy on K2's projections
(docs/PERFORMANCE.md, "Kernels"). Here the copy engine fills a ring of shared-memory stages (one thread issues; an
mbarrier per slot) and wgmma reads both operands from there: the bytes in flight are bounded by shared memory alone.

Block (k piece c, strip of BM = 64 MT weight rows, token block z), one warpgroup of 128 threads:
  stage j:  MT TMA boxes of 64 weight rows x 64 k (128-byte swizzle; rows past n land as zeros) and one box of the
            token block's NB rows x 64 k of bf16 activations: a bulk copy from `prep_b` tiled=3 (the same swizzle),
            or (XIN, <= WgConfig.xin_rows rows) stored by the block's threads from f32 x, loaded one iteration ahead;
            then 4 MT wgmma m64nNBk16 into MT x NB/2 f32 accumulators per thread; the slot is refilled with stage
            j + S once stage j + 1's wgmmas are issued and stage j's have retired.
  k split:  the CL k pieces of a strip run as one thread-block cluster; each leaves its partial tile in its shared
            memory and, after the cluster barrier, rank c adds rows [c, c + 1) * BM / CL of all CL partials in rank
            order (DSMEM) and writes them out: no partials in global memory, no reduce launch.
The k pieces (CL) and the order of every sum depend on (n, k) only, not on m: a token's output does not change with
the number of tokens in the call (batch invariance, as kernels/gemm.py).
Bytes: the weights once per token block (n k 2), x once per strip (NB k 2 per block), out once (m n 4).
No simulator twin (TMA, wgmma, clusters): `gemm_wg_applies` is False there and kernels.gemm takes its mma path.
"""
import math
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from numbaengine import env
from numbaengine.kernels.bulk import (
    bulk_load,
    mbar_expect,
    mbar_fence_init,
    mbar_init,
    mbar_wait,
    tensor_load_2d,
    tensormap_acquire,
)
from numbaengine.kernels.cluster import cluster_sync, dsmem_ld16
from numbaengine.kernels.device import (
    F0,
    SIM,
    as_f32,
    device,
    grid_dep,
    ld16,
    lds16,
    pack_bf16x2,
    stamp_point,
)
from numbaengine.kernels.launch import kernel
from numbaengine.kernels.prep import WG_NB_MAX, prep_b, token_blocks, xb_words
from numbaengine.kernels.unroll import each, fill, tfold, tmap, unroll
from numbaengine.kernels.wgmma import (
    fence_proxy_async,
    make_desc,
    make_wgmma,
    wg_commit,
    wg_fence,
    wg_wait0,
    wg_wait1,
)

BOX = 64 * 64 * 2         # bytes of one weight box (64 rows x 64 k bf16)
# The PDL wait stays at the kernel's start: placed after the ring's first weight boxes (which never depend on the
# previous kernel) it measured 0.1-2.0 points of copy lower (H200, chained, q_kv_a and o at m = 1-33).


@dataclass(frozen=True)
class WgConfig:
    """The wgmma GEMM's choices: the defaults are what the engine runs, each with the measurement behind it. The op
    table holds one (KernelOps.gemm_wg); tools and tests pass others; compiled kernels are keyed by what they read."""
    on: bool = env.GEMM_WG   # kernels.gemm.gemm_config takes this path where it applies (gemm_wg_applies);
    #                          NUMBAENGINE_GEMM_WG=0: the mma path everywhere
    target: float = 1.8      # blocks per SM the k split aims at, at most: all resident at once (one wave) with room
    #                          for the clusters' packing into GPCs (a cluster's blocks share one GPC). No measurement
    #                          kept for 1.8; 1.0 (tools.bench_kernels variant wg_t1) measured equal or higher in one
    #                          run (o at m = 1 / 17 / 33: 81.0 / 76.0 / 73.2% of copy against 75.7 / 74.7 / 71.3):
    #                          to be re-timed before either is kept
    cl_max: int = 4          # k pieces per strip (cluster size), 1 .. 8. H200, chained % of copy at m = 17: q_kv_a 46.4
    #                          with clusters of 4 against 37.1 with clusters of 8 (33 clusters either way), shared
    #                          gate_up 62.4 against 50.1 (not profiled: clusters of 8 may not all fit in one wave)
    smem_block: int = 112 * 1024   # shared bytes of a block (ring + x boxes): two fit per SM
    stages_max: int = 12     # most ring stages (not measured)
    xin_rows: int = 8        # token blocks up to this many rows convert their f32 x into the ring's x boxes themselves,
    #                          a stage at a time (XIN: no prep launch), where a stage holds two weight boxes (MT = 2);
    #                          other cuts take x from prep_b tiled=3 by bulk copies. 0: off. H200, chained % of copy at
    #                          m = 1, XIN / prep: o 80.3 / 77.8, kv_b 65.5 / 61.2 (MT = 2); q_kv_a 39.6 / 48.2 (MT = 1:
    #                          twice the f32 x per weight byte, so MT = 1 keeps the prep); at 16 rows XIN lost on every
    #                          shape (o 61.5 / 75.4)
    tmap_fence: bool = True  # fence.proxy.tensormap acquire on the weights' tensor map before the first TMA (orders the
    #                          host's write of the map before the copy engine reads it). Off: maps are never freed or
    #                          rewritten here, so no stale copy can exist; H200, chained % of copy at m = 1 / 17 / 33,
    #                          q_kv_a 49.9 / 48.1 / 46.5 off against 47.8 / 46.6 / 45.0 on (0.3-2.1 points on the four
    #                          shapes timed). On by default because off has had no GPU correctness run (`python -m
    #                          pytest -m gpu tests/test_cuda_gemm_wg.py -k fence` is the check before switching)
    nb_max: int = WG_NB_MAX  # token rows per block (wgmma N, a multiple of 8, <= 256); taller x runs as token blocks
    #                          on grid z, each reading the strip's weights again. 64: the shapes measured (decode and
    #                          tree rows); 128 and 256 compile without spills (ptxas sm_90a: MT = 2 at 128 and MT = 1
    #                          at 256 in 168 registers) and are not yet timed (tools.bench_kernels variants wg_nb128,
    #                          wg_nb256 at prompt-sized m)
    stamps: bool = False     # measurement only (tools/gemm_wg_stamps.py): thread 0 of every block writes (SM cycles,
    #                          global ns) at the 9 STAMP_POINTS of its timeline into `stamps` [blocks, STAMP_WORDS]
    #                          (int32 bits), then its SM and its stages; the kernel takes that array after nbox.
    #                          Default PTX unchanged


WG_GEMM_DEFAULT = WgConfig()
STAMP_POINTS = ("entry", "barriers ready", "stage 0 issued", "ring issued", "x staged", "stage 0 landed",
                "main loop done", "partials published", "out stored")
STAMP_WORDS = 2 * len(STAMP_POINTS) + 2


@dataclass(frozen=True)
class WgCut:
    """How one wgmma GEMM is cut: MT m64 weight tiles per block, CL k pieces (a cluster), S ring stages, NB token
    rows per block (wgmma N), ZB token blocks, XIN: how x reaches the ring's bf16 x boxes: 0 prepared by prep_b and
    bulk-copied, 1 the block's threads load f32 x and convert it."""
    MT: int
    CL: int
    S: int
    NB: int
    ZB: int
    XIN: int = 0


def wg_cut(m, n, k, sms=132, mt=None, cl=None, stages=None, xin=None, cfg=WG_GEMM_DEFAULT):
    """The default cut: MT and CL from (n, k) alone (batch invariance): the MT (2 on a tie) whose strips x k pieces
    come closest to cfg.target blocks per SM without passing it (past it for both: the fewer blocks), k pieces of >= 2
    boxes, <= cfg.cl_max; XIN 1 up to cfg.xin_rows rows with MT = 2 (S >= 3), else 0; S as many stages as
    cfg.smem_block holds. mt / cl / stages / xin override."""
    boxes = k // 64
    target = int(cfg.target * sms)
    options = []
    for MT in ((mt,) if mt else (2, 1)):
        strips = -(-n // (64 * MT))
        CL = cl or max(1, min(cfg.cl_max, boxes // 2, target // strips))
        blocks = strips * CL
        options.append((blocks if blocks <= target else -blocks, MT, CL))   # the most blocks within the target,
    _, MT, CL = max(options)                                                # else the fewest (MT = 2 first)
    NB, ZB = token_blocks(m, cfg.nb_max)
    if xin is None:
        xin = int(NB <= cfg.xin_rows and MT == 2)
    S = stages or max(2, min(cfg.stages_max, cfg.smem_block // _layout(MT, 1, NB)[0]))
    return WgCut(MT, CL, S, NB, ZB, xin if S >= 3 else 0)


def _layout(MT, S, NB):
    """(stage bytes, first mbarrier's byte offset) of the shared memory: S ring stages of MT weight boxes and one
    bf16 x box (NB rows x 128 bytes, 128-byte swizzle); the partial tile [NB][64 MT + 4] f32 reuses the start after
    the main loop. A stage is a multiple of 1024 bytes (NB a multiple of 8): every weight box starts on a swizzle
    period."""
    stage = MT * BOX + NB * 128
    return stage, max(S * stage, NB * (64 * MT + 4) * 4)


def wg_smem(cut):
    """Dynamic shared bytes of a cut: the ring (or the partial tile), then S mbarriers."""
    return _layout(cut.MT, cut.S, cut.NB)[1] + 8 * cut.S


def _sm90():
    if SIM:
        return False
    try:
        return cuda.get_current_device().compute_capability == (9, 0)     # wgmma is sm_90a only
    except Exception:                      # no GPU: the mma path's launch will say so
        return False


def gemm_wg_applies(m, n, k, cfg=WG_GEMM_DEFAULT):
    """Whether this path runs the GEMM: sm_90, k a multiple of 64 (one swizzle span per box) and cfg.on."""
    return cfg.on and k % 64 == 0 and n >= 64 and _sm90()


_KERNELS = {}


def gemm_wg_kernel(MT, CL, S, NB, XIN=0, STAMPS=False, FENCE=True):
    """The kernel for one cut (compiled once per (MT, CL, S, NB, XIN, STAMPS, FENCE: WgConfig.tmap_fence))."""
    key = (MT, CL, S, NB, XIN, STAMPS, FENCE)
    if key not in _KERNELS:
        _KERNELS[key] = _build(*key)
    return _KERNELS[key]


def _ring_steps(MT, S, NB, XIN):
    """Device functions of the ring for one cut: load_stage (thread 0 issues a stage), and with XIN the block's own
    x boxes: x_prologue (the first S stages), x_load / x_store (one stage in flight through registers)."""
    XBOX = NB * 128
    STAGE, BARB = _layout(MT, S, NB)
    XBYTES, BAR = (XBOX if XIN == 0 else 0), BARB // 8     # x's bytes a stage's mbarrier counts; first mbarrier
    XG, CH = 8, NB * 16 // 128         # (XIN) chunks of loads in flight in the prologue; 16-byte chunks per stage
    XCH, XROW, FV = -(-S * NB * 16 // 128), NB * 16, 4 * XG

    @device
    def load_stage(wsm, bars, wmap, xb, xoff, row0, live, box, slot, parts):
        """Thread 0: stage `box` (64 k columns) into ring slot `slot`, completing on the slot's mbarrier: parts & 1
        the expected bytes and the live weight boxes by TMA, parts & 2 the token block's x: (XIN 0) its bf16 box
        from xb (prep_b's layout, the block's boxes from u32 word xoff) by one bulk copy, (XIN 1) nothing."""
        if parts & 1:
            mbar_expect(bars, BAR + slot, live * BOX + XBYTES)
            for t in range(MT):
                if t < live:
                    tensor_load_2d(wsm, (slot * STAGE + t * BOX) // 4, wmap, 64 * box, row0 + 64 * t, bars,
                                   BAR + slot)
        if parts & 2 and XIN == 0:
            bulk_load(wsm, (slot * STAGE + MT * BOX) // 4, xb, xoff + box * (XBOX // 4), XBOX, bars, BAR + slot)

    @device
    def xsrc(tok0, r, m, nbox, box, qd):
        """Element index in f32 x of quad qd (4 columns) of box `box` in token row tok0 + r (past m: row m - 1)."""
        return (min(tok0 + r, m - 1) * nbox + box) * 64 + 4 * qd

    @device
    def xstore(wsm, slot, r, qd, f0, f1, f2, f3):
        """A quad of f32 x (bits) as two bf16 pairs into row r of ring slot `slot`'s x box (128-byte swizzle)."""
        o = (slot * STAGE + MT * BOX) // 4 + r * 32 + (((qd >> 1) ^ (r & 7)) << 2) + 2 * (qd & 1)
        wsm[o] = pack_bf16x2(as_f32(f0), as_f32(f1))
        wsm[o + 1] = pack_bf16x2(as_f32(f2), as_f32(f3))

    @device
    def x_prologue(wsm, x, tok0, m, nbox, b0, ns, tid):
        """(XIN) The 128 threads turn x's rows tok0 .. tok0 + NB - 1 (past m: row m - 1) into the x boxes of the
        first S stages, 16 bytes of f32 x (one quad of a row) per chunk, XG chunks of loads in flight per thread."""
        for i0 in range(0, XCH, XG):
            fv = cuda.local.array(FV, uint32)
            for e in range(XG):
                u = tid + 128 * (i0 + e)
                if u < min(S, ns) * XROW:
                    p, r, qd = u // XROW, (u >> 4) % NB, u & 15
                    fv[4 * e], fv[4 * e + 1], fv[4 * e + 2], fv[4 * e + 3] = ld16(x, xsrc(tok0, r, m, nbox, b0 + p,
                                                                                         qd))
            for e in range(XG):
                u = tid + 128 * (i0 + e)
                if u < min(S, ns) * XROW:
                    p, r, qd = u // XROW, (u >> 4) % NB, u & 15
                    xstore(wsm, p, r, qd, fv[4 * e], fv[4 * e + 1], fv[4 * e + 2], fv[4 * e + 3])
        fence_proxy_async()                            # st.shared -> the wgmma proxy

    @device
    def x_store(wsm, xv, j, ns, tid):
        """(XIN) At the top of iteration j: stage j + S - 2's x, loaded last iteration, into its slot (consumed at
        iteration j + S - 2 >= j + 1: after this iteration's barrier)."""
        if j >= 2 and j + S - 2 < ns:
            for e in range(CH):
                u = tid + 128 * e
                xstore(wsm, (j - 2) % S, u >> 4, u & 15, xv[4 * e], xv[4 * e + 1], xv[4 * e + 2], xv[4 * e + 3])
            fence_proxy_async()

    @device
    def x_load(x, xv, j, ns, tok0, m, nbox, b0, tid):
        """(XIN) At iteration j, beside its weights' TMA: stage j + S - 1's x into registers."""
        if j >= 1 and j + S - 1 < ns:
            for e in range(CH):
                u = tid + 128 * e
                xv[4 * e], xv[4 * e + 1], xv[4 * e + 2], xv[4 * e + 3] = ld16(x, xsrc(tok0, u >> 4, m, nbox,
                                                                                    b0 + j + S - 1, u & 15))
    return load_stage, x_prologue, x_store, x_load


def _tile_steps(MT, CL, NB):
    """Device functions on the block's MT x NB/2 f32 accumulators (MT tuples, wgmma's fragment layout:
    kernels/wgmma.py): mma_stage (a stage's 4 k16 steps of MT wgmmas), store_partials (into the partial tile in
    shared memory) and fold_item (an item of 4 rows x 1 token summed over the CL k pieces)."""
    BMP = 64 * MT + 4                          # f32 row pitch of the partial tile [NB tokens][BM rows]
    wg = make_wgmma(NB)

    @device
    def mma_tile(t, acc, da, db, kk):
        return wg(da + uint64(t * (BOX // 16) + kk * 2), db + uint64(kk * 2), acc, 1)

    @device
    def mma_k(kk, acc, da, db):
        """k16 step kk of a stage: weight tiles 0 .. MT - 1, one wgmma each."""
        return tmap(mma_tile, acc, da, db, kk)

    @device
    def mma_stage(acc, da, db):
        return unroll(4, mma_k, acc, da, db)

    @device
    def store_acc(i, v, fsm, cbase, t):
        # accumulator register 4j + i: row 16 w + g + 8 (i // 2), column 8 j + 2 t + i % 2 (kernels/wgmma.py)
        fsm[(8 * (i // 4) + i % 2) * BMP + cbase + (t * 64 + 8 * ((i % 4) // 2))] = v

    @device
    def store_tile(t, acc, fsm, cbase):
        each(store_acc, acc, fsm, cbase, t)

    @device
    def store_partials(acc, fsm, cbase):
        each(store_tile, acc, fsm, cbase)

    @device
    def load_rank(rank, unused, wsm, idx):
        return dsmem_ld16(wsm, idx, rank)

    @device
    def add_rank(rank, r, v):
        if rank == 0:
            return as_f32(r[0]), as_f32(r[1]), as_f32(r[2]), as_f32(r[3])
        return v[0] + as_f32(r[0]), v[1] + as_f32(r[1]), v[2] + as_f32(r[2]), v[3] + as_f32(r[3])

    @device
    def fold_item(wsm, idx):
        """The item's quad from every rank (DSMEM), all loaded first, then ranks 1 .. CL - 1 added to rank 0's in
        rank order; without a cluster this block's own quad."""
        if CL > 1:
            return tfold(add_rank, tmap(load_rank, fill(CL, 0), wsm, idx), (F0, F0, F0, F0))
        r0_0, r0_1, r0_2, r0_3 = lds16(wsm, idx)
        return as_f32(r0_0), as_f32(r0_1), as_f32(r0_2), as_f32(r0_3)
    return mma_stage, store_partials, fold_item


def _fold_out_step(BM, BMP, CL, NB, fold_item):
    """fold_out: this k piece's share of the strip's output quads (BM / 4 over the CL pieces), each the sum of the
    CL partial tiles (fold_item), written to out rows [row0, n) of the block's tokens (128 threads, a quad each)."""
    @device
    def fold_out(wsm, out, c, row0, tok0, m, n, tid):
        q0 = (c * (BM // 4)) // CL
        nq = ((c + 1) * (BM // 4)) // CL - q0
        mz = min(NB, m - tok0)
        for u in range(tid, mz * nq, 128):
            col = u // nq
            q = q0 + u - col * nq
            v0, v1, v2, v3 = fold_item(wsm, col * BMP + 4 * q)
            row = row0 + 4 * q
            if row < n:
                out[tok0 + col, row] = v0
            if row + 1 < n:
                out[tok0 + col, row + 1] = v1
            if row + 2 < n:
                out[tok0 + col, row + 2] = v2
            if row + 3 < n:
                out[tok0 + col, row + 3] = v3
    return fold_out


def _build(MT, CL, S, NB, XIN, STAMPS, FENCE):
    """The kernel of one cut, from its steps: the ring (load_stage; x_prologue, x_store, x_load with XIN), the
    stage's wgmmas (mma_stage), the partial tile (store_partials) and the k-split fold (fold_item)."""
    BM, XBOX = 64 * MT, NB * 128               # weight rows per block; bytes of one activation box
    STAGE, BARB = _layout(MT, S, NB)
    BAR, BMP = BARB // 8, BM + 4               # first mbarrier (u64 index); f32 row pitch of the partial tile
    NACC, XV, FIRST = NB // 2, 4 * (NB * 16 // 128), 1 if STAMPS else 0
    load_stage, x_prologue, x_store, x_load = _ring_steps(MT, S, NB, XIN)
    mma_stage, store_partials, fold_item = _tile_steps(MT, CL, NB)
    fold_out = _fold_out_step(BM, BMP, CL, NB, fold_item)
    desc = make_desc(16, 1024, 128)

    @device
    def gemm_wg_body(wmap, xb, x, out, m, n, nbox, stamps):
        c, strip, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        if STAMPS:                                 # (STAMPS) thread 0 writes point k of STAMP_POINTS at 2k
            blk = (z * cuda.gridDim.y + strip) * cuda.gridDim.x + c
            if tid == 0:
                sm = stamp_point(stamps, blk, 0)
        wsm = cuda.shared.array(0, uint32, alignment=1024)
        fsm = cuda.shared.array(0, float32, alignment=1024)
        bars = cuda.shared.array(0, uint64, alignment=1024)
        b0 = (c * nbox) // CL
        ns = ((c + 1) * nbox) // CL - b0
        row0 = strip * BM
        tok0 = z * NB
        xoff = z * nbox * (XBOX // 4)
        live = min(MT, (n - row0 + 63) // 64)        # weight boxes of the strip inside the matrix
        if tid == 0:
            for p in range(S):
                mbar_init(bars, BAR + p)
            mbar_fence_init()
            if FENCE:
                tensormap_acquire(wmap)
            if STAMPS:                             # stage 0 issued on its own, then its stamp (in the loop it
                if tid == 0:                       # would be copied by the unrolling)
                    sm = stamp_point(stamps, blk, 2)
                load_stage(wsm, bars, wmap, xb, xoff, row0, live, b0, 0, 3)
                if tid == 0:
                    sm = stamp_point(stamps, blk, 4)
            for p in range(FIRST, min(S, ns)):
                load_stage(wsm, bars, wmap, xb, xoff, row0, live, b0 + p, p, 3)
        if STAMPS and tid == 0:
            sm = stamp_point(stamps, blk, 6)
        if XIN == 1:
            x_prologue(wsm, x, tok0, m, nbox, b0, ns, tid)
            xv = cuda.local.array(XV, uint32)
        cuda.syncthreads()
        if STAMPS and tid == 0:
            sm = stamp_point(stamps, blk, 8)
        acc = fill(MT, fill(NACC, F0))
        for j in range(ns):
            if XIN == 1:
                x_store(wsm, xv, j, ns, tid)
            slot = j % S
            mbar_wait(bars, BAR + slot, (j // S) & 1)
            if STAMPS and j == 0 and tid == 0:
                sm = stamp_point(stamps, blk, 10)
            da = desc(wsm, slot * STAGE)
            db = desc(wsm, slot * STAGE + MT * BOX)
            wg_fence()
            acc = mma_stage(acc, da, db)
            wg_commit()
            wg_wait1()                                 # stage j - 1's wgmmas have retired
            cuda.syncthreads()                         # (all four warps): its slot may be refilled
            if tid == 0 and j >= 1 and j + S - 1 < ns:
                load_stage(wsm, bars, wmap, xb, xoff, row0, live, b0 + j + S - 1, (j - 1) % S, 3)
            if XIN == 1:
                x_load(x, xv, j, ns, tok0, m, nbox, b0, tid)
        wg_wait0()
        cuda.syncthreads()
        if STAMPS and tid == 0:
            sm = stamp_point(stamps, blk, 12)
        w, lane = tid >> 5, tid & 31
        store_partials(acc, fsm, (2 * (lane & 3)) * BMP + 16 * w + (lane >> 2))
        if CL > 1:
            cluster_sync()
        else:
            cuda.syncthreads()
        if STAMPS and tid == 0:
            sm = stamp_point(stamps, blk, 14)
        fold_out(wsm, out, c, row0, tok0, m, n, tid)
        if STAMPS and tid == 0:
            sm = stamp_point(stamps, blk, 16)
        if STAMPS and tid == 0:
            stamps[blk, STAMP_WORDS - 2], stamps[blk, STAMP_WORDS - 1] = int32(sm), int32(ns)
        if CL > 1:
            cluster_sync()

    if STAMPS:
        @kernel(max_registers=255)
        def gemm_wg_k(wmap, xb, x, out, m, n, nbox, stamps):
            """Block (k piece c, strip, token block z) of 128 threads (module docstring); grid (CL, ceil(n / BM),
            ZB) in clusters of CL; `stamps` int32 [blocks, STAMP_WORDS] (WgConfig.stamps). Bytes: the strip's
            weights of this k piece once, its x boxes once, the out rows of its share of the fold once."""
            grid_dep()
            gemm_wg_body(wmap, xb, x, out, m, n, nbox, stamps)
        return gemm_wg_k

    @kernel(max_registers=255)
    def gemm_wg_k(wmap, xb, x, out, m, n, nbox):
        """Block (k piece c, strip, token block z) of 128 threads (module docstring); grid (CL, ceil(n / BM), ZB) in
        clusters of CL. Bytes: the strip's weights of this k piece once, its x boxes once, the out rows of its
        share of the fold once."""
        grid_dep()
        gemm_wg_body(wmap, xb, x, out, m, n, nbox, out)
    return gemm_wg_k


_TMAP = {}


def tensor_map(a, box_rows):
    """The TMA tensor map of contiguous bf16 weights u16[n, k] in boxes of box_rows x 64 columns (128-byte swizzle),
    in device memory. Made on the first call for this address, shape and box and kept (never freed: no map is ever
    rewritten), outside graph capture: engines run a round eagerly before they capture it."""
    from numbaengine.kernels.bulk import tensor_map_2d
    from numbaengine.kernels.launch import data_ptr
    rows, cols = a.shape
    key = (data_ptr(a), rows, cols, box_rows)
    if key not in _TMAP:
        _TMAP[key] = cuda.to_device(tensor_map_2d(key[0], rows, cols, box_rows, 64))
    return _TMAP[key]


def gemm_wg(x, w, out, xb, cut=None, stamps=None, cfg=WG_GEMM_DEFAULT):
    """out f32[m, n] = x f32[m, k] @ bf16(w u16[n, k])^T: one launch of (CL, strips, ZB) blocks in clusters of CL,
    after x -> bf16 boxes in xb (u32, >= xb_words(m, k)) unless the blocks convert x themselves (cut.XIN 1, x
    contiguous; else the cut falls back to XIN 0). w contiguous (its tensor map); out may be a strided view (a
    vocabulary shard's columns). stamps: int32 [>= blocks, STAMP_WORDS] with cfg.stamps on."""
    from numbaengine.kernels.launch import contiguous, launch_smem
    m, k = x.shape
    n = w.shape[0]
    if not gemm_wg_applies(m, n, k, cfg) or not contiguous(w) or out.shape != (m, n):
        raise ValueError(f"gemm_wg: x {x.shape}, w {w.shape}, out {out.shape}: needs sm_90, k % 64 == 0, n >= 64, "
                         f"contiguous w, out [m, n]")
    cut = cut or wg_cut(m, n, k, cuda.get_current_device().MULTIPROCESSOR_COUNT, cfg=cfg)
    if (cut.NB, cut.ZB) != token_blocks(m, cfg.nb_max) or (cut.XIN and cut.S < 3) or cut.CL > k // 64:
        raise ValueError(f"gemm_wg: cut {cut} was not made for m={m}, k={k} (or XIN with fewer than 3 stages, or more "
                         f"k pieces than boxes)")
    if cut.XIN and not contiguous(x):          # (the same bf16 x either way: the same sums)
        cut = replace(cut, XIN=0)
    if not cut.XIN:
        if xb.size < xb_words(m, k, cfg.nb_max):
            raise ValueError(f"gemm_wg: xb of {xb.size} words < {xb_words(m, k, cfg.nb_max)}")
        prep_b(x, xb, 1, 0, tiled=3, nb_max=cfg.nb_max)
    kern = gemm_wg_kernel(cut.MT, cut.CL, cut.S, cut.NB, cut.XIN, cfg.stamps, cfg.tmap_fence)
    grid = (cut.CL, math.ceil(n / (64 * cut.MT)), cut.ZB)
    if cfg.stamps and (stamps is None or stamps.shape[0] < math.prod(grid) or stamps.shape[1] < STAMP_WORDS):
        raise ValueError(f"gemm_wg: WgConfig.stamps needs stamps of [>= {math.prod(grid)} blocks, {STAMP_WORDS}] int32")
    xf = x.reshape(m * k) if cut.XIN else xb.view(np.float32)     # (without XIN: not read)
    args = (tensor_map(w, 64), xb, xf, out, int32(m), int32(n), int32(k // 64))
    launch_smem(kern, grid, 128, wg_smem(cut), args + ((stamps,) if cfg.stamps else ()),
                cluster=(cut.CL, 1, 1) if cut.CL > 1 else None)
    return out
