"""Dense GEMM on warpgroup MMA (sm_90a) for bf16 weights: out f32[m, n] = x f32[m, k] @ bf16(W u16[n, k])^T.

Why: the mma.sync GEMM of kernels/gemm.py carries its weights through registers, so the bytes a warp keeps in
flight are capped by its registers; at 17-33 token rows it reached 33-64% of copy on K2's projections (README,
"Kernel performance"). Here the copy engine fills a ring of shared-memory stages (one thread issues; an mbarrier
per slot) and wgmma reads both operands from there: the bytes in flight are bounded by shared memory alone.

Block (k piece c, strip of BM = 64 MT weight rows, token block z), one warpgroup of 128 threads:
  stage j:  MT TMA boxes of 64 weight rows x 64 k (128-byte swizzle; rows past n land as zeros) and one bulk copy
            of the token block's NB rows x 64 k of bf16 activations (`prep_b` tiled=3 writes them in the same
            swizzle), then 4 MT wgmma m64nNBk16 into MT x NB/2 f32 accumulators per thread; the slot is refilled
            with stage j + S once the next stage's wgmmas are issued and this one's have retired.
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

from kernels.device import SIM

GEMM_WG = True            # kernels.gemm.gemm_config takes this path where it applies (gemm_wg_applies)
WG_NB_MAX = 64            # token rows per block (wgmma N); taller x runs as token blocks on grid z
WG_TARGET = 1.8           # blocks per SM the k split aims at, at most: all resident at once (one wave) with room
#                           for the clusters' packing into GPCs (a cluster's blocks share one GPC)
WG_CL_MAX = 4             # k pieces per strip (cluster size). H200, session 32 call 1: clusters of 8 (q_kv_a: 33
#                           clusters of 8 blocks) ran slower than the mma path, likely a cluster left for a second wave
WG_SMEM_BLOCK = 112 * 1024    # shared bytes of a block (ring + x boxes): two fit per SM
WG_STAGES_MAX = 12
WG_XIN_BYTES = 40 * 1024  # x's boxes of a block's k piece up to this size are converted from f32 x by the block
#                           itself (no prep launch); larger ones are prepared by prep_b tiled=3 and ride in the ring
BOX = 64 * 64 * 2         # bytes of one weight box (64 rows x 64 k bf16)


@dataclass(frozen=True)
class WgCut:
    """How one wgmma GEMM is cut: MT m64 weight tiles per block, CL k pieces (a cluster), S ring stages, NB token
    rows per block (wgmma N), ZB token blocks, XIN: the block converts its piece of f32 x into shared memory itself
    (0: x prepared by prep_b, its boxes in the ring)."""
    MT: int
    CL: int
    S: int
    NB: int
    ZB: int
    XIN: int = 0


def token_blocks(m):
    """(NB, ZB): token blocks of at most WG_NB_MAX rows, NB a multiple of 8."""
    zb = -(-m // WG_NB_MAX)
    per = -(-m // zb)
    return 8 * -(-per // 8), zb


def piece_boxes(k, cl):
    """Most 64-column boxes of one of the cl k pieces."""
    return -(-(k // 64) // cl)


def wg_cut(m, n, k, sms=132, mt=None, cl=None, stages=None, xin=None):
    """The default cut: MT and CL from (n, k) alone (batch invariance): the MT (2 on a tie) whose strips x k pieces
    come closest to WG_TARGET blocks per SM without passing it (past it for both: the fewer blocks), k pieces of >= 2 boxes, <= WG_CL_MAX; XIN where x's
    piece fits WG_XIN_BYTES; S as many stages as the rest of WG_SMEM_BLOCK holds. mt / cl / stages / xin override."""
    boxes = k // 64
    target = int(WG_TARGET * sms)
    options = []
    for MT in ((mt,) if mt else (2, 1)):
        strips = -(-n // (64 * MT))
        CL = cl or max(1, min(WG_CL_MAX, boxes // 2, target // strips))
        blocks = strips * CL
        options.append((blocks if blocks <= target else -blocks, MT, CL))   # the most blocks within the target,
    _, MT, CL = max(options)                                                # else the fewest (MT = 2 first)
    NB, ZB = token_blocks(m)
    xbytes = NB * 128 * piece_boxes(k, CL)
    XIN = int(xbytes <= WG_XIN_BYTES) if xin is None else xin
    stage = MT * BOX + (0 if XIN else NB * 128)
    S = stages or max(2, min(WG_STAGES_MAX, (WG_SMEM_BLOCK - XIN * xbytes) // stage))
    return WgCut(MT, CL, S, NB, ZB, XIN)


def _layout(MT, S, NB, XB):
    """(stage bytes, x boxes' offset, first mbarrier's byte offset) of the shared memory: S ring stages, then (XIN:
    XB > 0) the x boxes of the k piece; the partial tile [NB][64 MT + 4] f32 reuses the start after the main loop."""
    stage = MT * BOX + (0 if XB else NB * 128)
    xreg = S * stage
    end = max(xreg + XB * NB * 128, NB * (64 * MT + 4) * 4)
    return stage, xreg, -(-end // 8) * 8


def wg_smem(cut, k):
    """Dynamic shared bytes of a cut for inner size k."""
    return _layout(cut.MT, cut.S, cut.NB, cut.XIN * piece_boxes(k, cut.CL))[2] + 8 * cut.S


def _sm90():
    if SIM:
        return False
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:                      # no GPU: the mma path's launch will say so
        return False


def gemm_wg_applies(m, n, k):
    """Whether this path runs the GEMM: sm_90, k a multiple of 64 (one swizzle span per box) and GEMM_WG on."""
    return GEMM_WG and k % 64 == 0 and n >= 64 and _sm90()


def xb_words(m, k):
    """u32 words of x in the tiled=3 layout of prep_b: ZB token blocks x k/64 boxes x NB rows x 32 words."""
    nb, zb = token_blocks(m)
    return zb * nb * k // 2


_KERNELS = {}


def gemm_wg_kernel(MT, CL, S, NB, XB=0):
    """The kernel for one cut (compiled once per (MT, CL, S, NB, XB)); XB > 0: XIN with room for XB x boxes."""
    key = (MT, CL, S, NB, XB)
    if key not in _KERNELS:
        _KERNELS[key] = _build(MT, CL, S, NB, XB)
    return _KERNELS[key]


def _build(MT, CL, S, NB, XB):
    from kernels.bulk import bulk_load, mbar_expect, mbar_fence_init, mbar_init, mbar_wait, tensor_load_2d
    from kernels.bulk import tensormap_acquire
    from kernels.cluster import cluster_sync, dsmem_ld16
    from kernels.device import as_f32, kernel, ld16, lds16, pack_bf16x2
    from kernels.wgmma import fence_proxy_async, make_desc, make_wgmma, wg_commit, wg_fence, wg_wait0, wg_wait1

    BM, XBOX = 64 * MT, NB * 128               # weight rows per block; bytes of one activation box
    STAGE, XREG, BARB = _layout(MT, S, NB, XB)
    BAR = BARB // 8                            # first mbarrier (u64 index)
    BMP = BM + 4                               # f32 row pitch of the partial tile [NB tokens][BM rows]
    NACC = NB // 2
    accs = [", ".join(f"a{t}_{i}" for i in range(NACC)) for t in range(MT)]
    mma = "\n".join(f"        {accs[t]} = wg(da + uint64({t * BOX // 16 + kk * 2}), db + uint64({kk * 2}), {accs[t]})"
                    for kk in range(4) for t in range(MT))
    zero = "\n".join(f"    {accs[t]} = {', '.join(['float32(0)'] * NACC)}" for t in range(MT))
    # accumulator register 4j + i: row 16 w + g + 8 (i // 2), column 8 j + 2 t + i % 2 (kernels/wgmma.py)
    store = "\n".join(
        f"    fsm[{8 * (i // 4) + i % 2} * {BMP} + cbase + {t * 64 + 8 * ((i % 4) // 2)}] = a{t}_{i}"
        for t in range(MT) for i in range(NACC))
    if CL > 1:
        fold = "\n".join(f"        p0, p1, p2, p3 = dsmem_ld16(wsm, idx, {r})\n"
                         f"        v0 += as_f(p0)\n        v1 += as_f(p1)\n        v2 += as_f(p2)\n        v3 += as_f(p3)"
                         for r in range(1, CL))
        first, sync = "dsmem_ld16(wsm, idx, 0)", "    cluster_sync()\n"
    else:
        fold, first, sync = "", "lds16(wsm, idx)", "    cuda.syncthreads()\n"
    # XIN: the 128 threads turn x's rows tok0 .. tok0 + NB - 1 (past m: row m - 1), columns of boxes b0 .. b0 + ns - 1
    # into bf16 boxes (128-byte swizzle) while the ring's first weight boxes are in flight, XG 32-byte chunks of f32 x
    # loaded per thread before any is converted (one chunk at a time left L2 round trips in series: call 2)
    XG = 8
    xin = f'''    for i0 in range(0, {-(-NB * XB * 8 // 128)}, {XG}):          # {XG} chunks in flight per thread
        fv = cuda.local.array({8 * XG}, uint32)
        for e in range({XG}):
            u = tid + 128 * (i0 + e)
            if u < {NB} * ns * 8:
                r = u // (ns * 8)
                src = (min(tok0 + r, m - 1) * nbox + b0) * 64 + (u - r * (ns * 8)) * 8
                fv[8 * e], fv[8 * e + 1], fv[8 * e + 2], fv[8 * e + 3] = ld16(x, src)
                fv[8 * e + 4], fv[8 * e + 5], fv[8 * e + 6], fv[8 * e + 7] = ld16(x, src + 4)
        for e in range({XG}):
            u = tid + 128 * (i0 + e)
            if u < {NB} * ns * 8:
                r = u // (ns * 8)
                cc = u - r * (ns * 8)
                o = {XREG // 4} + ((cc >> 3) * {NB} + r) * 32 + (((cc & 7) ^ (r & 7)) << 2)
                for q in range(4):
                    wsm[o + q] = pack_bf16x2(as_f(fv[8 * e + 2 * q]), as_f(fv[8 * e + 2 * q + 1]))
    fence_proxy_async()                            # st.shared -> the wgmma proxy
''' if XB else ""
    db = f"desc(wsm, {XREG} + j * {XBOX})" if XB else f"desc(wsm, slot * {STAGE} + {MT * BOX})"
    src = f'''
def gemm_wg_k(wmap, xb, x, out, m, n, nbox):
    c, strip, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    wsm = cuda.shared.array(0, uint32, alignment=1024)
    fsm = cuda.shared.array(0, float32, alignment=1024)
    bars = cuda.shared.array(0, uint64, alignment=1024)
    b0 = (c * nbox) // {CL}
    ns = ((c + 1) * nbox) // {CL} - b0
    row0 = strip * {BM}
    tok0 = z * {NB}
    xoff = z * nbox * {XBOX // 4}
    live = min({MT}, (n - row0 + 63) // 64)        # weight boxes of the strip inside the matrix
    if tid == 0:
        for p in range({S}):
            mbar_init(bars, {BAR} + p)
        mbar_fence_init()
        tensormap_acquire(wmap)
        for p in range(min({S}, ns)):
            load_stage(wsm, bars, wmap, xb, xoff, row0, live, b0 + p, p)
{xin}    cuda.syncthreads()
{zero}
    for j in range(ns):
        slot = j % {S}
        mbar_wait(bars, {BAR} + slot, (j // {S}) & 1)
        da = desc(wsm, slot * {STAGE})
        db = {db}
        wg_fence()
{mma}
        wg_commit()
        wg_wait1()                                 # stage j - 1's wgmmas have retired
        cuda.syncthreads()                         # (all four warps): its slot may be refilled
        if tid == 0 and j >= 1 and j + {S} - 1 < ns:
            load_stage(wsm, bars, wmap, xb, xoff, row0, live, b0 + j + {S} - 1, (j - 1) % {S})
    wg_wait0()
    cuda.syncthreads()
    w, lane = tid >> 5, tid & 31
    cbase = (2 * (lane & 3)) * {BMP} + 16 * w + (lane >> 2)
{store}
{sync}    q0 = (c * {BM // 4}) // {CL}
    nq = ((c + 1) * {BM // 4}) // {CL} - q0
    mz = min({NB}, m - tok0)
    for u in range(tid, mz * nq, 128):
        col = u // nq
        q = q0 + u - col * nq
        idx = col * {BMP} + 4 * q
        p0, p1, p2, p3 = {first}
        v0, v1, v2, v3 = as_f(p0), as_f(p1), as_f(p2), as_f(p3)
{fold}
        row = row0 + 4 * q
        if row < n:
            out[tok0 + col, row] = v0
        if row + 1 < n:
            out[tok0 + col, row + 1] = v1
        if row + 2 < n:
            out[tok0 + col, row + 2] = v2
        if row + 3 < n:
            out[tok0 + col, row + 3] = v3
{sync if CL > 1 else ""}'''

    @cuda.jit(device=True, inline="always")
    def load_stage(wsm, bars, wmap, xb, xoff, row0, live, box, slot):
        """Thread 0: stage `box` (64 k columns) into ring slot `slot`: the live weight boxes by TMA and (without
        XIN) the token block's activation box by one bulk copy, all completing on the slot's mbarrier."""
        mbar_expect(bars, BAR + slot, live * BOX + (0 if XB else XBOX))
        for t in range(MT):
            if t < live:
                tensor_load_2d(wsm, (slot * STAGE + t * BOX) // 4, wmap, 64 * box, row0 + 64 * t, bars, BAR + slot)
        if not XB:
            bulk_load(wsm, (slot * STAGE + MT * BOX) // 4, xb, xoff + box * (XBOX // 4), XBOX, bars, BAR + slot)

    ns = dict(cuda=cuda, float32=float32, int32=int32, uint32=uint32, uint64=uint64, mbar_init=mbar_init,
              mbar_fence_init=mbar_fence_init, mbar_wait=mbar_wait, tensormap_acquire=tensormap_acquire,
              load_stage=load_stage, wg_fence=wg_fence, wg_commit=wg_commit, wg_wait0=wg_wait0, wg_wait1=wg_wait1,
              desc=make_desc(16, 1024, 128), wg=make_wgmma(NB), cluster_sync=cluster_sync, dsmem_ld16=dsmem_ld16,
              lds16=lds16, ld16=ld16, as_f=as_f32, pack_bf16x2=pack_bf16x2, fence_proxy_async=fence_proxy_async)
    exec(src, ns)
    return kernel(max_registers=255)(ns["gemm_wg_k"])


_TMAP = {}


def weight_tensor_map(w):
    """The TMA tensor map of bf16 weights u16[n, k] in 64 x 64 boxes, in device memory (made on the first call for
    these weights, outside graph capture: engines run a round eagerly before they capture it)."""
    from kernels.bulk import tensor_map_2d
    from kernels.gemm import _address
    n, k = w.shape
    key = (_address(w), n, k)
    if key not in _TMAP:
        _TMAP[key] = cuda.to_device(tensor_map_2d(key[0], n, k, 64, 64))
    return _TMAP[key]


def gemm_wg(x, w, out, xb, cut=None):
    """out f32[m, n] = x f32[m, k] @ bf16(w u16[n, k])^T: one launch of (CL, strips, ZB) blocks in clusters of CL,
    after x -> bf16 boxes in xb (u32, >= xb_words(m, k)) unless the blocks convert x themselves (cut.XIN, x
    contiguous). w and out contiguous."""
    from kernels.attention import launch_smem
    from kernels.gemm import contiguous, prep_b
    m, k = x.shape
    n = w.shape[0]
    if not gemm_wg_applies(m, n, k) or not contiguous(w) or not contiguous(out) or out.shape != (m, n):
        raise ValueError(f"gemm_wg: x {x.shape}, w {w.shape}, out {out.shape}: needs sm_90, k % 64 == 0, n >= 64, "
                         f"contiguous w and out [m, n]")
    cut = cut or wg_cut(m, n, k, cuda.get_current_device().MULTIPROCESSOR_COUNT)
    if (cut.NB, cut.ZB) != token_blocks(m):
        raise ValueError(f"gemm_wg: cut {cut} was not made for m={m}")
    if cut.XIN and not contiguous(x):          # (the same bf16 x either way: the same sums)
        cut = replace(cut, XIN=0)
    if not cut.XIN:
        if xb.size < xb_words(m, k):
            raise ValueError(f"gemm_wg: xb of {xb.size} words < {xb_words(m, k)}")
        prep_b(x, xb, 1, 0, tiled=3)
    kern = gemm_wg_kernel(cut.MT, cut.CL, cut.S, cut.NB, cut.XIN * piece_boxes(k, cut.CL))
    grid = (cut.CL, math.ceil(n / (64 * cut.MT)), cut.ZB)
    xf = x.reshape(m * k) if cut.XIN else xb.view(np.float32)     # (without XIN: not read)
    launch_smem(kern, grid, 128, wg_smem(cut, k), (weight_tensor_map(w), xb, xf, out, int32(m), int32(n),
                                                     int32(k // 64)),
                cluster=(cut.CL, 1, 1) if cut.CL > 1 else None)
    return out
