"""MLA attention on warpgroup MMA (sm_90a): kernels/mla.py's absorbed attention for 64-row tiles of one query's
heads (h % 64 == 0: the 64 heads of K2 on one GPU), with both products on wgmma (kernels/wgmma.py) instead of
mma.sync. 64 heads need 139 kFLOP per 1152-byte cache row: at 70% of copy bandwidth that is 58% of the mma.sync
roof but 38% of the wgmma one (docs/PERFORMANCE.md, "Kernels").

Block (64-row tile = query t, split s, sequence b), two warpgroups; Q and a ring of 4 tiles of nk (MlaWgConfig) cache
rows in 128-byte-swizzle atoms (the same bytes are the K-major B of S = Q K^T and the MN-major B of O += P V):
  prologue:    all 256 threads load the f32 q tile, every unit at once (MlaWgConfig.qg), then the ring's first three
               tiles go out (q_first) while q is stored as bf16 into its atoms;
  warpgroup 0: S = Q K^T over the D latent + rope columns (D/16 wgmma m64nNKk16), the online softmax in its
               registers, P as bf16 into shared memory (two P tiles alternate), the rescale factors beside it;
  warpgroup 1: the ring's loads (three tiles ahead): TMA tensor copies (kernels/bulk.py tensor_load_2d: one box
               of 64 columns x nk rows per 128-byte slab, issued by its first thread, an mbarrier per slot;
               it zeroes the rows of a tile past the split's end);
  both:        O[:, wg half] = alpha O + P V[:, wg half] (NK/16 wgmma m64n(r/2)k16; 64 x r/2 f32 per warpgroup),
               issued after S of the next step so the softmax runs beside them; at the end O leaves through f32
               rows of shared memory in 16-byte stores (staged).
Launched as thread-block clusters of a tile's 2..8 splits (MlaWgConfig.cluster, where they fit as well as plain blocks:
kernels.mla.cluster_pays), the split blocks merge through distributed shared memory (cluster_merge) and write out;
other split counts leave partials for kernels.attention's merge_splits launch.
Bytes: each cache row of the split once per tile (the tiles of one split share it through L2), q once, the
partials 64 r 2 per block (bf16, kernels.mla MlaConfig.partials; 64 r 4 as f32; none in a cluster: the output once).
Same arguments and outputs as mla.py's kernel (o_part, ml_part, the merge after; out in a cluster).
The kernel (_make_kernel) reads as its steps, each a device function made by a factory over the layout's
compile-time sizes (WgLayout): q_prologue; the cache ring (ring_init, ring_fill, tile_landed, load_tile_tma); S and
softmax (qk, softmax); P V (pv, rescale); the loop of each warpgroup (scores_loop, ring_loop); the epilogue
(finish, store_out, empty_split); the cluster merge. Register tuples are unrolled by kernels/unroll.py."""
import math
from dataclasses import dataclass, replace

from numba import cuda, float32, int32, uint16, uint32, uint64

from numbaengine.kernels.cluster import cluster_sync, dsmem_ld4, dsmem_ld16
from numbaengine.kernels.device import (
    F0,
    F1,
    NEG_INF,
    SIM,
    as_f32,
    as_u32,
    cp_wait,
    device,
    grid_dep,
    ld16,
    lds16,
    shfl_xor,
    st16,
    st_quad,
    stamp_point,
    sts8,
)
from numbaengine.kernels.launch import kernel
from numbaengine.kernels.unroll import each_pair, fill, pfold, tfold, tmap, unroll
from numbaengine.kernels.wgmma import (
    core_offset,
    fence_proxy_async,
    make_desc,
    make_wgmma,
    sw128_mn_strides,
    sw128_offset,
    wg_commit,
    wg_fence,
    wg_wait0,
    wg_wait1,
)


@dataclass(frozen=True)
class MlaWgConfig:
    """The 64-head kernel's choices: the defaults are what the engine runs, each with the measurement behind it.
    Compiled kernels are keyed by the fields they read; tools and tests pass other configs (mla.MlaConfig.wg)."""
    on: bool = True          # use this kernel where it applies (mla_wg_applies)
    nk: int = 32             # cache rows per step (S is m64nNK per k16 step; four tiles must fit)
    staged: bool = True      # O leaves through shared memory in 16-byte stores (a warp writes 512 contiguous bytes),
    #                          not as 4-byte stores from the accumulator registers. H200, decode 4K x batch 64: 108.39
    #                          us against 117.07 (65.3 / 60.4% of copy)
    cluster: int = 8         # 2 .. this many splits of a row tile run as one thread-block cluster and merge through
    #                          distributed shared memory (kernels/cluster.py): no partials, no merge launch; 0: off,
    #                          at most 8 (the portable cluster size). H200, decode 4K x batch 64 (2 splits): 99.81 us
    #                          against 108.39 with the merge launch (70.9 / 65.3% of copy)
    qg: int = 18             # q prologue: 8-value units of the q tile each thread has in flight (two 16-byte loads
    #                          each; the largest divisor of the units per thread up to this: all 18 at K2's widths).
    #                          H200, 64-head decode, 4K x batch 64: 97.01 us at 18 against 98.52 at 3 (73.3 / 72.2% of
    #                          copy); the prologue of a 16K x 16 block 6.4 us against 7.3 (tools/mla_stamps.py)
    q_first: bool = True     # the q prologue's loads go out before the ring's first three tiles, which are
    #                          issued between them and q's conversion (the tiles are not needed until the main loop).
    #                          H200, 64-head decode, on / off: 16K x 16 100.17 / 100.79 us (70.9 / 70.5% of copy);
    #                          batch 1 mixed. All four ring tiles before the prologue: slower (its q loads queue
    #                          behind the tiles: prologue 8.8 us against 6.4)
    stamps: bool = False     # measurement only: thread 0 of every block writes (SM cycles, global ns) at 7 points of
    #                          its timeline into `count` [blocks, STAMP_WORDS] (int32 bits), then its SM and steps;
    #                          tools/mla_stamps.py reads them (where a block's fixed work goes). Default PTX unchanged


WG_DEFAULT = MlaWgConfig()
STAMP_WORDS = 16
MLA_WG_SMEM = 227 * 1024
MLA_WG_PTX_SIG = ("void(float32[:,:,:,::1], uint16[:,:,::1], uint64[::1], int32[::1], int32[::1], uint32[:,:,::1], "
                  "float32, int32, int32, float32[:,:,:,::1], float32[:,:,:,::1], float32[:,:,::1], int32[:,::1])")
# ^ this kernel's argument types (mla.py's MLA_PTX_SIG with the tensor map after the cache), for compile_ptx
_KERNELS = {}


def wg_smem(D, nk, stages):
    """Bytes of shared memory: Q tile, `stages` cache tiles, two P tiles, then the f32[64] rows of the statistics
    (alpha x 2, max, sum), then one mbarrier per cache tile."""
    return 64 * D * 2 + stages * nk * D * 2 + 2 * 64 * nk * 2 + 4 * 64 * 4 + 8 * stages


def wg_stages(D, nk):
    """4 (tiles i - 1 .. i + 2 of the pipeline) if they fit, else 0."""
    return 4 if wg_smem(D, nk, 4) <= MLA_WG_SMEM else 0


def mla_wg_applies(h, D, r, cfg=WG_DEFAULT):
    """This kernel runs on sm_90 GPUs for 64-head row tiles of widths it can hold (r / 2 <= 256 columns of O per
    warpgroup in registers; r <= D: V is the first r latent columns of a cache row)."""
    if SIM or not cfg.on or h % 64 or D % 64 or r % 128 or r // 2 > 256 or r > D or not wg_stages(D, cfg.nk):
        return False
    return cuda.is_available() and cuda.get_current_device().compute_capability == (9, 0)


def mla_wg_kernel(D, r, causal, cluster=0, cfg=WG_DEFAULT):
    """The kernel for latent width D, output width r; cluster: the merge of that many splits through distributed
    shared memory compiled in (0: none)."""
    stamps = wg_stamps(cluster, cfg)
    key = (D, r, causal, cfg.nk, cfg.staged, cluster, stamps, cfg.qg, cfg.q_first)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(D, r, causal, cfg.nk, wg_stages(D, cfg.nk), cfg.staged, cluster, stamps, cfg.qg,
                                     cfg.q_first)
    return _KERNELS[key]


def wg_stamps(cluster=0, cfg=WG_DEFAULT):
    """Whether cfg.stamps is compiled into the kernel: not into the cluster kernels."""
    return cfg.stamps and not cluster


def check_stamps(count, blocks):
    """The stamps of `blocks` blocks need count int32 [>= blocks, >= STAMP_WORDS] (tools/mla_stamps.py makes it);
    an ordinary work's [B, M] counters (or none) would be written past."""
    if count is None or count.shape[0] < blocks or count.shape[1] < STAMP_WORDS:
        raise ValueError(f"mla_attention: MlaWgConfig.stamps needs work.count of [>= {blocks} blocks, >= {STAMP_WORDS}]"
                         f" int32, not {None if count is None else count.shape} (tools/mla_stamps.py)")


def wg_clusters(nsplit, cfg=WG_DEFAULT):
    """Cluster sizes to try for `nsplit` splits of a row tile: all of them (merged into the output in the kernel)
    where 2 <= nsplit <= cfg.cluster (<= 8, the portable size), else none."""
    return [nsplit] if 2 <= nsplit <= min(cfg.cluster, 8) else []


def _step(fn):
    """A step of the kernel: a device function inlined into its caller in numba's IR (as if written there)."""
    return cuda.jit(device=True, inline="always")(fn)


@dataclass(frozen=True)
class WgLayout:
    """One kernel's compile-time sizes: byte offsets into shared memory (Q tile, the ring's tiles, two P tiles, then
    f32 statistics and the ring's mbarriers), register counts and the epilogue's staged rows."""
    D: int
    r: int
    NK: int
    stages: int
    CL: int
    QG: int

    D8 = property(lambda k: k.D // 8)                   # 16-byte units of a q row (8 values)
    NPV = property(lambda k: k.r // 2)                  # O columns per warpgroup
    QBYTES = property(lambda k: 64 * k.D * 2)
    TILE = property(lambda k: k.NK * k.D * 2)
    PBYTES = property(lambda k: 64 * k.NK * 2)
    PB = property(lambda k: k.QBYTES + k.stages * k.TILE)           # two P tiles (bytes), then the f32 stats
    SF = property(lambda k: (k.PB + 2 * k.PBYTES) // 4)            # f32 index of alpha[2][64], max[64], sum[64]
    BAR = property(lambda k: (k.PB + 2 * k.PBYTES + 4 * 64 * 4) // 8)   # u64 index of the ring's mbarriers
    VHALF = property(lambda k: k.NPV // 64 * k.NK * 128)            # bytes into a tile of warpgroup 1's V columns
    NS = property(lambda k: k.NK // 2)                  # accumulators per thread: S (warpgroup 0)
    NO = property(lambda k: k.NPV // 2)                 # and O (both)
    PITCH = property(lambda k: k.r + 8)                 # staged epilogue: f32 rows of O (8 floats of padding:
    R4 = property(lambda k: k.r // 4)                   # st.shared.v2 without bank conflicts), 16-byte quads a row
    ML = property(lambda k: 64 * k.PITCH)               # f32 index (cluster): this block's max, sum of 64 rows
    FAC = property(lambda k: 64 * k.PITCH + 128)        # and the fold factors
    QPT = property(lambda k: 64 * k.D8 // 256)          # q units (8 values: 16 bytes of the tile) per thread


def wg_layout(D, r, NK, stages, STAGED, CL, QG):
    """The layout of one kernel (QG: the largest divisor of the q units per thread up to QG, units in flight)."""
    k = WgLayout(D, r, NK, stages, CL, 1)
    if (STAGED or CL) and 4 * (k.FAC + 64 * max(CL, 1)) > k.PB:
        raise ValueError(f"mla_wg: the staged O tile ({64 * k.PITCH * 4} bytes) does not fit below the P tiles "
                         f"({k.PB})")
    return replace(k, QG=max(g for g in range(1, min(QG, k.QPT) + 1) if k.QPT % g == 0))


def _ring_steps(k):
    """The cache ring (warpgroup 1's thread 128 issues, an mbarrier per slot): ring_init, ring_fill (tiles 0, 1, 2
    in flight), load_tile_tma and tile_landed."""
    from numbaengine.kernels.bulk import (
        mbar_expect,
        mbar_fence_init,
        mbar_init,
        mbar_wait,
        tensor_load_2d,
        tensormap_acquire,
    )
    NK, NSLAB, STAGES, BAR, TILE, QBYTES = k.NK, k.D // 64, k.stages, k.BAR, k.TILE, k.QBYTES

    @_step
    def load_tile_tma(wsm, bars, tmap, row0, j0, hi, stage):
        """Thread 128: the NSLAB boxes (64 columns x NK rows, 128-byte swizzle) of cache rows j0 .. j0 + NK - 1 into
        ring slot `stage`, completing on its mbarrier; a tile wholly past the split's end (the zero tile after the
        last step) copies nothing and only completes the barrier's phase (see tile_landed)."""
        if j0 >= hi:
            mbar_expect(bars, BAR + stage, 0)
            return
        mbar_expect(bars, BAR + stage, TILE)
        for c in range(NSLAB):
            tensor_load_2d(wsm, (QBYTES + stage * TILE + c * NK * 128) // 4, tmap, 64 * c, row0 + j0, bars,
                           BAR + stage)

    @_step
    def tile_landed(wsm, bars, lo, hi, j, tid):
        """Warpgroup 1 (tid < 128): wait for tile j's copies, then zero the rows at or past hi of a tile that ends
        past it (unwritten rows or the next sequence's: P is 0 there but P V must not meet a NaN), 32 words of a
        row per warp's lanes, four rows at a time. The zero tile past the last step (only S reads it, masked) keeps
        whatever its slot held."""
        stage = j % STAGES
        mbar_wait(bars, BAR + stage, (j // STAGES) & 1)
        v = hi - (lo + j * NK)
        if v > 0 and v < NK:
            base = (QBYTES + stage * TILE) // 4 + (tid & 31)
            for rr in range(v + (tid >> 5), NK, 4):
                for c in range(NSLAB):
                    wsm[base + (c * NK + rr) * 32] = uint32(0)

    @_step
    def ring_init(bars, tmap, tid):
        """Thread 128: the slots' mbarriers, made visible to the copy engine; the tensor map acquired."""
        if tid == 128:
            for p in range(STAGES):
                mbar_init(bars, BAR + p)
            mbar_fence_init()
            tensormap_acquire(tmap)
        cuda.syncthreads()

    @_step
    def ring_fill(wsm, bars, tmap, wg, tid, row0, lo, hi, nsteps):
        if wg == 1:                                   # warpgroup 1: ring tiles 0, 1, 2 in flight
            for p in range(3):
                if tid == 128 and p <= nsteps:
                    load_tile_tma(wsm, bars, tmap, row0, lo + p * NK, hi, p)
    return ring_init, ring_fill, load_tile_tma, tile_landed


def _q_prologue(k, Q_FIRST, ring_fill):
    """q_prologue: all 256 threads load the f32 q tile, QG units at once, and store it as bf16 into its 128-byte
    swizzle atoms; the ring's first tiles go out after the first loads (Q_FIRST, MlaWgConfig.q_first) or before all."""
    from numbaengine.kernels.mma import pack2
    D, D8, QPT, QG, QV = k.D, k.D8, k.QPT, k.QG, 8 * k.QG
    sw128 = cuda.jit(device=True, inline="always")(sw128_offset)

    @_step
    def q_prologue(q, wsm, bars, tmap, b, M, mb, tid, wg, row0, lo, hi, nsteps):
        if not Q_FIRST:
            ring_fill(wsm, bars, tmap, wg, tid, row0, lo, hi, nsteps)
        qv = cuda.local.array(QV, uint32)
        for p0 in range(0, QPT, QG):              # q tile -> bf16, 128-byte swizzle: unit u is 8 values, 8 lanes
            for p in range(QG):                   # read 256 contiguous bytes and store to 8 bank groups
                u = tid + (p0 + p) * 256
                qo = (b * M + mb) * D + 8 * u
                qv[8 * p], qv[8 * p + 1], qv[8 * p + 2], qv[8 * p + 3] = ld16(q, qo)
                qv[8 * p + 4], qv[8 * p + 5], qv[8 * p + 6], qv[8 * p + 7] = ld16(q, qo + 4)
            if Q_FIRST and p0 == 0:               # (q's first loads are out: now the ring)
                ring_fill(wsm, bars, tmap, wg, tid, row0, lo, hi, nsteps)
            for p in range(QG):
                u = uint32(tid + (p0 + p) * 256)  # unsigned 32 bits: the division by D8 is a multiply-shift and
                qr = u // uint32(D8)              # the word index needs no negative-index check
                o = uint32(sw128(qr, 8 * (u - qr * uint32(D8)), 64) >> 2)
                for e in range(4):
                    wsm[o + uint32(e)] = pack2(as_f32(qv[8 * p + 2 * e]), as_f32(qv[8 * p + 2 * e + 1]))
    return q_prologue


def _score_steps(k, causal):
    """Warpgroup 0's S = Q K^T (qk: D/16 wgmma m64nNKk16 on the Q atoms and a cache tile) and its online softmax
    (softmax: P as bf16 into a P tile, the rescale factors beside it). S register i of a thread is (row r0 + 8
    ((i % 4) // 2), column 8 (i // 4) + 2 t + i % 2) of the step's 64 x NK scores."""
    from numbaengine.kernels.mma import LAZY, ex2, pack2
    NK, NK8, NKS = k.NK, k.NK // 8, k.D // 16
    core = cuda.jit(device=True, inline="always")(core_offset)
    wg_s = make_wgmma(NK)

    @_step
    def key_ok(j, hi, L, tq, b, mask):
        """Cache row j is visible to query tq: before the split's end, committed, or a new token tq sees."""
        if j >= hi:
            return False
        if j < L:
            return True
        jj = j - L
        if causal:
            return jj <= tq
        return ((mask[b, tq, jj >> 5] >> uint32(jj & 31)) & uint32(1)) != uint32(0)

    @device
    def qk_step(ks, S, dq, dk):
        """k16 step ks (the first overwrites S): 32 bytes into the rows of 128-byte slab ks // 4 (slabs 64 * 128
        bytes apart in Q, NK * 128 in a tile); descriptor units are 16 bytes."""
        return wg_s(dq + uint64(((ks // 4) * 64 * 128 + (ks % 4) * 32) // 16),
                    dk + uint64(((ks // 4) * NK * 128 + (ks % 4) * 32) // 16), S, ks > 0)

    @_step
    def qk(dq, dk, S):
        return unroll(NKS, qk_step, S, dq, dk)

    @device
    def score(i, s, scale, masked, c0, t, hi, L, tq, b, mask):
        """Score i, or -inf where the step is masked and its key (column 8 (i // 4) + 2 t + i % 2) is not visible."""
        x = s * scale
        if masked and not key_ok(c0 + (8 * (i // 4) + i % 2) + 2 * t, hi, L, tq, b, mask):
            x = NEG_INF
        return x

    @device
    def row_max(i, x, mx, half):
        """The max over row half's registers (half 0: row r0, 1: r0 + 8), as max(m, x0, x1, ...) folds them: a
        compare and select per value (numba's two-argument max is a max.f32 instead)."""
        if (i % 4) // 2 != half:
            return mx
        return x if x > mx else mx  # noqa: FURB136

    @device
    def p_pair(j, x0, x1, tot, mz0, mz1, wsm, pb, r0, r1, t):
        """Pair j of the scores -> a bf16 pair of P into the P tile at byte pb; its share of the row's sum."""
        tot0, tot1 = tot
        if j % 2 == 0:
            w = pack2(ex2(x0 - mz0), ex2(x1 - mz0))
            tot0 += as_f32(w << uint32(16)) + as_f32(w & uint32(0xFFFF0000))
            wsm[(pb + core(r0, 8 * (j // 2) + 2 * t, NK8)) >> 2] = w
        else:
            w = pack2(ex2(x0 - mz1), ex2(x1 - mz1))
            tot1 += as_f32(w << uint32(16)) + as_f32(w & uint32(0xFFFF0000))
            wsm[(pb + core(r1, 8 * (j // 2) + 2 * t, NK8)) >> 2] = w
        return tot0, tot1

    @_step
    def softmax(S, m0, m1, l0, l1, c0, pb, sa, scale, plain, hi, L, tq, b, mask, t, r0, r1, fsm, wsm):
        """Online softmax of S (registers) for the step at key c0 (masks where the step passes `plain`): the new
        max (lazy rescale), alpha into alpha row sa, P as bf16 into the P tile at byte pb, this lane's share of the
        sums (its quad's four shares are added once, after the last step) -> (m0, m1, l0, l1, al0, al1)."""
        X = tmap(score, S, scale, c0 + NK > plain, c0, t, hi, L, tq, b, mask)     # masks where the step passes
        mx0, mx1 = tfold(row_max, X, m0, 0), tfold(row_max, X, m1, 1)
        for c in range(2):
            mx0 = max(mx0, shfl_xor(mx0, 1 << c))
            mx1 = max(mx1, shfl_xor(mx1, 1 << c))
        if m0 != NEG_INF and mx0 <= m0 + LAZY:     # lazy rescale: keep the old max (P <= 2^LAZY)
            mx0 = m0
        if m1 != NEG_INF and mx1 <= m1 + LAZY:
            mx1 = m1
        mz0 = mx0 if mx0 != NEG_INF else F0
        mz1 = mx1 if mx1 != NEG_INF else F0
        al0 = ex2(m0 - mx0) if mx0 != m0 else F1
        al1 = ex2(m1 - mx1) if mx1 != m1 else F1
        if t == 0:
            fsm[sa + r0] = al0
            fsm[sa + r1] = al1
        tot0, tot1 = pfold(p_pair, X, (F0, F0), mz0, mz1, wsm, pb, r0, r1, t)
        return mx0, mx1, l0 * al0 + tot0, l1 * al1 + tot1, al0, al1
    return qk, softmax


def _pv_steps(k):
    """O[:, warpgroup half] += P V (pv: NK/16 wgmma m64n(r/2)k16, P from its tile, V the cache tile as MN-major B)
    and the rescale of O by alpha (rescale: registers 4j, 4j + 1 are row r0, 4j + 2, 4j + 3 row r0 + 8)."""
    NKP = k.NK // 16
    wg_pv = make_wgmma(k.NPV, trans_b=True)

    @device
    def pv_step(ks, O, dp, dv):
        """P core matrix columns 2ks, 2ks + 1; V's k16 step = two atoms of 8 rows."""
        return wg_pv(dp + uint64(16 * ks), dv + uint64(2048 * ks // 16), O, 1)

    @_step
    def pv(dp, dv, O):
        return unroll(NKP, pv_step, O, dp, dv)

    @device
    def scaled(i, o, al0, al1):
        return o * al0 if i % 4 < 2 else o * al1

    @_step
    def rescale(O, al0, al1):
        if al0 != F1 or al1 != F1:                # rare with the lazy rescale
            return tmap(scaled, O, al0, al1)
        return O
    return pv, rescale


def _loops(k, STAMPS, steps):
    """The main loop of each warpgroup. Warpgroup 0, step i: after the barrier (P(i) and tile i + 1 visible) it
    issues S(i + 1), then O += P(i) V(i), waits for S(i + 1) only and runs softmax(i + 1) beside the P V products
    on the tensor cores, then waits for P V (i). Warpgroup 1 keeps tiles i + 1 .. i + 3 in flight (tile i + 3 into
    the slot of tile i - 1, whose P V both warpgroups retired before the barrier) and adds its half of P(i) V(i).
    Two P tiles and two alpha rows alternate. Every accumulator is retired inside the step that issued it (S(nsteps)
    runs on the zero tile past the split's end), so ptxas keeps the wgmmas asynchronous."""
    qk, softmax, pv, rescale, load_tile_tma, tile_landed = steps
    from numbaengine.kernels.bulk import mbar_wait
    NK, STAGES, BAR, QBYTES, TILE, PB, PBYTES, SF, VHALF = (k.NK, k.stages, k.BAR, k.QBYTES, k.TILE, k.PB,
                                                            k.PBYTES, k.SF, k.VHALF)
    desc_k, desc_p = make_desc(16, 1024, 128), make_desc(128, 16 * NK)
    desc_v = make_desc(*sw128_mn_strides(NK * 128, 1024), 128)

    @_step
    def scores_loop(wsm, fsm, bars, O, S, m0, m1, l0, l1, dq, lo, hi, L, plain, nsteps, tq, b, mask, scale, t, r0,
                    r1, count, blk, tid):
        """Warpgroup 0 -> (O, m0, m1, l0, l1)."""
        mbar_wait(bars, BAR, 0)                   # (warpgroup 1 saw it land: this wait returns at once)
        if STAMPS and tid == 0:
            stamp_point(count, blk, 6)
        dk = desc_k(wsm, QBYTES)
        wg_fence()
        S = qk(dq, dk, S)
        wg_commit()
        wg_wait0()
        m0, m1, l0, l1, al0, al1 = softmax(S, m0, m1, l0, l1, lo, PB, SF, scale, plain, hi, L, tq, b, mask, t, r0,
                                           r1, fsm, wsm)
        for i in range(nsteps):
            fence_proxy_async()                   # P(i) -> the wgmma proxy
            cuda.syncthreads()
            mbar_wait(bars, BAR + (i + 1) % STAGES, ((i + 1) // STAGES) & 1)
            dk = desc_k(wsm, QBYTES + ((i + 1) % STAGES) * TILE)
            wg_fence()
            S = qk(dq, dk, S)
            wg_commit()
            O = rescale(O, al0, al1)
            dp = desc_p(wsm, PB + (i & 1) * PBYTES)
            dv = desc_v(wsm, QBYTES + (i % STAGES) * TILE)
            wg_fence()
            O = pv(dp, dv, O)
            wg_commit()
            wg_wait1()                            # S(i + 1) done; P V (i) may still run
            c0, pb, sa = lo + (i + 1) * NK, PB + ((i + 1) & 1) * PBYTES, SF + ((i + 1) & 1) * 64
            m0, m1, l0, l1, al0, al1 = softmax(S, m0, m1, l0, l1, c0, pb, sa, scale, plain, hi, L, tq, b, mask, t,
                                               r0, r1, fsm, wsm)
            wg_wait0()
        return O, m0, m1, l0, l1

    @_step
    def ring_loop(wsm, fsm, bars, tmap, O, row0, lo, hi, nsteps, r0, r1, tid):
        """Warpgroup 1 -> O."""
        for i in range(nsteps):
            tile_landed(wsm, bars, lo, hi, i + 1, tid - 128)
            fence_proxy_async()
            cuda.syncthreads()
            if tid == 128 and i + 3 <= nsteps:
                load_tile_tma(wsm, bars, tmap, row0, lo + (i + 3) * NK, hi, (i + 3) % STAGES)
            sa = SF + (i & 1) * 64
            O = rescale(O, fsm[sa + r0], fsm[sa + r1])
            dp = desc_p(wsm, PB + (i & 1) * PBYTES)
            dv = desc_v(wsm, QBYTES + (i % STAGES) * TILE + VHALF)
            wg_fence()
            O = pv(dp, dv, O)
            wg_commit()
            wg_wait0()
        return O
    return scores_loop, ring_loop


def _cluster_merge(k):
    """merge: the cluster of the tile's CL split blocks (gridDim.y = CL, rank s % CL) folds the staged O rows and
    (max, sum) of every block into out (kernels/cluster.py's protocol: a barrier, DSMEM reads, a barrier)."""
    CL, r, R4, PITCH, ML, FAC = k.CL, k.r, k.R4, k.PITCH, k.ML, k.FAC
    CLN = max(CL, 1)
    RP = -(-64 // CLN)                          # rows of the tile each block merges
    MU = max(1, 8 // CLN)                       # items per round: MU x CL 16-byte loads in flight

    @_step
    def cluster_merge(wsm, fsm, out, b, s, mb, tid):
        """After a cluster barrier: fold rows rank RP .. rank RP + RP - 1 of the tile from every block's staged O
        and (max m_c, sum l_c), read through DSMEM, into out f32[B, M, r]: out = sum_c 2^(m_c - m) O_c /
        sum_c 2^(m_c - m) l_c (rows no split saw get 0, merge_splits' rule). 16-byte stores."""
        rank = s % CL
        row0 = rank * RP
        nrows = min(64, row0 + RP) - row0
        if tid < nrows:                           # one thread per row: the fold factors of the CL partials
            ms = cuda.local.array(CLN, float32)
            ls = cuda.local.array(CLN, float32)
            for c in range(CL):
                ms[c] = as_f32(dsmem_ld4(wsm, ML + row0 + tid, c))
                ls[c] = as_f32(dsmem_ld4(wsm, ML + 64 + row0 + tid, c))
            mx = NEG_INF
            for c in range(CL):
                mx = max(mx, ms[c])
            den = float32(0)
            for c in range(CL):
                ms[c] = math.exp2(ms[c] - mx) if ms[c] != NEG_INF else float32(0)
                den += ms[c] * ls[c]
            inv = float32(1) / den if den > float32(0) else float32(0)
            for c in range(CL):
                fsm[FAC + c * 64 + tid] = ms[c] * inv
        cuda.syncthreads()
        n = nrows * R4
        M = out.shape[1]
        dst = b * M + mb + row0                   # flat row of out
        v = cuda.local.array((MU, CLN, 4), uint32)
        for i0 in range(tid, n, 256 * MU):
            for u in range(MU):                   # every load of the round first
                it = min(i0 + 256 * u, n - 1)
                row = it // R4
                for c in range(CL):
                    v[u, c, 0], v[u, c, 1], v[u, c, 2], v[u, c, 3] = dsmem_ld16(
                        wsm, (row0 + row) * PITCH + 4 * (it - row * R4), c)
            for u in range(MU):
                it = i0 + 256 * u
                if it < n:
                    row = it // R4
                    a0, a1, a2, a3 = float32(0), float32(0), float32(0), float32(0)
                    for c in range(CL):
                        f = fsm[FAC + c * 64 + row]
                        if f != float32(0):       # (a split with no partial staged nothing: skip its rows)
                            a0 += f * as_f32(v[u, c, 0])
                            a1 += f * as_f32(v[u, c, 1])
                            a2 += f * as_f32(v[u, c, 2])
                            a3 += f * as_f32(v[u, c, 3])
                    col, w0, w1, w2, w3 = 4 * (it - row * R4), as_u32(a0), as_u32(a1), as_u32(a2), as_u32(a3)
                    st16(out, (dst + row) * r + col, w0, w1, w2, w3)

    @_step
    def merge(wsm, fsm, out, b, s, mb, tid):
        cluster_sync()                                # every block's O rows and (max, sum) published
        cluster_merge(wsm, fsm, out, b, s, mb, tid)   # this block's rows, from all
        cluster_sync()                                # the others are done reading this block's memory
    return merge


def _epilogue(k, STAGED, merge):
    """The end of a block: empty_split (a dead query or an empty split: nothing to attend), finish (the rows' sums
    across each quad, the statistics in shared memory -> 1 / sum where normalized, else the (max, sum) partials)
    and store_out (O times 1 / sum: into f32 rows of shared memory, then 16-byte stores of whole rows (STAGED) or
    the cluster merge; or straight from the registers)."""
    CL, r, NPV, R4, PITCH, ML, FM, FL = k.CL, k.r, k.NPV, k.R4, k.PITCH, k.ML, k.SF + 128, k.SF + 192
    ROUNDS = 64 * R4 // 256                       # a warp writes 512 contiguous bytes per store

    @_step
    def empty_split(fsm, wsm, o_part, ml_part, out, b, s, mb, tid, normalize):
        if CL:                                    # a block with nothing to attend still joins the merge
            if tid < 64:
                fsm[ML + tid] = NEG_INF
                fsm[ML + 64 + tid] = F0
            merge(wsm, fsm, out, b, s, mb, tid)
        elif normalize:
            for idx in range(tid, 64 * r, 256):
                o_part[b, s, mb + idx // r, idx % r] = F0
        elif tid < 64:
            ml_part[b, s, mb + tid, 0] = NEG_INF
            ml_part[b, s, mb + tid, 1] = F0

    @_step
    def finish(fsm, ml_part, m0, m1, l0, l1, normalize, b, s, mb, wg, t, r0, r1, tid):
        for c in range(2):
            l0 += shfl_xor(l0, 1 << c)
            l1 += shfl_xor(l1, 1 << c)
        if wg == 0 and t == 0:
            fsm[FM + r0], fsm[FL + r0] = m0, l0
            fsm[FM + r1], fsm[FL + r1] = m1, l1
        cuda.syncthreads()
        d0, d1 = fsm[FL + r0], fsm[FL + r1]
        inv0, inv1 = F1, F1
        if normalize:
            inv0 = F1 / d0 if d0 > F0 else F0
            inv1 = F1 / d1 if d1 > F0 else F0
        elif tid < 64:
            if CL:                                # (cluster) into shared memory, for the others
                fsm[ML + tid] = fsm[FM + tid]
                fsm[ML + 64 + tid] = fsm[FL + tid]
            else:
                ml_part[b, s, mb + tid, 0] = fsm[FM + tid]
                ml_part[b, s, mb + tid, 1] = fsm[FL + tid]
        return inv0, inv1

    @device
    def stage_pair(j, x0, x1, fsm, ra, rb, inv0, inv1):
        if j % 2 == 0:
            sts8(fsm, ra + uint32(8 * (j // 2)), x0 * inv0, x1 * inv0)
        else:
            sts8(fsm, rb + uint32(8 * (j // 2)), x0 * inv1, x1 * inv1)

    @device
    def store_pair(j, x0, x1, o_part, b, s, ra, rb, cb, inv0, inv1):
        row, inv = (ra, inv0) if j % 2 == 0 else (rb, inv1)
        o_part[b, s, row, cb + uint32(8 * (j // 2))] = x0 * inv
        o_part[b, s, row, cb + uint32(8 * (j // 2) + 1)] = x1 * inv

    @_step
    def store_out(O, inv0, inv1, fsm, wsm, o_part, out, b, s, M, mb, wg, t, r0, r1, tid):
        if STAGED or CL:
            ra = uint32(r0 * PITCH + wg * NPV + 2 * t)
            rb = ra + uint32(8 * PITCH)
            each_pair(stage_pair, O, fsm, ra, rb, inv0, inv1)
            if CL:
                merge(wsm, fsm, out, b, s, mb, tid)
            else:
                cuda.syncthreads()
                ob = (b * o_part.shape[1] + s) * M + mb     # the tile's first row of o_part [B, splits, M, r]
                for c in range(ROUNDS):
                    u = uint32(tid + 256 * c)
                    row = u // uint32(R4)
                    col = uint32(4) * (u - row * uint32(R4))
                    w0, w1, w2, w3 = lds16(wsm, row * uint32(PITCH) + col)
                    st_quad(o_part, (ob + row) * r + col, w0, w1, w2, w3)   # (f32, or bf16 partials: 8-byte stores)
        else:                 # unsigned row / column indices (no negative-index checks; the column's constant
            ra, rb, cb = uint32(mb + r0), uint32(mb + r1), uint32(wg * NPV + 2 * t)   # folds into the address)
            each_pair(store_pair, O, o_part, b, s, ra, rb, cb, inv0, inv1)
    return empty_split, finish, store_out


def _make_kernel(D, r, causal, NK, stages, STAGED=False, CL=0, STAMPS=False, QG=18, Q_FIRST=True):
    """The kernel of one configuration (mla_wg_kernel's key), from its steps."""
    if SIM:
        raise NotImplementedError("mla_wg: wgmma has no simulator twin")
    if CL and not 2 <= CL <= 8:
        raise ValueError(f"mla_wg: a cluster merge of {CL} splits (2..8)")
    k = wg_layout(D, r, NK, stages, STAGED, CL, QG)
    NO, NS = k.NO, k.NS
    ring_init, ring_fill, load_tile_tma, tile_landed = _ring_steps(k)
    q_prologue = _q_prologue(k, Q_FIRST, ring_fill)
    qk, softmax = _score_steps(k, causal)
    pv, rescale = _pv_steps(k)
    scores_loop, ring_loop = _loops(k, STAMPS, (qk, softmax, pv, rescale, load_tile_tma, tile_landed))
    empty_split, finish, store_out = _epilogue(k, STAGED, _cluster_merge(k) if CL else None)
    desc_q, cp_wait0 = make_desc(16, 1024, 128), cp_wait(0)

    @kernel(max_registers=255)
    def mla_wg_attention(q, cache, tmap, lengths, ntok, mask, scale, split, normalize, o_part, ml_part, out, count):
        """Block (64-row tile mt = query t's 64 heads, split s, sequence b) of 256 threads, two warpgroups (module
        docstring); grid (M / 64, splits, B), in clusters of (1, CL, 1) when CL; dynamic shared memory wg_smem.
        Bytes: each cache row of the split once (the tiles of one split share it through L2), q once, the
        partials 64 r 2 (bf16) or 4 (f32) and 64 x 2 f32; in a cluster the output rows instead. Arguments as
        kernels.mla's kernel, the tensor map of the cache (cache_tensor_map) third; out: the cluster merge's
        output; count: MlaWgConfig.stamps' stamps."""
        grid_dep()
        T, h = q.shape[1], q.shape[2]
        mt, s, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        wg, lane = tid >> 7, tid & 31
        g, t = lane >> 2, lane & 3
        r0 = 16 * ((tid >> 5) & 3) + g            # this thread's accumulator rows: r0 and r0 + 8
        r1 = r0 + 8
        M = T * h
        mb = mt * 64                              # the tile's first row (query t, head): rows mb .. mb + 63
        tq = mb // h                              # the query of this tile (64 of its heads)
        blk = (b * cuda.gridDim.y + s) * cuda.gridDim.x + mt     # (STAMPS: thread 0 writes (cycles, ns) of
        if STAMPS and tid == 0:                                  # point k of its timeline at count[blk, 2k])
            sm = stamp_point(count, blk, 0)
        fsm = cuda.shared.array(0, float32, alignment=1024)     # swizzle atoms are 1024-aligned
        _usm = cuda.shared.array(0, uint16, alignment=1024)     # unread, as cp_wait0 below: the measured PTX
        wsm = cuda.shared.array(0, uint32, alignment=1024)
        bars = cuda.shared.array(0, uint64, alignment=1024)
        L, n = lengths[b], ntok[b]
        lo = s * split
        hi = min(lo + split, L + n)
        if tq >= n or lo >= hi:                   # a dead query or an empty split: nothing to attend
            empty_split(fsm, wsm, o_part, ml_part, out, b, s, mb, tid, normalize)
            return
        row0 = b * cache.shape[1]
        nsteps = (hi - lo + NK - 1) // NK
        ring_init(bars, tmap, tid)
        if STAMPS and tid == 0:
            sm = stamp_point(count, blk, 2)
        q_prologue(q, wsm, bars, tmap, b, M, mb, tid, wg, row0, lo, hi, nsteps)
        O, S = fill(NO, F0), fill(NS, F0)
        if STAMPS and tid == 0:
            sm = stamp_point(count, blk, 4)
        m0, m1 = NEG_INF, NEG_INF                 # warpgroup 0: running max and sum of rows r0, r1
        l0, l1 = F0, F0
        plain = min(hi, L)                        # steps ending here see no mask
        dq = desc_q(wsm, 0)
        if wg == 1:
            tile_landed(wsm, bars, lo, hi, 0, tid - 128)
        fence_proxy_async()                       # st.shared (q) -> the wgmma proxy
        cuda.syncthreads()
        if wg == 0:                               # one loop per warpgroup: no path crosses between them
            O, m0, m1, l0, l1 = scores_loop(wsm, fsm, bars, O, S, m0, m1, l0, l1, dq, lo, hi, L, plain, nsteps, tq,
                                            b, mask, scale, t, r0, r1, count, blk, tid)
        else:
            O = ring_loop(wsm, fsm, bars, tmap, O, row0, lo, hi, nsteps, r0, r1, tid)
        wg_wait0()
        cp_wait0()                                # (no cp.async in flight: see _usm)
        if STAMPS and tid == 0:
            sm = stamp_point(count, blk, 8)
        inv0, inv1 = finish(fsm, ml_part, m0, m1, l0, l1, normalize, b, s, mb, wg, t, r0, r1, tid)
        if STAMPS and tid == 0:
            sm = stamp_point(count, blk, 10)
        store_out(O, inv0, inv1, fsm, wsm, o_part, out, b, s, M, mb, wg, t, r0, r1, tid)
        if STAMPS and tid == 0:
            sm = stamp_point(count, blk, 12)
        if STAMPS and tid == 0:                   # then its SM and steps
            count[blk, 14], count[blk, 15] = int32(sm), int32(nsteps)
    return mla_wg_attention


def mla_wg_launch(M, D, r, causal, work, cache, cfg=WG_DEFAULT):
    """(kernel, row tiles, threads, shared bytes, tensor map) for mla.mla_attention's launch: M = T h query rows in
    tiles of 64 (one query's heads), 256 threads; `work` splits must be whole steps. The tensor map (a device u64
    array, made once per cache) is the kernel's third argument. Its cluster variants (mla_wg_kernel(..., cluster=c),
    launched in clusters of (1, c, 1) blocks, c = all the splits) write out."""
    if work is not None and work.split % cfg.nk:
        raise ValueError(f"mla_attention: split {work.split} is not a multiple of {cfg.nk} keys")
    smem = wg_smem(D, cfg.nk, wg_stages(D, cfg.nk))
    return mla_wg_kernel(D, r, causal, cfg=cfg), M // 64, 256, smem, cache_tensor_map(cache, cfg.nk)


_TMAP_DEV = {}


def cache_tensor_map(cache, nk):
    """The TMA tensor map of a bf16 latent cache [B, cap, D] seen as [B cap, D] rows, in device memory (made on the
    first call for this cache, outside graph capture: engines warm up before they capture)."""
    from numbaengine.kernels.bulk import tensor_map_2d
    from numbaengine.kernels.launch import data_ptr
    B, cap, D = cache.shape
    key = (data_ptr(cache), B * cap, D, nk)
    if key not in _TMAP_DEV:
        _TMAP_DEV[key] = cuda.to_device(tensor_map_2d(key[0], B * cap, D, nk, 64))
    return _TMAP_DEV[key]
