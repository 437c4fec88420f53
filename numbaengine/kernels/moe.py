"""MoE: the sigmoid router with grouped top-k, and the routed experts (INT4 W4A16 or bf16).

Router (MODEL.md section 4): s = sigmoid(x @ Wg^T) in float32; choice = s + bias picks the experts (lower index
wins ties); weights = s at the picks, normalized, times routed_scaling_factor.
Experts: y = sum_j w_j * down(silu(gate(x)) * up(x)); gate and up are stacked as one [2I, H] matrix per expert.
The NumPy reference is reference.router_ref / moe_ref; here the router, the routing plan and the experts (INT4 or
bf16) run on the mma GEMM core of kernels/gemm.py.
"""
import math
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda, float32, int32, uint16, uint32, uint64

from numbaengine.kernels.bulk import (
    bulk_load,
    mbar_expect,
    mbar_fence_init,
    mbar_init,
    mbar_wait,
)
from numbaengine.kernels.device import (
    F0,
    F1,
    SIM,
    bf16_hi,
    bf16_lo,
    device,
    grid_dep,
    lane_id,
    ld16,
    match_rank,
    pack_bf16x2,
    shfl_idx,
    stamp_point,
    syncwarp,
    warp_argmax,
    warp_sum,
)
from numbaengine.kernels.device import as_f32 as _f
from numbaengine.kernels.gemm import (
    BF16,
    INT4,
    MAX_WARPS,
    build_block_reduce,
    build_int4_mma,
    build_mainloop,
    lds16,
    split_range,
)
from numbaengine.kernels.launch import cached, kernel, launch, launch_smem, u32_words
from numbaengine.kernels.prep import build_prep_unit
from numbaengine.reference import Experts

MAX_E = 1024          # experts per layer the router/plan kernels handle (one thread each)
MAX_SLOTS = 32768     # tokens * top_k the plan kernel handles (its per-segment counts are uint16)
PLAN_SEGS = 16        # warps of the block plan, each ranking one contiguous segment of the slots
PLAN_WARP_SLOTS = 32  # routings of up to this many slots (<= 32) are planned by one warp without barriers (H200,
#                       K2, n = 1: 4.8-5.2 us against 7.9-8.5 for the block plan)
NEG_INF = float32(-np.inf)


def int4_group_block(k):
    """Scale groups per 16-byte lane load (G): 4 when k % 128 == 0, else 2 (k % 64), else 1."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def int4_tiles(packed, xp=np):
    """compressed-tensors words i32[..., N, K/8] -> the kernels' word-transposed layout, made once at load time.

    Natural order: word 4j + t of a 32*G-column block holds group j's columns 8t..8t+7. Transposed: word t*G + j.
    So lane t's G consecutive words (one 16-byte load when G = 4) hold its 8 columns of each of the G groups. A
    pure permutation of whole words (nibbles untouched): int4_tiles is undone by the same reshape transposed back."""
    *lead, n, words = packed.shape
    g = int4_group_block(words * 8)
    t = packed.reshape(*lead, n, words // (4 * g), g, 4)
    return xp.ascontiguousarray(xp.swapaxes(t, -1, -2)).reshape(*lead, n, words)


BULK_WORDS = 288     # u32 words of one (row tile, k-step) chunk of the bulk layout: 2 x 128 weight words + 32 of scales
# the bulk ring's geometry, one i32 local array per warp (`_build_bulk_ring`): the block's first unit, unit stride and
# unit count, row blocks per item, warps along the rows and this warp's index there, row-tile groups, k-steps, the
# warp's k-steps [S0, S1) and stages per unit, its ring's first word and first barrier
(G_UNIT0, G_STRIDE, G_UNITS, G_RBLOCKS, G_NWR, G_WR, G_GROUPS, G_KSTEPS, G_S0, G_S1, G_NST, G_RING, G_BAR,
 GEO) = range(14)


def int4_bulk_tiles(words, scales, R, xp=np):
    """gate_up's int4_tiles words u32[E, N=2I, K=H/8] + scales u16[E, N, K/32] -> u32[E, N/(16R), K/128,
    R*BULK_WORDS], made once at load time for the bulk-copy expert GEMM: the R row tiles of one warp are one
    contiguous chunk per k-step (a stage of the ring is one bulk copy), and a chunk is in the order the lanes read it
    from shared memory. Chunk of row tile p, k-step s: words [128h, 128h+128) = rows (g = 0..7) of half h, each its
    16 words of the step (lane g*4+t reads words 4t..4t+3 of row g: one 16-byte piece per lane, conflict-free);
    words [256, 288) = the scales u16[g, h, j] (lane reads its 4 of each half with one 16-byte load). Row of (p, h,
    g): h=0 the gate row 8p+g, h=1 the up row N/2+8p+g (the kernel's interleave). Needs K % 128 == 0 and
    (N/16) % R == 0."""
    E, N, KW = words.shape
    ks, P = KW // 16, N // 16
    if KW % 16 or N % 16 or P % R or scales.shape != (E, N, KW // 4):
        raise ValueError(f"int4_bulk_tiles: words {words.shape} / scales {scales.shape}, R={R}: need K % 128 == 0, "
                         f"N % (16R) == 0 and scales [E, N, K/32]")
    w = xp.swapaxes(words.reshape(E, 2, P, 8, ks, 16), 1, 2)                                  # e p h g s .
    sc = xp.swapaxes(scales.reshape(E, 2, P, 8, ks, 4), 1, 2)
    w = xp.ascontiguousarray(w.transpose(0, 1, 4, 2, 3, 5)).reshape(E, P, ks, 256)            # e p s (h g w)
    sc = xp.ascontiguousarray(sc.transpose(0, 1, 4, 3, 2, 5)).reshape(E, P, ks, 64).view(xp.uint32)  # (g h j)
    t = xp.concatenate([w.view(xp.uint32), sc], axis=-1).reshape(E, P // R, R, ks, BULK_WORDS)
    return xp.ascontiguousarray(xp.swapaxes(t, 2, 3)).reshape(E, P // R, ks, R * BULK_WORDS)


@dataclass
class DeviceExperts:
    """One layer's routed experts on the device. int4: gate_up u32[E, 2I, H/8] and down u32[E, H, I/8] in the
    `int4_tiles` layout, scales u16 [E, out, in/32] as in the checkpoint, except (tiled = R > 0) gate_up in the bulk
    layout of `int4_bulk_tiles` [E, 2I/16R, H/128, R*288] with its scales inside (gate_up_scale None), for the
    bulk-ring stage; bf16: u16 weights, scales None."""
    gate_up: object
    down: object
    gate_up_scale: object = None
    down_scale: object = None
    group: int = 32
    offset: int = 0          # global id of local expert 0 (expert parallelism: this device holds a range)
    tiled: int = 0           # R of gate_up's bulk layout (0: int4_tiles rows + separate scales)

    @property
    def int4(self) -> bool:
        return self.gate_up_scale is not None or self.tiled > 0


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts' layout choice: the default is what the engine runs, with the measurement behind it. The op
    table holds one (KernelOps.moe_cfg) and uploads experts with it; tools and tests pass others."""
    tiled: int = 2   # R row tiles per chunk of gate_up's bulk layout (int4_bulk_tiles; the stage then runs the bulk
    #                  rings, BULK_GATE_UP_CFG, whose R it must equal), 0: int4_tiles rows on the register path
    #                  (GATE_UP_CFG). H200, gate_up alone, % of copy at n = 1 / 4 / 9 / 17 / 33 (python -m
    #                  tools.bench_kernels --only moe): 70 / 80 / 84 / 84 / 82 against 62 / 73 / 78 / 80 / 72 on rows
    token_tiles: int = 1   # most token tiles (8 slots each) of one work item (`token_tiles`): an item applies each
    #                        dequantized weight fragment to up to 8 * T slots of its expert (many-token prompts).
    #                        1 until T = 2 is timed (python -m tools.bench_kernels --only moe_many); T >= 4 spills
    #                        registers in this kernel even at 255 (ptxas sm_90a: 36-244 bytes)


MOE_DEFAULT = MoeConfig()


def device_experts(experts: Experts, to_device, tiled=None, xp=None, cfg: MoeConfig = MOE_DEFAULT) -> DeviceExperts:
    """Host Experts -> DeviceExperts (INT4 words re-laid by int4_tiles; with tiled = R > 0 gate_up by
    int4_bulk_tiles; tiled None: cfg.tiled where the shapes allow it; `to_device` copies a NumPy array). xp: the array
    module of to_device's results, to make the bulk layout there (CuPy: on the GPU; on the host it took ~3 s per K2
    MoE layer on the H200 machine's CPU); experts already in xp's memory are re-laid there (to_device: a no-op or a
    contiguous copy)."""
    if not experts.int4:
        return DeviceExperts(to_device(experts.gate_up), to_device(experts.down), offset=experts.offset)
    if experts.group != 32:
        raise ValueError(f"device_experts: group size {experts.group} is not 32")
    here = xp if xp is not None and isinstance(experts.gate_up, xp.ndarray) else np
    gu, dn = (int4_tiles(w, here).view(np.uint32) for w in (experts.gate_up, experts.down))
    if tiled is None:
        tiled = cfg.tiled if bulk_fits(gu.shape[2] * 8, gu.shape[1] // 2, cfg.tiled) else 0
    if tiled:
        if xp is None:
            bulk = to_device(int4_bulk_tiles(gu, experts.gate_up_scale, tiled))
        else:
            bulk = int4_bulk_tiles(to_device(gu), to_device(experts.gate_up_scale), tiled, xp)
        return DeviceExperts(bulk, to_device(dn), None, to_device(experts.down_scale), offset=experts.offset,
                             tiled=tiled)
    return DeviceExperts(to_device(gu), to_device(dn), to_device(experts.gate_up_scale),
                         to_device(experts.down_scale), offset=experts.offset)


def bulk_fits(hidden, inter, R):
    """Whether gate_up [2I, H] takes the bulk layout with R row tiles per chunk (H % 128, 2I % 16R)."""
    return R > 0 and hidden % 128 == 0 and (2 * inter) % (16 * R) == 0


@dataclass
class MoeWorkspace:
    """Scratch of the router and experts for up to `n_max` tokens, allocated once (fixed sizes: graph capture)."""
    logits: object        # f32[ks, n_max, E]          router GEMV k slices (ks = router_slices(H))
    xb: object            # u32 flat [n_max * H / 2]      B operand of gate_up (bf16 activations: W4A16)
    act: object           # u32 flat [n_max * k * I / 2]  B operand of down (silu(gate) * up, bf16)
    y: object             # f32[n_max * k, H]             per-slot expert outputs, routing weight applied
    sorted_slot: object   # i32[n_max * k]                slots (t * k + j) grouped by expert
    item_e: object        # i32[n_max * k]                work items: expert, first sorted slot, count
    item_start: object
    item_len: object
    n_items: object       # i32[1]
    n_max: int
    top_k: int
    stamps: object = None  # i32[>= grid, STAMP_WORDS]: the stamped stage's block timelines (ExpertConfig.stamps; else a
    #                        [1, 1] placeholder the kernels do not touch, made once: no per-call host work)


def moe_workspace(n_max, top_k, hidden, inter, n_experts, alloc):
    """alloc(shape, dtype) -> array (numba.cuda.device_array, or np.empty under the simulator)."""
    s = n_max * top_k
    return MoeWorkspace(alloc((router_slices(hidden), n_max, n_experts), np.float32),
                        alloc((n_max * hidden // 2,), np.uint32), alloc((s * inter // 2,), np.uint32),
                        alloc((s, hidden), np.float32),
                        alloc((s,), np.int32), alloc((s,), np.int32), alloc((s,), np.int32), alloc((s,), np.int32),
                        alloc((1,), np.int32), n_max, top_k, alloc((1, 1), np.int32))


# ------------------------------------------------------------------------------------------------------ router
ROUTER_CHUNKS = 4      # 8-column chunks per lane of one router warp (its gate weights stay in registers)
ROUTER_XS = 2          # router logits on the mma GEMM: x as bf16 hi + lo parts (~1e-5; routing near-ties are sharp)


def router_slices(hidden):
    """k slices of the router GEMV: each warp holds <= 32 * ROUTER_CHUNKS chunks of one expert's gate row, and
    K2's 384 x 7168 gate is cut 8 ways (3072 warps; one whole row per warp, 48 blocks: 29 us for the whole router
    at n = 1). ncu on the H200 (K2, logits kernel, n = 1 / 17): 8 slices converting the
    gate per token 10.9 / 52 us; with the gate as f32 in registers (this kernel) 6.5 / 43 us, latency-bound (~15
    cycles per issued instruction, 72 registers); 4 experts per warp over 14 slices 7.7 / 65 us (118-128 registers)."""
    chunks = hidden // 8
    return max(math.ceil(chunks / (32 * ROUTER_CHUNKS)), min(8, chunks // 24), 1)


def _build_router_logits(TT):
    NW = 8 * ROUTER_CHUNKS

    @kernel()
    def router_logits(x, wg, part, n, hdim, n_exp):
        """part f32[ks, n, E]: slice p of x f32[n, H] @ bf16(wg)^T in float32 (CUDA cores: near-ties must not
        flip; router_select adds the slices in order). Warp (e, p): expert e = 8 * (bx // ks) + warp, k slice
        p = bx % ks, its gate chunks loaded once into registers, then passes of TT tokens (block row y takes
        passes y, y + ny, ...). The 8 warps of a block share x's slice through L1.
        Launch: grid (ceil(E/8) * ks, ny), block 256. Moves E*H*2 bytes of gate weights from HBM (x through L1/L2)."""
        grid_dep()
        ks = part.shape[0]
        e = (cuda.blockIdx.x // ks) * 8 + cuda.threadIdx.x // 32
        p = cuda.blockIdx.x % ks
        lane = lane_id()
        if e >= n_exp:
            return
        c0 = (p * (hdim // 8)) // ks
        c1 = ((p + 1) * (hdim // 8)) // ks
        wf = cuda.local.array(NW, float32)            # the warp's gate chunks as f32, converted once
        for i in range(ROUTER_CHUNKS):
            c = c0 + lane + 32 * i
            if c < c1:
                w0, w1, w2, w3 = ld16(wg, e * (hdim // 2) + c * 4)
                wf[8 * i], wf[8 * i + 1], wf[8 * i + 2], wf[8 * i + 3] = (bf16_lo(w0), bf16_hi(w0), bf16_lo(w1),
                                                                          bf16_hi(w1))
                wf[8 * i + 4], wf[8 * i + 5], wf[8 * i + 6], wf[8 * i + 7] = (bf16_lo(w2), bf16_hi(w2), bf16_lo(w3),
                                                                              bf16_hi(w3))
        for t0 in range(cuda.blockIdx.y * TT, n, TT * cuda.gridDim.y):
            acc = cuda.local.array(TT, float32)
            for j in range(TT):
                acc[j] = F0
            for i in range(ROUTER_CHUNKS):
                c = c0 + lane + 32 * i
                if c < c1:
                    for j in range(TT):
                        tok = min(t0 + j, n - 1)
                        x0, x1, x2, x3 = ld16(x, tok * hdim + c * 8)
                        x4, x5, x6, x7 = ld16(x, tok * hdim + c * 8 + 4)
                        a = acc[j]
                        a += wf[8 * i] * _f(x0) + wf[8 * i + 1] * _f(x1)
                        a += wf[8 * i + 2] * _f(x2) + wf[8 * i + 3] * _f(x3)
                        a += wf[8 * i + 4] * _f(x4) + wf[8 * i + 5] * _f(x5)
                        a += wf[8 * i + 6] * _f(x6) + wf[8 * i + 7] * _f(x7)
                        acc[j] = a
            for j in range(TT):
                v = warp_sum(acc[j])
                if lane == 0 and t0 + j < n:
                    part[p, t0 + j, e] = v
    return router_logits


def _build_router_select(KS):
    @kernel()
    def router_select(part, bias, idx_out, w_out, n_exp, top_k, n_group, topk_group, norm, scaling):
        """Per token (one block, one thread per expert): logit = the KS k slices of part f32[KS, n, E] added in
        order (all KS loaded first: in flight together), sigmoid, + bias for the choice, grouped top-k (group score
        = sum of its top-2 choices), lower index wins ties; weights = normalized sigmoid * scaling.
        Launch: grid n, block >= E (multiple of 32, <= 1024). Moves KS*n*E*4 bytes in, n*top_k*8 out."""
        grid_dep()
        sh_s = cuda.shared.array(MAX_E, float32)
        sh_c = cuda.shared.array(MAX_E, float32)
        sh_g = cuda.shared.array(MAX_E, float32)
        sh_sel = cuda.shared.array(MAX_E, float32)
        sh_wv = cuda.shared.array(32, float32)
        sh_wi = cuda.shared.array(32, int32)
        sh_pick = cuda.shared.array(1, int32)
        tok, e = cuda.blockIdx.x, cuda.threadIdx.x
        per = n_exp // n_group
        c = NEG_INF
        if e < n_exp:
            sl = cuda.local.array(KS, float32)
            for p in range(KS):
                sl[p] = part[p, tok, e]
            logit = sl[0]
            for p in range(1, KS):
                logit += sl[p]
            s = F1 / (F1 + math.exp(-logit))
            c = s + bias[e]
            if c != c:                                # NaN (a non-finite x row) loses to every choice: the picks
                c = NEG_INF                           # stay expert ids (NaN never wins a comparison: id MAX_E)
            sh_s[e] = s
            sh_c[e] = c
        cuda.syncthreads()
        if n_group > 1:
            if e < n_group:
                m1, m2 = NEG_INF, NEG_INF
                for i in range(e * per, (e + 1) * per):
                    v = sh_c[i]
                    if v > m1:
                        m1, m2 = v, m1
                    elif v > m2:
                        m2 = v
                sh_g[e] = m1 + m2 if per > 1 else m1          # a group of one scores its choice
            cuda.syncthreads()
            if e < n_exp:
                grp = e // per
                rank = 0
                for h in range(n_group):
                    if sh_g[h] > sh_g[grp] or (sh_g[h] == sh_g[grp] and h < grp):
                        rank += 1
                if rank >= topk_group:
                    c = NEG_INF
        # top_k rounds of a block argmax over (choice, expert): each round takes the best live entry, ties to the
        # lower index. ncu, K2 (384 experts, top-8): 10.0 us; one thread per expert ranking against all E: 17 us;
        # per-warp top_k then warp 0 over the candidates: 10.8 us (so the rounds are not where the time goes); all
        # in one warp (12 experts per lane, no block barrier): 25.4-26.4 us, 5155 warp instructions in series
        lane, warp, nw = e % 32, e // 32, cuda.blockDim.x // 32
        kv, ki = c, int32(e) if e < n_exp else int32(MAX_E)     # (-inf, MAX_E): loses to every live entry
        for r in range(top_k):
            v, i = warp_argmax(kv, ki)
            if lane == 0:
                sh_wv[warp] = v
                sh_wi[warp] = i
            cuda.syncthreads()
            if e == 0:
                bv, bi = sh_wv[0], sh_wi[0]
                for w in range(1, nw):
                    ov, oi = sh_wv[w], sh_wi[w]
                    if ov > bv or (ov == bv and oi < bi):
                        bv, bi = ov, oi
                idx_out[tok, r] = bi
                sh_sel[r] = sh_s[bi]
                sh_pick[0] = bi
            cuda.syncthreads()
            if ki == sh_pick[0]:
                kv, ki = NEG_INF, int32(MAX_E)
        if e < top_k:
            w = sh_sel[e]
            if norm:
                tot = F0
                for j in range(top_k):
                    tot += sh_sel[j]
                w = w / (tot + float32(1e-20))
            w_out[tok, e] = w * scaling
    return router_select


def router(x, w_gate, bias, top_k, n_group, topk_group, norm_topk, scaling, idx_out, w_out, ws, tokens_per_pass=4,
           token_blocks=None, k_slices=None, logits_gemm=None):
    """GPU router_ref: x f32[n, H] (contiguous), w_gate u16[E, H], bias f32[E] -> idx_out i32[n, k], w_out f32[n, k].
    ws.logits f32[>= ks, >= n, E] takes the GEMV's k slices (ks = k_slices or router_slices(H)). The logits' passes of
    tokens_per_pass tokens spread over token_blocks block rows (default: as many as fill two blocks per SM; in one
    block row a tree's 17 rows on the pair's 16 experts run as 5 serial passes in 2 blocks).
    logits_gemm(x, w_gate, out f32[n, E]): the logits from that GEMM instead (one slice; e.g. the mma GEMM with x as
    bf16 hi + lo parts, ROUTER_XS: ~1e-5 from float32 where the CUDA-core GEMV is float32)."""
    n, h = x.shape
    e = w_gate.shape[0]
    if (e > MAX_E or e % n_group or h % 8 or not 0 < top_k <= e or idx_out.shape != (n, top_k)
            or w_out.shape != (n, top_k)):
        raise ValueError(f"router: E={e}, top_k={top_k}, n_group={n_group}, H={h}, outputs {idx_out.shape}/"
                         f"{w_out.shape} not supported (top_k <= E <= {MAX_E}, E % n_group == 0, H % 8 == 0, "
                         f"outputs [n, {top_k}])")
    ks = 1 if logits_gemm is not None else k_slices or router_slices(h)
    if logits_gemm is None and math.ceil(h // 8 / ks) > 32 * ROUTER_CHUNKS:
        raise ValueError(f"router: {ks} k slices of H={h} hold more than {32 * ROUTER_CHUNKS} 8-column chunks each")
    if n > ws.n_max or ws.logits.shape[0] < ks or ws.logits.shape[2] != e:
        raise ValueError(f"router: {n} tokens, {ks} k slices of {e} experts do not fit the workspace's logits "
                         f"{tuple(ws.logits.shape)} (n_max {ws.n_max})")
    part = ws.logits[:ks, :n]
    if logits_gemm is not None:
        logits_gemm(x, w_gate, part[0])
    else:
        tt = min(tokens_per_pass, n)                   # a 1-token call does not compute 3 clamped copies
        passes, eblocks = math.ceil(n / tt), math.ceil(e / 8) * ks
        if token_blocks is None:
            token_blocks = min(passes, max(1, 2 * _sm_count() // eblocks))
        launch(cached(_build_router_logits, tt), (eblocks, max(1, token_blocks)), 256,
               x.reshape(n * h), u32_words(w_gate), part, int32(n), int32(h), int32(e))
    launch(cached(_build_router_select, ks), n, 32 * math.ceil(e / 32), part, bias, idx_out, w_out, int32(e),
           int32(top_k), int32(n_group), int32(topk_group), int32(bool(norm_topk)), float32(scaling))
    return idx_out, w_out


# -------------------------------------------------------------------------------------------------------- plan
@device
def _scan_shared(a, nelem):
    """In-place inclusive prefix sum of shared a[0:nelem] (Hillis-Steele, nelem <= blockDim; every thread calls
    it). Measured on the H200 (ncu, plan kernel at n = 1, K2's 384 experts): 7.9 us against 14.4 us with
    device.block_scan (one value per thread, warp shuffles) and 8.9 us with one warp scanning runs of 12."""
    i = cuda.threadIdx.x
    d = 1
    while d < nelem:
        v = 0
        if i < nelem:
            v = a[i]
            if i >= d:
                v += a[i - d]
        cuda.syncthreads()
        if i < nelem:
            a[i] = v
        cuda.syncthreads()
        d *= 2


@device
def _plan_warp(idx, ns, top_k, e0, n_exp, cap, sorted_slot, item_e, item_start, item_len, n_items, lane):
    """The plan for ns <= 32 slots by one warp in registers (no shared memory, no barrier): lane i holds slot i's
    local expert e; its place in the expert-grouped order is (slots of lower experts) + (its rank among e's
    slots); the first slot of each expert writes that expert's work items after the items of lower experts."""
    e = int32(-1)
    if lane < ns:
        e = int32(idx[lane // top_k, lane % top_k] - e0)
        if e < 0 or e >= n_exp:
            e = int32(-1)                                  # an expert of another device
    cnt, rank, below = int32(0), int32(0), int32(0)
    for j in range(32):                                    # slots of e, of e before this lane, of lower experts
        ej = shfl_idx(e, int32(j))
        if ej == e:
            cnt += 1
            if j < lane:
                rank += 1
        elif ej >= 0 and ej < e:
            below += 1
    nit = int32((cnt + cap - 1) // cap) if e >= 0 and rank == 0 else int32(0)  # on e's first slot only
    it, total = int32(0), int32(0)
    for j in range(32):                                    # items of lower experts, and of all
        ej, nj = shfl_idx(e, int32(j)), shfl_idx(nit, int32(j))
        total += nj
        if ej < e:
            it += nj
    if e >= 0:
        sorted_slot[below + rank] = lane
        for q in range(0, cnt if rank == 0 else 0, cap):
            item_e[it], item_start[it], item_len[it] = e, below + q, min(cap, cnt - q)
            it += 1
    if lane == 0:
        n_items[0] = total


@device
def _held(idx, i, ns, top_k, e0, n_exp):
    """Local expert of slot i (t * top_k + j), or -1 past the slots or for an expert of another device."""
    e = int32(-1)
    if i < ns:
        e = int32(idx[i // top_k, i % top_k] - e0)
        if e < 0 or e >= n_exp:
            e = int32(-1)
    return e


def _build_plan(perm, warp_slots):
    """The plan kernel; routings of <= warp_slots slots take _plan_warp (PLAN_WARP_SLOTS)."""
    prep_unit = cached(build_prep_unit, 1, perm, 0)

    @kernel(max_registers=64)                     # 1024-thread blocks
    def plan(idx, n, top_k, e0, n_exp, cap, sorted_slot, item_e, item_start, item_len, n_items, x, xb, kdim):
        """Block 0: the routing plan: slots (t * k + j) of the experts held here (global ids e0 .. e0+n_exp-1)
        grouped by local expert (stable: slot order inside an expert), and work items of <= cap slots per expert,
        in expert order. Outputs sized n_max*k (fixed); n_items[0] = live items. Above warp_slots slots, each of
        PLAN_SEGS warps takes a contiguous segment: it counts its slots per expert (match_rank per 32 slots), the
        counts give each segment its first place inside each expert, and a second pass writes the slots there in
        order (no atomics: stable, the same plan every run). Blocks 1..: the B operand of
        gate_up, xb = prep of x f32[n, kdim] (gemm's prep: bf16 pairs, perm=1 the INT4 column order), row
        (b - 1) // per_row. Launch: grid 1 + n * ceil(kdim / 8 / block), block 1024 (>= n_exp). Moves the
        routing (n*k*4 bytes) in and the plan (about 4*n*k*4) out; x once (n*kdim*4) and xb once (n*kdim*2)."""
        grid_dep()
        tid, bs = cuda.threadIdx.x, cuda.blockDim.x
        if cuda.blockIdx.x > 0:
            per_row = (kdim // 8 + bs - 1) // bs
            b = cuda.blockIdx.x - 1
            prep_unit(x, xb, n, kdim, b // per_row, (b % per_row) * bs + tid)
            return
        ns = n * top_k
        if ns <= warp_slots:                                            # decode-sized routings: one warp
            if tid < 32:
                _plan_warp(idx, ns, top_k, e0, n_exp, cap, sorted_slot, item_e, item_start, item_len, n_items, tid)
            return
        seg = cuda.shared.array((PLAN_SEGS, MAX_E), uint16)   # per (warp, expert): slots, then first place
        cnt = cuda.shared.array(MAX_E, int32)
        inc = cuda.shared.array(MAX_E, int32)
        iinc = cuda.shared.array(MAX_E, int32)
        warp, lane = tid // 32, lane_id()
        nseg = min(PLAN_SEGS, bs // 32)
        seg_len = (ns + 32 * nseg - 1) // (32 * nseg) * 32                # warp w ranks slots [w, w+1) * seg_len
        s0, s1 = warp * seg_len, min((warp + 1) * seg_len, ns)
        for i in range(tid, nseg * n_exp, bs):
            seg[i // n_exp, i % n_exp] = 0
        cuda.syncthreads()
        if warp < nseg:                                                  # count each expert's slots per segment
            for c in range(s0, s1, 32):
                e = _held(idx, c + lane, ns, top_k, e0, n_exp)
                rank, same = match_rank(e)
                if e >= 0 and rank == 0:
                    seg[warp, e] += same
                syncwarp()
        cuda.syncthreads()
        for e in range(tid, n_exp, bs):                                  # segments' first places inside the expert
            run = 0
            for w in range(nseg):
                c = int32(seg[w, e])
                seg[w, e] = run
                run += c
            cnt[e], inc[e], iinc[e] = run, run, (run + cap - 1) // cap
        cuda.syncthreads()
        _scan_shared(inc, n_exp)
        _scan_shared(iinc, n_exp)
        if warp < nseg:                                                  # place the slots, in order
            for c in range(s0, s1, 32):
                e = _held(idx, c + lane, ns, top_k, e0, n_exp)
                rank, same = match_rank(e)
                if e >= 0:
                    sorted_slot[inc[e] - cnt[e] + int32(seg[warp, e]) + rank] = c + lane
                syncwarp()
                if e >= 0 and rank == 0:
                    seg[warp, e] += same
                syncwarp()
        for e in range(tid, n_exp, bs):
            c, first = cnt[e], inc[e] - cnt[e]
            it = iinc[e] - (c + cap - 1) // cap
            for q in range(0, c, cap):
                item_e[it] = e
                item_start[it] = first + q
                item_len[it] = min(cap, c - q)
                it += 1
        if tid == 0:
            n_items[0] = iinc[n_exp - 1]
    return plan


# ----------------------------------------------------------------------------------------------------- experts
@device
def _perm8(i):
    """Position of column i in the INT4 activation order (0,4,1,5,2,6,3,7 inside each 8 columns)."""
    return (i & ~7) | ((i & 3) << 1) | ((i >> 2) & 1)


def _build_bulk_ring(T, R, S, U):
    """Device functions (start, consume) of the INT4 expert GEMM over the bulk layout (`int4_bulk_tiles`). Each warp
    streams its R row tiles' chunks through an S-slot ring in dynamic shared memory, U k-steps (U chunks of
    R*BULK_WORDS words, contiguous) per slot, each slot filled by ONE cp.async.bulk issued by lane 0 and completed
    on the slot's mbarrier (kernels/bulk.py). The ring runs over the block's whole sequence of units (stage f =
    the (f % nst)-th of the warp's nst stages of the block's (f // nst)-th unit): all S slots stay in flight, also
    across a unit's end, so the next unit's first weights arrive while this one finishes. No register holds a
    load in flight. The lanes read back the register path's words and scales and run the same `build_int4_mma`:
    the same bits. geo: i32 local [GEO], indexed by the G_* names."""
    int4_mma = cached(build_int4_mma, T, R, 1, 4)
    CH = R * BULK_WORDS                  # words per k-step
    SLOT, NQ = U * CH, 8 * R

    @device
    def locate(item_e, geo, prod):
        """prod[2], prod[3] = expert and word offset (at k-step s0) of the chunk run of unit prod[0], if any."""
        unit = prod[0]
        if unit < geo[G_UNITS]:
            prod[2] = item_e[unit // geo[G_RBLOCKS]]
            group = min((unit % geo[G_RBLOCKS]) * geo[G_NWR] + geo[G_WR], geo[G_GROUPS] - 1)
            prod[3] = (group * geo[G_KSTEPS] + geo[G_S0]) * CH

    @device
    def issue(ring, bars, w, item_e, geo, prod, f):
        """Lane 0: stage f (= stage prod[1] of unit prod[0]) into slot f % S, then step prod on (the divisions
        only when it moves to the next unit); nothing past the block's last unit."""
        if prod[0] < geo[G_UNITS]:
            sa = prod[1] * U
            nbytes = min(U, geo[G_S1] - geo[G_S0] - sa) * CH * 4
            slot = f % S
            mbar_expect(bars, geo[G_BAR] + slot, nbytes)
            bulk_load(ring, geo[G_RING] + slot * SLOT, w[prod[2]], prod[3] + sa * CH, nbytes, bars,
                      geo[G_BAR] + slot)
            prod[1] += 1
            if prod[1] == geo[G_NST]:
                prod[0] += geo[G_STRIDE]
                prod[1] = 0
                locate(item_e, geo, prod)

    @device
    def start(bars, ring, w, item_e, geo, prod, lane):
        """Once per kernel: the warp's barriers, then its first S stages in flight. A warp whose k range is empty
        (k-steps < warps along k, e.g. H = 128 with WK = 2) has no stage: it issues nothing (a zero-byte bulk copy
        faults) and consumes nothing."""
        if lane == 0:
            for p in range(S):
                mbar_init(bars, geo[G_BAR] + p)
            mbar_fence_init()
            prod[0], prod[1] = geo[G_UNIT0], 0
            locate(item_e, geo, prod)
            for f in range(S if geo[G_NST] > 0 else 0):
                issue(ring, bars, w, item_e, geo, prod, f)
        syncwarp()

    @device
    def consume(bars, ring, w, item_e, geo, prod, f0, xb, t, half, boff, acc, lane):
        """The nst stages f0 .. f0+nst-1 (one unit): wait, read, mma; each slot refilled with stage f + S."""
        qa = cuda.local.array(NQ, uint32)
        sa = cuda.local.array(NQ, float32)
        for i in range(geo[G_NST]):
            f = f0 + i
            slot = f % S
            mbar_wait(bars, geo[G_BAR] + slot, (f // S) & 1)
            for u in range(U):
                s = geo[G_S0] + i * U + u
                if s < geo[G_S1]:
                    base = geo[G_RING] + slot * SLOT + u * CH
                    for r in range(R):
                        for h in range(2):
                            q0, q1, q2, q3 = lds16(ring, base + r * BULK_WORDS + h * 128 + lane * 4)
                            k = (2 * r + h) * 4
                            qa[k], qa[k + 1], qa[k + 2], qa[k + 3] = q0, q1, q2, q3
                        c0, c1, c2, c3 = lds16(ring, base + r * BULK_WORDS + 256 + (lane // 4) * 4)
                        k = 2 * r * 4
                        sa[k], sa[k + 1], sa[k + 2], sa[k + 3] = bf16_lo(c0), bf16_hi(c0), bf16_lo(c1), bf16_hi(c1)
                        sa[k + 4], sa[k + 5], sa[k + 6], sa[k + 7] = (bf16_lo(c2), bf16_hi(c2), bf16_lo(c3),
                                                                      bf16_hi(c3))
                    int4_mma(qa, sa, xb, s, t, half, boff, acc)
            syncwarp()                                  # every lane has read the slot: refill it
            if lane == 0:
                issue(ring, bars, w, item_e, geo, prod, f + S)
    return start, consume


STAMP_UNITS = 6      # units per block whose points are kept (later units are counted, not stamped)
STAMP_WORDS = 4 + 6 * STAMP_UNITS   # entry (cycles, ns), SM, units run; per unit 3 points x (cycles, ns)


@device
def _stamp(stamps, u, k):
    """Thread 0 writes point k of its block's timeline: k = 0 entry (words 0, 1, and the SM at 2), else point k of
    unit u (1 start, 2 main loop done, 3 unit done) at words 4 + 6u + 2(k-1), as (SM cycles, global ns) low halves."""
    if cuda.threadIdx.x == 0:
        if k == 0:
            stamps[cuda.blockIdx.x, 2] = int32(stamp_point(stamps, cuda.blockIdx.x, 0))
        elif u < STAMP_UNITS:
            stamp_point(stamps, cuda.blockIdx.x, 4 + 6 * u + 2 * (k - 1))


def bulk_ring_bytes(cfg):
    """Dynamic shared bytes of a block's bulk rings (ExpertConfig with S > 0)."""
    return 4 * cfg.WR * cfg.WK * cfg.S * cfg.U * cfg.R * BULK_WORDS


def _build_expert_gemm(fmt, down, T, R, G, U, perm_out, PF=0, bounds=None, S=0, STAMPS=False):
    """One expert GEMM stage over the work items (persistent grid). down=0: gate_up with rows interleaved per tile
    (8 gate rows, then the matching 8 up rows) and silu(gate) * up written as the next B operand (act);
    down=1: rows in order, output * routing weight written per slot (y). S > 0: INT4 weights in the bulk layout
    through S-slot bulk-copy rings (`_build_bulk_ring`; w is then u32 [E, words of one expert]).
    STAMPS (measurement, ExpertConfig.stamps): thread 0 writes its block's timeline into stamps (`_stamp`)."""
    mainloop = cached(build_mainloop, fmt, T, R, 1, G, U, PF)
    ring_start, ring_consume = cached(_build_bulk_ring, T, R, S, U) if S else (None, None)
    NBAR = MAX_WARPS * max(S, 1)
    block_reduce = cached(build_block_reduce, R, T)
    NACC, NA = R * T * 4, 2 * R
    KSTEP = 32 * G if fmt == INT4 else 32
    WDIV = 8 if fmt == INT4 else 2

    @kernel(**({"launch_bounds": bounds} if bounds else {}))
    def expert_gemm(xb, w, sc, act16, y, wts, sorted_slot, item_e, item_start, item_len, n_items, top_k, nrows, kdim,
                    nwr, nwk, stamps):
        """Launch: grid = fixed (persistent), block 32*nwr*nwk (<= 256); each block loops over (item, row block) units.
        xb u32 flat [rows, k/2]; w u32 [E, nrows*k/WDIV]; sc u16 [E, nrows*k/32] (int4);
        act16 u16 flat [slots, nrows/2] (down=0); y f32[slots, nrows] (down=1); stamps i32 [grid, STAMP_WORDS]
        (STAMPS only; else not touched). Moves the weights (and scales) of every live expert once per item."""
        grid_dep()
        if STAMPS:
            _stamp(stamps, 0, 0)
        lane = lane_id()
        g, t = lane // 4, lane % 4
        warp = cuda.threadIdx.x // 32
        wr, wk = warp % nwr, warp // nwr
        half = kdim // 2
        ntiles = nrows // 16
        rblocks = (ntiles + nwr * R - 1) // (nwr * R)
        s0, s1 = split_range(wk, nwk, kdim // KSTEP)
        aoff = cuda.local.array(NA, int32)
        soff = cuda.local.array(NA, int32)
        boff = cuda.local.array(T, int32)
        acc = cuda.local.array(NACC, float32)
        total = n_items[0] * rblocks
        if S:                                       # the warp's bulk ring over all of this block's units
            ring = cuda.shared.array(0, uint32)
            bars = cuda.shared.array(NBAR, uint64)
            geo = cuda.local.array(GEO, int32)
            geo[G_UNIT0], geo[G_STRIDE], geo[G_UNITS] = cuda.blockIdx.x, cuda.gridDim.x, total
            geo[G_RBLOCKS] = rblocks
            geo[G_NWR], geo[G_WR], geo[G_GROUPS], geo[G_KSTEPS] = nwr, wr, ntiles // R, kdim // KSTEP
            geo[G_S0], geo[G_S1], geo[G_NST] = s0, s1, (s1 - s0 + U - 1) // U
            geo[G_RING], geo[G_BAR] = warp * S * U * R * BULK_WORDS, warp * S
            prod = cuda.local.array(4, int32)      # lane 0's producer: unit, stage, expert, word offset
            ring_start(bars, ring, w, item_e, geo, prod, lane)
        f0 = 0
        nu = 0                                      # (STAMPS) units this block ran
        for unit in range(cuda.blockIdx.x, total, cuda.gridDim.x):
            if STAMPS:
                _stamp(stamps, nu, 1)
            it, rb = unit // rblocks, unit % rblocks
            e, start, ln = item_e[it], item_start[it], item_len[it]
            tile0 = (rb * nwr + wr) * R
            for r in range(R):
                p = min(tile0 + r, ntiles - 1)
                if down:
                    rg, rg8 = p * 16 + g, p * 16 + 8 + g
                else:
                    rg, rg8 = p * 8 + g, nrows // 2 + p * 8 + g
                aoff[2 * r], aoff[2 * r + 1] = rg * (kdim // WDIV), rg8 * (kdim // WDIV)
                soff[2 * r], soff[2 * r + 1] = rg * (kdim // 32), rg8 * (kdim // 32)
            for tt in range(T):
                c = min(tt * 8 + g, ln - 1)
                src = start + c if down else sorted_slot[start + c] // top_k
                boff[tt] = src * half
            for i in range(NACC):
                acc[i] = F0
            if S:
                ring_consume(bars, ring, w, item_e, geo, prod, f0, xb, t, half, boff, acc, lane)
                f0 += geo[G_NST]
            else:
                mainloop(w[e], sc[e], xb, s0, s1, t, half, aoff, soff, boff, acc)
            if STAMPS:
                _stamp(stamps, nu, 2)
            block_reduce(acc, wr, wk, nwr, nwk, lane)
            if wk == 0:
                for r in range(R):
                    if tile0 + r < ntiles:
                        for tt in range(T):
                            i = (r * T + tt) * 4
                            for e2 in range(2):
                                col = tt * 8 + 2 * t + e2
                                if col < ln:
                                    if down:
                                        slot = sorted_slot[start + col]
                                        wt = wts[slot // top_k, slot % top_k]
                                        y[slot, (tile0 + r) * 16 + g] = acc[i + e2] * wt
                                        y[slot, (tile0 + r) * 16 + 8 + g] = acc[i + 2 + e2] * wt
                                    else:
                                        gate, up = acc[i + e2], acc[i + 2 + e2]
                                        h = gate / (F1 + math.exp(-gate)) * up
                                        inter = nrows // 2
                                        j = (tile0 + r) * 8 + g
                                        if perm_out:
                                            j = _perm8(j)
                                        base = (start + col) * inter + j
                                        hb = pack_bf16x2(h, F0)
                                        act16[base] = hb & 0xFFFF
            if STAMPS:
                _stamp(stamps, nu, 3)
            nu += 1
        if STAMPS and cuda.threadIdx.x == 0:
            stamps[cuda.blockIdx.x, 3] = nu
    return expert_gemm


def _build_combine(TK):
    @kernel()
    def combine(y, shared, out, eidx, e0, n_exp, n, hdim, has_shared):
        """out[t, h] = sum over j (in order) of y[t*k + j, h] for the slots whose expert eidx[t, j] is held here
        (e0 <= e < e0 + n_exp) (+ shared[t, h]); k = TK (= top_k, compiled in). The TK expert ids, then the TK
        values, are loaded before any is used (two rounds of loads in flight, not a chain of 2 TK); slots of other
        devices add nothing (selected away, so whatever their rows hold). Launch: grid ceil(n*H/256), 256.
        Moves n*k*H*4 bytes of expert rows (those of held experts), n*H*4 of shared and of out, n*k*4 of ids."""
        grid_dep()
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i >= n * hdim:
            return
        tok, h = i // hdim, i % hdim
        live = cuda.local.array(TK, int32)
        vals = cuda.local.array(TK, float32)
        for j in range(TK):
            e = eidx[tok, j] - e0
            live[j] = int32(e >= 0 and e < n_exp)
        for j in range(TK):
            vals[j] = y[tok * TK + j, h]
        v = F0
        for j in range(TK):
            if live[j]:
                v += vals[j]
        if has_shared:
            v += shared[tok, h]
        out[tok, h] = v
    return combine


@dataclass(frozen=True)
class ExpertConfig:
    """Cut of one expert stage: R row tiles per warp, WR x WK warps per block (WK splits k), U steps in flight,
    T token tiles per item (items carry <= 8*T slots), blocks of the persistent grid per SM."""
    R: int = 2
    WR: int = 4
    WK: int = 2
    U: int = 2
    T: int = 1
    blocks_per_sm: int = 4
    PF: int = 1           # weight loads with an L2 256-byte prefetch hint (measured: +5-6 points)
    min_blocks: int = 0   # > 0: launch bounds asking ptxas to fit that many blocks per SM (caps registers)
    S: int = 0            # > 0 (gate_up only): bulk-copy rings of S slots of U k-steps (gate_up in the bulk layout,
    #                       DeviceExperts.tiled = R)
    stamps: bool = False  # measurement only: the stage compiled with a block timeline into ws.stamps (`_stamp`,
    #                       tools/moe_stamps.py); default PTX unchanged


# 4-warp blocks capped at 128 registers (min_blocks=4) so 4 fit per SM (16 warps): H200, 71% of copy against 47%
# uncapped (144 registers, 8-warp blocks: 8 warps per SM, latency-bound). blocks_per_sm=8: the persistent grid is two
# waves of such blocks; one wave (4) measured lower at n = 4-17 (the whole MoE chained at n = 17: 78.5% of copy
# against 81.3; n = 1 within 0.6 points)
GATE_UP_CFG = ExpertConfig(WR=2, WK=2, blocks_per_sm=8, min_blocks=4)
DOWN_CFG = ExpertConfig(WR=4, WK=1, blocks_per_sm=8, min_blocks=4)
# gate_up through bulk-copy rings of 2 slots x 2 k-steps (gate_up in the int4_bulk_tiles layout with R =
# MoeConfig.tiled row tiles per chunk; its measurement there), down on the register path. H200, % of copy at n = 1 /
# 4 / 9 / 17 / 33 (python -m tools.bench_kernels --only moe): down through the same rings lost (44 / 52 / 59 / 61 / 63
# against 51 / 67 / 71 / 76 / 73), so it stays on the register path.
BULK_GATE_UP_CFG = ExpertConfig(WR=2, WK=2, U=2, S=2, blocks_per_sm=8, min_blocks=4)


def _sm_count():
    return 1 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT


def default_cuts(tiled):
    """(gate_up, down) cuts the engine uses for gate_up in the bulk layout (tiled = R > 0) or in rows (0)."""
    return (BULK_GATE_UP_CFG if tiled else GATE_UP_CFG), DOWN_CFG


def token_tiles(n, top_k, n_exp, most):
    """Token tiles per work item for n tokens: the fewest (a power of two, <= most) whose 8 * T slots hold an
    expert's mean share of the n * top_k slots, so each expert's weights are dequantized once per item, not once
    per 8 slots."""
    t = 1
    while t < most and 8 * t * n_exp < n * top_k:
        t *= 2
    return t


def stage_cuts(experts, n, top_k, cfg: MoeConfig = MOE_DEFAULT):
    """(gate_up, down) cuts of the experts' layout for n tokens, T = token_tiles (the plan's items follow it). T > 1
    takes 2 blocks per SM (up to 255 registers): at the default's 4 (128 registers) T = 2 spills 168-232 bytes, at 2
    it fits (243-246 registers; ptxas sm_90a)."""
    gate_up, down = default_cuts(experts.tiled)
    t = token_tiles(n, top_k, moe_dims(experts)[1], cfg.token_tiles)
    if t == 1:
        return gate_up, down
    return (replace(gate_up, T=t, min_blocks=2, blocks_per_sm=4), replace(down, T=t, min_blocks=2, blocks_per_sm=4))


def _cfgs(experts, cfg_gate_up, cfg_down):
    """The stage cuts: the given ones, else the defaults of the experts' layout (register path or bulk rings)."""
    gate_up, down = default_cuts(experts.tiled)
    return cfg_gate_up or gate_up, cfg_down or down


def moe(x, idx, wts, experts: DeviceExperts, out, ws: MoeWorkspace, shared=None, cfg_gate_up=None, cfg_down=None):
    """GPU moe_ref: out f32[n, H] = sum_j wts[t, j] * E_idx[t, j](x[t]) (+ shared[t] when given).
    Launches: plan with the B prep of x, gate_up (+SiLU-mul), down (* routing weight), combine. Only live experts'
    weights are read; grids are fixed by the workspace size so the sequence can be graph-captured. The activations
    enter the mma as bf16 (W4A16)."""
    moe_experts(x, idx, wts, experts, ws, cfg_gate_up, cfg_down)
    moe_combine(out, shared, ws, idx, experts)
    return out


def moe_experts(x, idx, wts, experts: DeviceExperts, ws: MoeWorkspace, cfg_gate_up=None, cfg_down=None):
    """Everything of `moe` before the combine: plan (with the B prep), gate_up, down -> ws.y f32[n*k, H], each
    slot's expert output times its routing weight. Cuts None: the defaults of the experts' layout."""
    cfg_gate_up, cfg_down = _cfgs(experts, cfg_gate_up, cfg_down)
    moe_plan(x, idx, experts, ws, cfg_gate_up, cfg_down)
    moe_stage(0, experts, wts, ws, cfg_gate_up)
    moe_stage(1, experts, wts, ws, cfg_down)


def moe_dims(experts):
    """(fmt, E, H, I) of a DeviceExperts."""
    if experts.tiled:
        n_exp, groups, ksteps, _ = experts.gate_up.shape
        return INT4, n_exp, ksteps * 128, groups * 8 * experts.tiled
    n_exp, two_i, h_words = experts.gate_up.shape
    fmt = INT4 if experts.int4 else BF16
    return fmt, n_exp, h_words * (8 if fmt == INT4 else 1), two_i // 2


def moe_plan(x, idx, experts, ws, cfg_gate_up=None, cfg_down=None):
    """Checks, then the routing plan and the B operand of gate_up (one launch: the plan's block beside the prep's)."""
    cfg_gate_up, cfg_down = _cfgs(experts, cfg_gate_up, cfg_down)
    n, h = x.shape
    k = idx.shape[1]
    fmt, n_exp, hidden, inter = moe_dims(experts)
    if n > ws.n_max or k != ws.top_k or n * k > MAX_SLOTS or n_exp > MAX_E:
        raise ValueError(f"moe: n={n}, top_k={k}, E={n_exp} outside the workspace (n_max {ws.n_max}, "
                         f"top_k {ws.top_k}) or the plan limits ({MAX_SLOTS} slots, {MAX_E} experts)")
    if h != hidden or h % 64 or inter % 64 or idx.shape != (n, k):
        raise ValueError(f"moe: x {x.shape} vs experts H={hidden}, I={inter} (multiples of 64), idx {idx.shape}")
    if cfg_down.T != cfg_gate_up.T or max(c.WR * c.WK for c in (cfg_gate_up, cfg_down)) > MAX_WARPS:
        raise ValueError(f"moe: configs {cfg_gate_up}, {cfg_down}: same T, <= {MAX_WARPS} warps per block")
    plan_threads = 32 * math.ceil(n_exp / 32) if SIM else 1024   # simulator: a Python thread per CUDA thread
    grid = 1 + n * math.ceil(h / 8 / plan_threads)
    plan = cached(_build_plan, int(fmt == INT4), min(PLAN_WARP_SLOTS, 32))     # a warp holds 32 slots
    launch(plan, grid, plan_threads, idx, int32(n), int32(k), int32(experts.offset), int32(n_exp),
           int32(8 * cfg_gate_up.T), ws.sorted_slot, ws.item_e, ws.item_start, ws.item_len, ws.n_items, x, ws.xb,
           int32(h))


def moe_stage(down, experts, wts, ws, cfg=None):
    """One expert GEMM over the live work items: gate_up (down=0: x -> act) or down (down=1: act -> y)."""
    cfg = cfg or _cfgs(experts, None, None)[down]
    fmt, n_exp, hidden, inter = moe_dims(experts)
    tiled = 0 if down else experts.tiled
    if bool(cfg.S) != bool(tiled) or (cfg.S and cfg.R != tiled):
        raise ValueError(f"moe: cut {cfg} does not fit the {'down' if down else 'gate_up'} layout (tiled={tiled}: "
                         f"bulk rings S > 0 with R = tiled, or the register path S = 0 on int4_tiles rows)")
    w, sc = (experts.down, experts.down_scale) if down else (experts.gate_up, experts.gate_up_scale)
    nrows, kdim = (hidden, inter) if down else (2 * inter, hidden)
    if wts.shape[1] != ws.top_k or wts.shape[0] > ws.n_max:
        raise ValueError(f"moe: wts {wts.shape} is not [n <= {ws.n_max}, {ws.top_k}]")
    g = int4_group_block(kdim) if fmt == INT4 else 1
    bounds = (32 * cfg.WR * cfg.WK, cfg.min_blocks) if cfg.min_blocks else None
    kern = cached(_build_expert_gemm, fmt, down, cfg.T, cfg.R, g, cfg.U, int(fmt == INT4), cfg.PF, bounds,
                   cfg.S, cfg.stamps)
    rblocks = math.ceil(nrows / 16 / (cfg.WR * cfg.R))
    grid = min(ws.n_max * ws.top_k * rblocks, _sm_count() * cfg.blocks_per_sm)
    if cfg.stamps and (ws.stamps is None or ws.stamps.shape[0] < grid or ws.stamps.shape[1] < STAMP_WORDS):
        raise ValueError(f"moe: ExpertConfig.stamps needs ws.stamps of [>= {grid} blocks, >= {STAMP_WORDS}] int32, not "
                         f"{None if ws.stamps is None else ws.stamps.shape} (tools/moe_stamps.py)")
    words = u32_words(w)
    e_words = words.reshape(n_exp, words.size // n_exp)
    e_sc = sc.reshape(n_exp, sc.size // n_exp) if sc is not None else e_words
    launch_smem(kern, grid, 32 * cfg.WR * cfg.WK, bulk_ring_bytes(cfg) if cfg.S else 0,
                (ws.act if down else ws.xb, e_words, e_sc, ws.act.view(np.uint16), ws.y, wts, ws.sorted_slot,
                 ws.item_e, ws.item_start, ws.item_len, ws.n_items, int32(ws.top_k), int32(nrows), int32(kdim),
                 int32(cfg.WR), int32(cfg.WK), ws.stamps))


def moe_combine(out, shared, ws, idx, experts):
    """out[t] = sum over the token's slots on experts held here of y (+ shared[t])."""
    h, n = ws.y.shape[1], idx.shape[0]
    if out.shape != (n, h) or (shared is not None and shared.shape != (n, h)):
        raise ValueError(f"moe: out {out.shape} / shared {None if shared is None else shared.shape} not [{n}, {h}]")
    if idx.shape[1] != ws.top_k:
        raise ValueError(f"moe: idx {idx.shape} is not [n, {ws.top_k}] (the workspace's top_k)")
    launch(cached(_build_combine, ws.top_k), math.ceil(n * h / 256), 256, ws.y,
           shared if shared is not None else out, out, idx, int32(experts.offset), int32(moe_dims(experts)[1]),
           int32(n), int32(h), int32(shared is not None))
