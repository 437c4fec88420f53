"""MLA attention on warpgroup MMA (sm_90a): kernels/mla.py's absorbed attention for 64-row tiles of one query's
heads (h % 64 == 0: the 64 heads of K2 on one GPU), with both products on wgmma (kernels/wgmma.py) instead of
mma.sync. 64 heads need 139 kFLOP per 1152-byte cache row: at 70% of copy bandwidth that is 58% of the mma.sync
roof but 38% of the wgmma one (docs/PERFORMANCE.md, "Kernels").

Block (64-row tile = query t, split s, sequence b), two warpgroups; Q and a ring of 4 tiles of MLA_WG_NK cache
rows in 128-byte-swizzle atoms (the same bytes are the K-major B of S = Q K^T and the MN-major B of O += P V):
  prologue:    all 256 threads load the f32 q tile, every unit at once (MLA_WG_QG), then the ring's first three
               tiles go out (MLA_WG_Q_FIRST) while q is stored as bf16 into its atoms;
  warpgroup 0: S = Q K^T over the D latent + rope columns (D/16 wgmma m64nNKk16), the online softmax in its
               registers, P as bf16 into shared memory (two P tiles alternate), the rescale factors beside it;
  warpgroup 1: the ring's loads (three tiles ahead): TMA tensor copies (kernels/bulk.py tensor_load_2d: one box
               of 64 columns x MLA_WG_NK rows per 128-byte slab, issued by its first thread, an mbarrier per slot;
               it zeroes the rows of a tile past the split's end);
  both:        O[:, wg half] = alpha O + P V[:, wg half] (NK/16 wgmma m64n(r/2)k16; 64 x r/2 f32 per warpgroup),
               issued after S of the next step so the softmax runs beside them; at the end O leaves through f32
               rows of shared memory in 16-byte stores (MLA_WG_STAGED).
Launched as thread-block clusters of a tile's 2..8 splits (MLA_WG_CLUSTER, where they fit as well as plain blocks:
kernels.mla.cluster_pays), the split blocks merge through distributed shared memory (cluster_merge) and write out;
other split counts leave partials for kernels.attention's merge_splits launch.
Bytes: each cache row of the split once per tile (the tiles of one split share it through L2), q once, the
partials 64 r 2 per block (bf16, kernels.mla MLA_PARTIALS; 64 r 4 as f32; none in a cluster: the output once).
Same arguments and outputs as mla.py's kernel (o_part, ml_part, the merge after; out in a cluster)."""
import math
import textwrap

from numba import cuda, float32, int32, uint16, uint32, uint64

from numbaengine.kernels.attention import NEG_INF, shfl_xor
from numbaengine.kernels.cluster import cluster_sync, dsmem_ld4, dsmem_ld16
from numbaengine.kernels.device import (
    SIM,
    as_f32,
    as_u32,
    cp_wait,
    kernel,
    ld16,
    lds16,
    st16,
    st_quad,
    stamp_point,
    sts8,
)
from numbaengine.kernels.wgmma import core_offset, sw128_mn_strides, sw128_offset

MLA_WG = True               # use this kernel where it applies (mla_wg_applies)
MLA_WG_NK = 32              # cache rows per step (S is m64nNK per k16 step; four tiles must fit)
MLA_WG_STAGED = True        # O leaves through shared memory in 16-byte stores (a warp writes 512 contiguous bytes),
#                             not as 4-byte stores from the accumulator registers. H200, decode 4K x batch 64: 108.39
#                             us against 117.07 (65.3 / 60.4% of copy)
MLA_WG_CLUSTER = 8          # 2 .. this many splits of a row tile run as one thread-block cluster and merge through
#                             distributed shared memory (kernels/cluster.py): no partials, no merge launch; 0: off,
#                             at most 8 (the portable cluster size). H200, decode 4K x batch 64 (2 splits): 99.81 us
#                             against 108.39 with the merge launch (70.9 / 65.3% of copy)
MLA_WG_QG = 18              # q prologue: 8-value units of the q tile each thread has in flight (two 16-byte loads
#                             each; the largest divisor of the units per thread up to this: all 18 at K2's widths).
#                             H200, 64-head decode, 4K x batch 64: 97.01 us at 18 against 98.52 at 3 (73.3 / 72.2% of
#                             copy); the prologue of a 16K x 16 block 6.4 us against 7.3 (tools/mla_stamps.py)
MLA_WG_Q_FIRST = True       # the q prologue's loads go out before the ring's first three tiles, which are
#                             issued between them and q's conversion (the tiles are not needed until the main loop).
#                             H200, 64-head decode, on / off: 16K x 16 100.17 / 100.79 us (70.9 / 70.5% of copy);
#                             batch 1 mixed. All four ring tiles before the prologue: slower (its q loads queue
#                             behind the tiles: prologue 8.8 us against 6.4)
MLA_WG_STAMPS = False       # measurement only: thread 0 of every block writes (SM cycles, global ns) at 7 points of
#                             its timeline into `count` [blocks, STAMP_WORDS] (int32 bits), then its SM and steps;
#                             tools/mla_stamps.py reads them (where a block's fixed work goes). Default PTX unchanged
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


def wg_stages(D, nk=None):
    """4 (tiles i - 1 .. i + 2 of the pipeline) if they fit, else 0."""
    return 4 if wg_smem(D, nk or MLA_WG_NK, 4) <= MLA_WG_SMEM else 0


def mla_wg_applies(h, D, r):
    """This kernel runs on sm_90 GPUs for 64-head row tiles of widths it can hold (r / 2 <= 256 columns of O per
    warpgroup in registers; r <= D: V is the first r latent columns of a cache row)."""
    if SIM or not MLA_WG or h % 64 or D % 64 or r % 128 or r // 2 > 256 or r > D or not wg_stages(D):
        return False
    return cuda.is_available() and cuda.get_current_device().compute_capability == (9, 0)


def mla_wg_kernel(D, r, causal, nk=None, cluster=0):
    """The kernel for latent width D, output width r; cluster: the merge of that many splits through distributed
    shared memory compiled in (0: none)."""
    nk = nk or MLA_WG_NK
    stamps = wg_stamps(cluster)
    key = (D, r, causal, nk, MLA_WG_STAGED, cluster, stamps, MLA_WG_QG, MLA_WG_Q_FIRST)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(D, r, causal, nk, wg_stages(D, nk), MLA_WG_STAGED, cluster, stamps, MLA_WG_QG,
                                     MLA_WG_Q_FIRST)
    return _KERNELS[key]


def wg_stamps(cluster=0):
    """Whether MLA_WG_STAMPS is compiled into the kernel: not into the cluster kernels."""
    return MLA_WG_STAMPS and not cluster


def check_stamps(count, blocks):
    """The stamps of `blocks` blocks need count int32 [>= blocks, >= STAMP_WORDS] (tools/mla_stamps.py makes it);
    an ordinary work's [B, M] counters (or none) would be written past."""
    if count is None or count.shape[0] < blocks or count.shape[1] < STAMP_WORDS:
        raise ValueError(f"mla_attention: MLA_WG_STAMPS needs work.count of [>= {blocks} blocks, >= {STAMP_WORDS}]"
                         f" int32, not {None if count is None else count.shape} (tools/mla_stamps.py)")


def wg_clusters(nsplit):
    """Cluster sizes to try for `nsplit` splits of a row tile: all of them (merged into the output in the kernel)
    where 2 <= nsplit <= MLA_WG_CLUSTER (<= 8, the portable size), else none."""
    return [nsplit] if 2 <= nsplit <= min(MLA_WG_CLUSTER, 8) else []


SOFTMAX_MAX = """\
masked = c0 + {NK} > plain
{softmax_in}
for k in range(2):
    mx0 = max(mx0, shfl_xor(mx0, 1 << k))
    mx1 = max(mx1, shfl_xor(mx1, 1 << k))
if m0 != NEG_INF and mx0 <= m0 + LAZY:     # lazy rescale: keep the old max (P <= 2^LAZY)
    mx0 = m0
if m1 != NEG_INF and mx1 <= m1 + LAZY:
    mx1 = m1
mz0 = mx0 if mx0 != NEG_INF else float32(0)
mz1 = mx1 if mx1 != NEG_INF else float32(0)
al0 = _ex2(m0 - mx0) if mx0 != m0 else float32(1)
al1 = _ex2(m1 - mx1) if mx1 != m1 else float32(1)
m0, m1 = mx0, mx1
if t == 0:
    fsm[sa + r0] = al0
    fsm[sa + r1] = al1
"""   # the online softmax's first half (kernel source, filled in by _make_kernel): the new max, alpha
SOFTMAX_EXP = """\
tot0, tot1 = float32(0), float32(0)
{p_out}
l0, l1 = l0 * al0 + tot0, l1 * al1 + tot1
"""   # its second half: P = exp2(x - max) as bf16 into the P tile, this lane's share of the sums (its quad's four
#       shares are added once, after the last step: QUAD_SUM)
QUAD_SUM = """\
    for k in range(2):
        l0 += shfl_xor(l0, 1 << k)
        l1 += shfl_xor(l1, 1 << k)
"""


def _make_kernel(D, r, causal, NK, stages, STAGED=False, CL=0, STAMPS=False, QG=18, Q_FIRST=True):
    from numbaengine.kernels.mla import _ex2, _pack2
    from numbaengine.kernels.wgmma import (
        fence_proxy_async,
        make_desc,
        make_wgmma,
        wg_commit,
        wg_fence,
        wg_wait0,
        wg_wait1,
    )
    if SIM:
        raise NotImplementedError("mla_wg: wgmma has no simulator twin")
    if CL and not 2 <= CL <= 8:
        raise ValueError(f"mla_wg: a cluster merge of {CL} splits (2..8)")
    D8, NPV = D // 8, r // 2
    QBYTES, TILE, PBYTES = 64 * D * 2, NK * D * 2, 64 * NK * 2
    PB = QBYTES + stages * TILE                 # two P tiles (bytes), then the f32 stats
    SF = (PB + 2 * PBYTES) // 4                 # f32 index of alpha[2][64], max[64], sum[64]
    BAR = (PB + 2 * PBYTES + 4 * 64 * 4) // 8   # u64 index of the ring's mbarriers
    VHALF = NPV // 64 * NK * 128                # bytes into a tile of warpgroup 1's V columns
    NS, NO = NK // 2, NPV // 2                  # accumulators per thread: S (warpgroup 0), O (both)
    PITCH, R4 = r + 8, r // 4                   # staged epilogue: f32 rows of O (8 floats of padding: st.shared.v2
    #                                             of a warp without bank conflicts), r / 4 16-byte quads per row
    ML, FAC = 64 * PITCH, 64 * PITCH + 128      # f32 index (cluster): this block's max, sum of 64 rows; fold factors
    if (STAGED or CL) and 4 * (FAC + 64 * max(CL, 1)) > PB:
        raise ValueError(f"mla_wg: the staged O tile ({64 * PITCH * 4} bytes) does not fit below the P tiles ({PB})")
    QPT = 64 * D8 // 256                        # q units (8 values: 16 bytes of the tile) per thread
    QG = max(g for g in range(1, min(QG, QPT) + 1) if QPT % g == 0)   # units in flight (two 16-byte loads each)

    def stamp(k, ind="    "):
        """(STAMPS) thread 0 writes point k of its block's timeline: SM cycles, then global ns."""
        if not STAMPS:
            return ""
        return f"{ind}if tid == 0:\n{ind}    sm = stamp_point(count, blk, {2 * k})\n"
    stamp_tail = ("    if tid == 0:                              # (STAMPS) then its SM and steps\n"
                  "        count[blk, 14], count[blk, 15] = int32(sm), int32(nsteps)\n") if STAMPS else ""
    sv = [f"s{i}" for i in range(NS)]
    ov = [f"o{i}" for i in range(NO)]
    S, O = ", ".join(sv), ", ".join(ov)

    def s_calls(indent):
        """S = Q K^T on the tile of descriptor dk. Q and the cache tiles are 128-byte-swizzle atoms (sw128_offset):
        k16 step ks is 32 bytes into the rows of slab ks // 4 (slabs 64 * 128 bytes apart in Q, NK * 128 in a
        tile); descriptor units are 16 bytes."""
        return "\n".join(f"{indent}{S} = {'wg_s0' if ks == 0 else 'wg_s'}("
                         f"dq + uint64({((ks // 4) * 64 * 128 + (ks % 4) * 32) // 16}), "
                         f"dk + uint64({((ks // 4) * NK * 128 + (ks % 4) * 32) // 16}), {S})" for ks in range(D // 16))
    # O += P V: P (core matrices) columns 2ks, 2ks+1; V = the cache tile as MN-major B, k16 step = 2 atoms of 8 rows
    def pv_calls(indent):
        return "\n".join(f"{indent}{O} = wg_pv(dp + uint64({16 * ks}), dv + uint64({2048 * ks // 16}), {O})"
                         for ks in range(NK // 16))
    # softmax over S: register i is (row r0 + 8 ((i % 4) // 2), column 8 (i // 4) + 2 t + i % 2)
    lines = []
    for i in range(NS):
        col = f"{8 * (i // 4) + i % 2} + 2 * t"
        lines.append(f"x{i} = s{i} * scale")
        lines.append(f"if masked and not key_ok(c0 + {col}, hi, L, tq, b, mask):\n"
                     f"    x{i} = NEG_INF")
    xs0 = [f"x{i}" for i in range(NS) if i % 4 < 2]
    xs1 = [f"x{i}" for i in range(NS) if i % 4 >= 2]
    lines.append(f"mx0 = max(m0, {', '.join(xs0)})")
    lines.append(f"mx1 = max(m1, {', '.join(xs1)})")
    softmax_in = "\n".join(lines)
    plines = []
    for i in range(0, NS, 2):
        row = "r0" if i % 4 < 2 else "r1"
        mz = "mz0" if i % 4 < 2 else "mz1"
        tot = "tot0" if i % 4 < 2 else "tot1"
        plines.append(f"w = _pack2(_ex2(x{i} - {mz}), _ex2(x{i + 1} - {mz}))")
        plines.append(f"{tot} += as_f32(w << uint32(16)) + as_f32(w & uint32(0xFFFF0000))")
        plines.append(f"wsm[(pb + core_offset({row}, {8 * (i // 4)} + 2 * t, {NK // 8})) >> 2] = w")
    p_out = "\n".join(plines)
    softmax_max = SOFTMAX_MAX.replace("{softmax_in}", softmax_in).replace("{NK}", str(NK))
    softmax_exp = SOFTMAX_EXP.replace("{p_out}", p_out)

    def softmax(indent):
        """Online softmax of S (registers) for the step at key c0: P as bf16 into the P tile at byte pb, the
        rescale factors into alpha row sa and (al0, al1)."""
        return "\n".join(indent + ln if ln else ln for ln in (softmax_max + softmax_exp).split("\n"))

    def rescale(indent):
        return "\n".join(f"{indent}o{i} *= al{0 if i % 4 < 2 else 1}" for i in range(NO))
    # O's stores: unsigned row / column indices (no negative-index checks; the column's constant folds into the
    # store's address)
    stores = [f"    ra, rb, cb = uint32(mb + r0), uint32(mb + r1), uint32(wg * {NPV} + 2 * t)"]
    for j in range(NPV // 8):
        for half, (a, bb) in enumerate(((4 * j, 4 * j + 1), (4 * j + 2, 4 * j + 3))):
            row, inv = ("ra", "inv0") if half == 0 else ("rb", "inv1")
            stores.append(f"    o_part[b, s, {row}, cb + uint32({8 * j})] = o{a} * {inv}")
            stores.append(f"    o_part[b, s, {row}, cb + uint32({8 * j + 1})] = o{bb} * {inv}")
    def merge_in_cluster(ind):
        return "\n".join(ind + ln for ln in (
            "cluster_sync()                                # every block's O rows and (max, sum) published",
            "cluster_merge(wsm, fsm, out, b, s, mb, tid)   # this block's rows, from all",
            "cluster_sync()                                # the others are done reading this block's memory"))

    if STAGED or CL:      # O (times 1 / sum where normalized) into f32 rows of shared memory, then 16-byte stores
        stores = [f"    ra = uint32(r0 * {PITCH} + wg * {NPV} + 2 * t)", f"    rb = ra + uint32({8 * PITCH})"]
        for j in range(NPV // 8):
            stores.append(f"    sts8(fsm, ra + uint32({8 * j}), o{4 * j} * inv0, o{4 * j + 1} * inv0)")
            stores.append(f"    sts8(fsm, rb + uint32({8 * j}), o{4 * j + 2} * inv1, o{4 * j + 3} * inv1)")
        if CL:
            stores.append(merge_in_cluster("    "))
        else:
            stores.append(f'''    cuda.syncthreads()
    ob = (b * o_part.shape[1] + s) * M + mb     # the tile's first row of o_part [B, splits, M, r]
    for k in range({64 * R4 // 256}):           # a warp writes 512 contiguous bytes per store
        u = uint32(tid + 256 * k)
        row = u // uint32({R4})
        col = uint32(4) * (u - row * uint32({R4}))
        w0, w1, w2, w3 = lds16(wsm, row * uint32({PITCH}) + col)
        st_quad(o_part, (ob + row) * {r} + col, w0, w1, w2, w3)   # (f32, or bf16 partials: 8-byte stores)''')
    store_out = "\n".join(stores)
    zero_o = "\n".join(f"    {v} = float32(0)" for v in ov)
    zero_s = "\n".join(f"    {v} = float32(0)" for v in sv)


    def finish(m_at, l_of):
        """After the statistics are in shared memory (final max at row m_at, l_of(row) the sum's expression): the
        1 / sum of rows r0, r1 (normalize) or the (max, sum) partials."""
        return f'''    cuda.syncthreads()
    d0, d1 = {l_of("r0")}, {l_of("r1")}
    inv0, inv1 = float32(1), float32(1)
    if normalize:
        inv0 = float32(1) / d0 if d0 > float32(0) else float32(0)
        inv1 = float32(1) / d1 if d1 > float32(0) else float32(0)
    elif tid < 64:
        {ml_at(0)} = fsm[{m_at} + tid]
        {ml_at(1)} = {l_of("tid")}
'''

    def ml_at(k):
        """Where a block's (max, sum) of row tid go: ml_part, or (cluster) its shared memory for the others."""
        return f"fsm[{ML + 64 * k} + tid]" if CL else f"ml_part[b, s, mb + tid, {k}]"

    ring_init = f'''    if tid == 128:
        for p in range({stages}):
            mbar_init(bars, {BAR} + p)
        mbar_fence_init()
        tensormap_acquire(tmap)
    cuda.syncthreads()
'''
    ring_fill = f'''    if wg == 1:                                   # warpgroup 1: ring tiles 0, 1, 2 in flight
        for p in range(3):
            if tid == 128 and p <= nsteps:
                load_tile_tma(wsm, bars, tmap, row0, lo + p * {NK}, hi, p)
'''
    main = f'''    m0, m1 = NEG_INF, NEG_INF                     # warpgroup 0: running max and sum of rows r0, r1
    l0, l1 = float32(0), float32(0)
    plain = min(hi, L)                            # steps ending here see no mask
    dq = desc_k(wsm, 0)
    if wg == 1:
        tile_landed(wsm, bars, lo, hi, 0, tid - 128)
    fence_proxy_async()                           # st.shared (q) -> the wgmma proxy
    cuda.syncthreads()
    # Warpgroup 0, step i: after the barrier (P(i) and tile i + 1 visible) it issues S(i + 1), then O += P(i) V(i),
    # waits for S(i + 1) only and runs softmax(i + 1) beside the P V products on the tensor cores, then waits for
    # P V (i). Warpgroup 1 keeps tiles i + 1 .. i + 3 in flight (tile i + 3 into the slot of tile i - 1, whose P V
    # both warpgroups retired before the barrier) and adds its half of P(i) V(i). Two P tiles and two alpha rows
    # alternate. Every accumulator is retired inside the step that issued it (S(nsteps) runs on the zero tile past
    # the split's end), so ptxas keeps the wgmmas asynchronous.
    if wg == 0:                                   # one loop per warpgroup: no path crosses between them
        mbar_wait(bars, {BAR}, 0)                 # (warpgroup 1 saw it land: this wait returns at once)
{stamp(3, "        ")}        dk = desc_k(wsm, {QBYTES})
        wg_fence()
{s_calls("        ")}
        wg_commit()
        wg_wait0()
        c0, pb, sa = lo, {PB}, {SF}
{softmax("        ")}
        for i in range(nsteps):
            fence_proxy_async()                   # P(i) -> the wgmma proxy
            cuda.syncthreads()
            mbar_wait(bars, {BAR} + (i + 1) % {stages}, ((i + 1) // {stages}) & 1)
            dk = desc_k(wsm, {QBYTES} + ((i + 1) % {stages}) * {TILE})
            wg_fence()
{s_calls("            ")}
            wg_commit()
            if al0 != float32(1) or al1 != float32(1):    # rare with the lazy rescale
{rescale("                ")}
            dp = desc_p(wsm, {PB} + (i & 1) * {PBYTES})
            dv = desc_v(wsm, {QBYTES} + (i % {stages}) * {TILE})
            wg_fence()
{pv_calls("            ")}
            wg_commit()
            wg_wait1()                            # S(i + 1) done; P V (i) may still run
            c0, pb, sa = lo + (i + 1) * {NK}, {PB} + ((i + 1) & 1) * {PBYTES}, {SF} + ((i + 1) & 1) * 64
{softmax("            ")}
            wg_wait0()
    else:
        for i in range(nsteps):
            tile_landed(wsm, bars, lo, hi, i + 1, tid - 128)
            fence_proxy_async()
            cuda.syncthreads()
            if tid == 128 and i + 3 <= nsteps:
                load_tile_tma(wsm, bars, tmap, row0, lo + (i + 3) * {NK}, hi, (i + 3) % {stages})
            sa = {SF} + (i & 1) * 64
            al0, al1 = fsm[sa + r0], fsm[sa + r1]
            if al0 != float32(1) or al1 != float32(1):
{rescale("                ")}
            dp = desc_p(wsm, {PB} + (i & 1) * {PBYTES})
            dv = desc_v(wsm, {QBYTES} + (i % {stages}) * {TILE} + {VHALF})
            wg_fence()
{pv_calls("            ")}
            wg_commit()
            wg_wait0()
    wg_wait0()
    cp_wait0()                                    # (no cp.async in flight: see usm)
'''
    stats = QUAD_SUM + f'''    if wg == 0 and t == 0:
        fsm[{SF + 128} + r0], fsm[{SF + 192} + r0] = m0, l0
        fsm[{SF + 128} + r1], fsm[{SF + 192} + r1] = m1, l1
''' + finish(SF + 128, lambda x: f"fsm[{SF + 192} + {x}]")

    # (cluster) a block with nothing to attend still joins the merge: max -inf, sum 0
    cluster_empty = "" if not CL else f'''        if tid < 64:
            fsm[{ML} + tid] = NEG_INF
            fsm[{ML + 64} + tid] = float32(0)
{merge_in_cluster("        ")}
        return
'''
    fill_after_q = ("        if p0 == 0:                               # (q's first loads are out: now the ring)\n"
                    + textwrap.indent(ring_fill, "        ")) if Q_FIRST else ""     # (see MLA_WG_Q_FIRST)
    src = f'''
def mla_wg_attention(q, cache, tmap, lengths, ntok, mask, scale, split, normalize, o_part, ml_part, out, count):
    T, h = q.shape[1], q.shape[2]
    mt, s, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    wg, lane = tid >> 7, tid & 31
    g, t = lane >> 2, lane & 3
    r0 = 16 * ((tid >> 5) & 3) + g                # this thread's accumulator rows: r0 and r0 + 8
    r1 = r0 + 8
    M = T * h
    mb = mt * 64                                  # the tile's first row (query t, head): rows mb .. mb + 63
    tq = mb // h                                  # the query of this tile (64 of its heads)
{'    blk = (b * cuda.gridDim.y + s) * cuda.gridDim.x + mt' if STAMPS else ''}
{stamp(0)}    fsm = cuda.shared.array(0, float32, alignment=1024)     # swizzle atoms are 1024-aligned
    usm = cuda.shared.array(0, uint16, alignment=1024)      # unread, as cp_wait0 below: the PTX stays the measured one
    wsm = cuda.shared.array(0, uint32, alignment=1024)
    bars = cuda.shared.array(0, uint64, alignment=1024)
    L, n = lengths[b], ntok[b]
    lo = s * split
    hi = min(lo + split, L + n)
    if tq >= n or lo >= hi:                       # a dead query or an empty split: nothing to attend
{cluster_empty}        if normalize:
            for idx in range(tid, 64 * {r}, 256):
                o_part[b, s, mb + idx // {r}, idx % {r}] = float32(0)
        elif tid < 64:
            ml_part[b, s, mb + tid, 0] = NEG_INF
            ml_part[b, s, mb + tid, 1] = float32(0)
        return
    row0 = b * cache.shape[1]
    nsteps = (hi - lo + {NK - 1}) // {NK}
{ring_init}
{stamp(1)}{"" if Q_FIRST else ring_fill}    qv = cuda.local.array({8 * QG}, uint32)
    for p0 in range(0, {QPT}, {QG}):              # q tile -> bf16, 128-byte swizzle: unit u is 8 values, 8 lanes
        for p in range({QG}):                     # read 256 contiguous bytes and store to 8 bank groups
            u = tid + (p0 + p) * 256
            qo = (b * M + mb) * {D} + 8 * u
            qv[8 * p], qv[8 * p + 1], qv[8 * p + 2], qv[8 * p + 3] = ld16(q, qo)
            qv[8 * p + 4], qv[8 * p + 5], qv[8 * p + 6], qv[8 * p + 7] = ld16(q, qo + 4)
{fill_after_q}        for p in range({QG}):
            u = uint32(tid + (p0 + p) * 256)      # unsigned 32 bits: the division by D8 is a multiply-shift and
            qr = u // uint32({D8})                # the word index needs no negative-index check
            o = uint32(sw128_offset(qr, 8 * (u - qr * uint32({D8})), 64) >> 2)
            for e in range(4):
                wsm[o + uint32(e)] = _pack2(as_f32(qv[8 * p + 2 * e]), as_f32(qv[8 * p + 2 * e + 1]))
{zero_o}
{zero_s}
{stamp(2)}{main}
{stamp(4)}{stats}
{stamp(5)}{store_out}
{stamp(6)}{stamp_tail}'''
    cp_wait0 = cp_wait(0)

    NSLAB = D // 64

    @cuda.jit(device=True, inline="always")
    def load_tile_tma(wsm, bars, tmap, row0, j0, hi, stage):
        """Thread 128: the NSLAB boxes (64 columns x NK rows, 128-byte swizzle) of cache rows j0 .. j0 + NK - 1 into
        ring slot `stage`, completing on its mbarrier; a tile wholly past the split's end (the zero tile after the
        last step) copies nothing and only completes the barrier's phase (see tile_landed)."""
        if j0 >= hi:
            mbar_expect(bars, BAR + stage, 0)
            return
        mbar_expect(bars, BAR + stage, TILE)
        for k in range(NSLAB):
            tensor_load_2d(wsm, (QBYTES + stage * TILE + k * NK * 128) // 4, tmap, 64 * k, row0 + j0, bars,
                           BAR + stage)

    @cuda.jit(device=True, inline="always")
    def tile_landed(wsm, bars, lo, hi, j, tid):
        """Warpgroup 1 (tid < 128): wait for tile j's copies, then zero the rows at or past hi of a tile that ends
        past it (unwritten rows or the next sequence's: P is 0 there but P V must not meet a NaN), 32 words of a
        row per warp's lanes, four rows at a time. The zero tile past the last step (only S reads it, masked) keeps
        whatever its slot held."""
        stage = j % stages
        mbar_wait(bars, BAR + stage, (j // stages) & 1)
        v = hi - (lo + j * NK)
        if v > 0 and v < NK:
            base = (QBYTES + stage * TILE) // 4 + (tid & 31)
            for rr in range(v + (tid >> 5), NK, 4):
                for k in range(NSLAB):
                    wsm[base + (k * NK + rr) * 32] = uint32(0)

    @cuda.jit(device=True, inline="always")
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

    CLN = max(CL, 1)
    RP = -(-64 // CLN)                          # (cluster) rows of the tile each block merges
    MU = max(1, 8 // CLN)                       # items per round: MU x CL 16-byte loads in flight

    @cuda.jit(device=True, inline="always")
    def cluster_merge(wsm, fsm, out, b, s, mb, tid):
        """The cluster of the tile's CL split blocks (gridDim.y = CL, rank s % CL; after a cluster barrier): fold rows
        rank RP .. rank RP + RP - 1 of the tile from every block's staged O and (max m_c, sum l_c), read through
        DSMEM, into out f32[B, M, r]: out = sum_c 2^(m_c - m) O_c / sum_c 2^(m_c - m) l_c (rows no split saw get 0,
        merge_splits' rule). 16-byte stores."""
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

    from numbaengine.kernels.bulk import (
        mbar_expect,
        mbar_fence_init,
        mbar_init,
        mbar_wait,
        tensor_load_2d,
        tensormap_acquire,
    )
    from numbaengine.kernels.mla import LAZY
    ns = dict(mbar_init=mbar_init, mbar_fence_init=mbar_fence_init, mbar_wait=mbar_wait,
              tensormap_acquire=tensormap_acquire,
              load_tile_tma=load_tile_tma, tile_landed=tile_landed, cuda=cuda, float32=float32, int32=int32,
              uint16=uint16, uint32=uint32, uint64=uint64, NEG_INF=NEG_INF, LAZY=LAZY,
              shfl_xor=shfl_xor, as_f32=as_f32, ld16=ld16, _ex2=_ex2, _pack2=_pack2,
              sts8=sts8, lds16=lds16, st_quad=st_quad, cluster_sync=cluster_sync,
              cluster_merge=cluster_merge, stamp_point=stamp_point,
              core_offset=cuda.jit(device=True, inline="always")(core_offset), key_ok=key_ok,
              sw128_offset=cuda.jit(device=True, inline="always")(sw128_offset),
              cp_wait0=cp_wait0, fence_proxy_async=fence_proxy_async,
              wg_fence=wg_fence, wg_commit=wg_commit, wg_wait0=wg_wait0, wg_wait1=wg_wait1,
              desc_k=make_desc(16, 1024, 128), desc_p=make_desc(128, 16 * NK),
              desc_v=make_desc(*sw128_mn_strides(NK * 128, 1024), 128),
              wg_s0=make_wgmma(NK, accumulate=False), wg_s=make_wgmma(NK), wg_pv=make_wgmma(NPV, trans_b=True))
    exec(src, ns)
    return kernel(max_registers=255)(ns["mla_wg_attention"])


def mla_wg_launch(M, D, r, causal, work, cache):
    """(kernel, row tiles, threads, shared bytes, tensor map) for mla.mla_attention's launch: M = T h query rows in
    tiles of 64 (one query's heads), 256 threads; `work` splits must be whole steps. The tensor map (a device u64
    array, made once per cache) is the kernel's third argument. Its cluster variants (mla_wg_kernel(..., cluster=c),
    launched in clusters of (1, c, 1) blocks, c = all the splits) write out."""
    if work is not None and work.split % MLA_WG_NK:
        raise ValueError(f"mla_attention: split {work.split} is not a multiple of {MLA_WG_NK} keys")
    smem = wg_smem(D, MLA_WG_NK, wg_stages(D))
    return mla_wg_kernel(D, r, causal), M // 64, 256, smem, cache_tensor_map(cache)


_TMAP_DEV = {}


def cache_tensor_map(cache):
    """The TMA tensor map of a bf16 latent cache [B, cap, D] seen as [B cap, D] rows, in device memory (made on the
    first call for this cache, outside graph capture: engines warm up before they capture)."""
    from numbaengine.kernels.bulk import tensor_map_2d
    from numbaengine.kernels.gemm import _address
    B, cap, D = cache.shape
    key = (_address(cache), B * cap, D, MLA_WG_NK)
    if key not in _TMAP_DEV:
        _TMAP_DEV[key] = cuda.to_device(tensor_map_2d(key[0], B * cap, D, MLA_WG_NK, 64))
    return _TMAP_DEV[key]
