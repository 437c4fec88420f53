"""Dense GEMM on bf16 weights: out = x @ W^T, W stored [n, k] as bf16 bits (the checkpoint layout).

GPU path, for small m (1..~65 rows): tensor-core mma.sync m16n8k16 (bf16 in, f32 accumulate) through inline PTX,
also used by the INT4 experts of kernels/moe.py.
Operand roles: weights are A (a tile = 16 output features), activations are B (a tile = 8 tokens), so
out^T = W @ x^T and a 1-token GEMV wastes only B's columns.
A fragments from 16-byte loads: the k order inside a dot product is free as long as A and B use the same one. Lane
(g = lane/4, t = lane%4) loads one 16-byte chunk from weight row g and one from row g+8 per step:
  bf16 weights (checkpoint layout): cols 32s + 8t .. +8 of step s -> two mma k16 steps, pairs in natural order.
  INT4 weights (word-transposed layout, kernels/moe.py `int4_tiles`): one word per 32-column group, group j of the
      step -> the lane's 8 nibbles at cols 32j + 8t + i; nibbles (i, i+4) form one bf16 pair, so the activations
      come in the order (0,4,1,5,2,6,3,7) inside every 8 columns. Each mma then stays inside one scale group, and
      the group scale multiplies the f32 result (weights exact: u - 8 is a small integer in bf16).
B operand: activations as bf16 bits, XS = 1 (bf16 rounding of the activations, W16A16 / W4A16 style: the default,
as in a bf16 forward) or XS = 2 (hi + lo bf16 parts: x to ~16 bits, two mma per step, ~1e-5 from the f32 reference:
the router's logits, MLA's per-head products). Either read from x (f32) and
converted in registers (dense, BF=1) or prepared once by `prep_b` as xb u32 [rows, XS, k/2].
Every token column is computed on its own and the k order depends only on (n, k) through the split: results are
batch invariant (a token's output does not change with the number of tokens in the call).
k-split partials are added in split order, by a reduce launch or (GemmConfig.FR with ws.sync counters) by the last
block of each row range inside the GEMM: the same sums either way.
head_gemm: MLA's per-head products (x f32[n, h, a] strided views @ bf16 w[h, b, a]^T) on the same warp step, heads
on grid z and 8T-token chunks on grid y: one launch instead of one GEMM per head.
"""
import math
from dataclasses import dataclass, replace

from numba import cuda, float32, int32, uint32

from numbaengine.kernels.device import (
    F0,
    SIM,
    as_f32,
    bf16_hi,
    bf16_lo,
    cp_commit,
    cp_wait,
    device,
    grid_dep,
    int4_pair,
    lane_id,
    ld4,
    ld4_l2,
    ld8,
    ld16,
    ld16_pf,
    mma_bf16,
    pack_bf16x2,
    split_bf16x2,
)
from numbaengine.kernels.gemm_wg import WG_GEMM_DEFAULT, gemm_wg, gemm_wg_applies
from numbaengine.kernels.launch import (
    cached,
    contiguous,
    data_ptr,
    flat_span,
    kernel,
    launch,
    launch_smem,
    u32_words,
)
from numbaengine.kernels.prep import (
    RING_CHUNK,
    prep_b,
)
from numbaengine.kernels.prep import xb_words as wg_xb_words

# ------------------------------------------------------------------------------- cp.async ring (weights -> shared)
if SIM:
    def cp_async16(ring, ri, w, wi):
        """Simulator: the 16 bytes land at once."""
        ring[ri], ring[ri + 1], ring[ri + 2], ring[ri + 3] = ld16(w, wi)

    def lds16(ring, ri):
        return ring[ri], ring[ri + 1], ring[ri + 2], ring[ri + 3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import element_address

    _SHARED32 = "{ .reg .u64 sa64; .reg .u32 sa; cvta.to.shared.u64 sa64, $%d; cvt.u32.u64 sa, sa64; "

    @intrinsic
    def cp_async16(typingctx, ring, ri, w, wi):
        """cp.async.cg of 16 bytes (L2 asked for the surrounding 256): word wi of the contiguous global u32 array w
        -> word ri of the shared u32 array ring (both 16-byte aligned)."""
        sig = types.void(ring, ri, w, wi)

        def codegen(ctx, b, sig, args):
            sa = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
            ga = element_address(ctx, b, sig.args[2], args[2], args[3], sig.args[3])
            i64 = ir.IntType(64)
            asm = (_SHARED32 % 0 + ".reg .u64 ga; cvta.to.global.u64 ga, $1; "
                   "cp.async.cg.shared.global.L2::256B [sa], [ga], 16; }")
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64, i64]), asm, "l,l,~{memory}",
                                side_effect=True), [sa, ga])
        return sig, codegen

    @intrinsic
    def lds16(typingctx, ring, ri):
        """Four u32 words at word ri of a shared u32 array: one ld.shared.v4 (ordered after the cp.async waits)."""
        sig = types.UniTuple(types.uint32, 4)(ring, ri)

        def codegen(ctx, b, sig, args):
            sa = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
            i32 = ir.IntType(32)
            fn = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
            asm = _SHARED32 % 4 + "ld.shared.v4.u32 {$0,$1,$2,$3}, [sa]; }"
            r = b.call(ir.InlineAsm(fn, asm, "=r,=r,=r,=r,l,~{memory}", side_effect=True), [sa])
            return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, k) for k in range(4)])
        return sig, codegen


BF16, INT4 = 0, 1
XS_DEFAULT = 1      # GEMMs on large weights take bf16 activations (1), not hi + lo bf16 parts (2). H200, K2 shapes,
#   % of copy at m = 17 / 33: lm_head 74.7 / 68.7 against 65.4 / 41.9 with hi + lo parts (every projection gained
#   3-27 points; tools/bench_kernels.py --only gemm)
SMALL_XS = 2        # small weights (launch-bound, gemm_config) keep hi + lo parts: the more exact form costs no time
#   there, and with bf16 activations the tiny test pair's prefill logits moved 1.1e-2 of their max from the float32
#   reference (H200, tests/test_backend_sim.py; the tolerance is 1e-2, hi + lo measured 1e-3 .. 3e-3)
HEAD_XS = 2         # head_gemm (MLA's W_UK / W_UV products): hi + lo parts (bf16 activations not measured there)


# ---------------------------------------------------------------------------------------------------------- B prep


# ------------------------------------------------------------------------------------------------ the warp step
def _build_bf16_mma(T, R, XS, BF):
    """Device function: the mma work of one bf16 k-step on weight fragments already in registers.
    qa u32[8R]: qa[4h .. 4h+3] = the lane's 16 bytes of row g (h = 2r) or g+8 (h = 2r+1) of row tile r, columns
    32s + 8t .. +8. B read as in `_build_step`, or (BF=2) from the tiled layout of `prep_b`: the lane's B words of
    (step s, tile tt, part p) at boff[tt] + s*T*XS*128 + p*128 (one warp load = 512 contiguous bytes), or (BF=3) the
    same fragments from a shared ring slot at boff[tt] + p*128."""
    SSTR = T * XS * RING_CHUNK

    @device
    def mma_step(qa, xb, s, t, half, boff, acc):
        xw = cuda.local.array(8, uint32)
        for tt in range(T):
            if BF == 1:
                f0, f1, f2, f3 = ld16(xb, boff[tt] + s * 32 + t * 8)
                f4, f5, f6, f7 = ld16(xb, boff[tt] + s * 32 + t * 8 + 4)
                if XS == 2:
                    xw[0], xw[4] = split_bf16x2(as_f32(f0), as_f32(f1))
                    xw[1], xw[5] = split_bf16x2(as_f32(f2), as_f32(f3))
                    xw[2], xw[6] = split_bf16x2(as_f32(f4), as_f32(f5))
                    xw[3], xw[7] = split_bf16x2(as_f32(f6), as_f32(f7))
                else:
                    xw[0], xw[1] = pack_bf16x2(as_f32(f0), as_f32(f1)), pack_bf16x2(as_f32(f2), as_f32(f3))
                    xw[2], xw[3] = pack_bf16x2(as_f32(f4), as_f32(f5)), pack_bf16x2(as_f32(f6), as_f32(f7))
            for p in range(XS):
                if BF == 1:
                    x0, x1, x2, x3 = xw[4 * p], xw[4 * p + 1], xw[4 * p + 2], xw[4 * p + 3]
                elif BF == 2:
                    x0, x1, x2, x3 = ld16(xb, boff[tt] + s * SSTR + p * RING_CHUNK)
                elif BF == 3:
                    x0, x1, x2, x3 = lds16(xb, boff[tt] + p * RING_CHUNK)
                else:
                    x0, x1, x2, x3 = ld16(xb, boff[tt] + p * half + s * 16 + t * 4)
                for r in range(R):
                    i = (r * T + tt) * 4
                    c0, c1, c2, c3 = mma_bf16(qa[8 * r], qa[8 * r + 4], qa[8 * r + 1], qa[8 * r + 5], x0, x1,
                                              acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
                    c0, c1, c2, c3 = mma_bf16(qa[8 * r + 2], qa[8 * r + 6], qa[8 * r + 3], qa[8 * r + 7], x2, x3,
                                              c0, c1, c2, c3)
                    acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = c0, c1, c2, c3
    return mma_step


def build_int4_mma(T, R, XS, G):
    """Device function: the tensor-core work of one INT4 k-step (32*G columns) of one warp: qa u32[2R*G] the lane's
    weight words (index h*G + j: row half h = 2r (row g) / 2r+1 (row g+8) of row tile r, scale group j), sa f32[2R*G]
    their group scales; B from xb at boff[tt] as in `_build_step`. Shared by the register path and moe.py's bulk
    rings (the same arithmetic, so the same bits)."""
    NDA, ND = 8 * R, 4 * R

    @device
    def int4_mma(qa, sa, xb, s, t, half, boff, acc):
        for j in range(G):
            da = cuda.local.array(NDA, uint32)
            for r in range(R):
                for hh in range(2):
                    q = qa[(2 * r + hh) * G + j]
                    for sh in range(4):
                        da[8 * r + 4 * hh + sh] = int4_pair(q, 4 * sh)
            for tt in range(T):
                d = cuda.local.array(ND, float32)
                for i in range(4 * R):
                    d[i] = F0
                for p in range(XS):
                    x0, x1, x2, x3 = ld16(xb, boff[tt] + p * half + (s * G + j) * 16 + t * 4)
                    for r in range(R):
                        c0, c1, c2, c3 = mma_bf16(da[8 * r], da[8 * r + 4], da[8 * r + 1], da[8 * r + 5], x0, x1,
                                                  d[4 * r], d[4 * r + 1], d[4 * r + 2], d[4 * r + 3])
                        d[4 * r], d[4 * r + 1], d[4 * r + 2], d[4 * r + 3] = mma_bf16(
                            da[8 * r + 2], da[8 * r + 6], da[8 * r + 3], da[8 * r + 7], x2, x3, c0, c1, c2, c3)
                for r in range(R):
                    i = (r * T + tt) * 4
                    sg, sg8 = sa[2 * r * G + j], sa[(2 * r + 1) * G + j]
                    acc[i] += sg * d[4 * r]
                    acc[i + 1] += sg * d[4 * r + 1]
                    acc[i + 2] += sg8 * d[4 * r + 2]
                    acc[i + 3] += sg8 * d[4 * r + 3]
    return int4_mma


def _build_step(fmt, T, R, XS, G, PF=0, BF=0):
    """Device function: one k-step of one warp over R weight tiles x T token tiles, accumulating into acc.

    bf16: a step is 32 columns; w = uint32 words of bf16 pairs, row r at aoff[r] (words).
    int4: a step is 32*G columns (G groups); w = uint32 words of the word-transposed layout, sc = u16 scales.
    B: xb words [row, XS, k/2] at boff[tt] (BF=0), or x itself as f32 [row, k] at boff[tt] (BF=1, bf16 weights
    only: converted to bf16 hi[/lo] in registers, no prep launch). PF=1: weight loads ask L2 for 256 bytes.
    acc[(r*T + tt)*4 + i]: the mma D fragment of tile (r, tt)."""
    NQ, NQ4 = 8 * R, 2 * R * G
    lda = ld16_pf if PF else ld16
    if fmt == BF16:
        mma_step = cached(_build_bf16_mma, T, R, XS, BF)

        @device
        def step(w, sc, xb, s, t, half, aoff, soff, boff, acc):
            qa = cuda.local.array(NQ, uint32)
            for h in range(2 * R):
                qa[4 * h], qa[4 * h + 1], qa[4 * h + 2], qa[4 * h + 3] = lda(w, aoff[h] + s * 16 + t * 4)
            mma_step(qa, xb, s, t, half, boff, acc)
        return step

    int4_mma = cached(build_int4_mma, T, R, XS, G)

    @device
    def step(w, sc, xb, s, t, half, aoff, soff, boff, acc):
        qa = cuda.local.array(NQ4, uint32)
        sa = cuda.local.array(NQ4, float32)
        for h in range(2 * R):
            if G == 4:
                q0, q1, q2, q3 = lda(w, aoff[h] + s * 16 + t * 4)
                qa[h * G], qa[h * G + 1], qa[h * G + 2], qa[h * G + 3] = q0, q1, q2, q3
                s0, s1 = ld8(sc, soff[h] + s * 4)
                sa[h * G], sa[h * G + 1], sa[h * G + 2], sa[h * G + 3] = (bf16_lo(s0), bf16_hi(s0),
                                                                          bf16_lo(s1), bf16_hi(s1))
            elif G == 2:
                q0, q1 = ld8(w, aoff[h] + s * 8 + t * 2)
                qa[h * G], qa[h * G + 1] = q0, q1
                s0 = ld4(sc, soff[h] + s * 2)
                sa[h * G], sa[h * G + 1] = bf16_lo(s0), bf16_hi(s0)
            else:
                qa[h] = ld4(w, aoff[h] + s * 4 + t)
                sa[h] = bf16_lo(uint32(sc[soff[h] + s]))
        int4_mma(qa, sa, xb, s, t, half, boff, acc)
    return step


def build_mainloop(fmt, T, R, XS, G, U, PF=0, BF=0):
    """Device function: steps [s0, s1) of one warp, U steps per iteration (their loads can be in flight together)."""
    step = cached(_build_step, fmt, T, R, XS, G, PF, BF)

    @device
    def mainloop(w, sc, xb, s0, s1, t, half, aoff, soff, boff, acc):
        s = s0
        while s + U <= s1:
            for u in range(U):
                step(w, sc, xb, s + u, t, half, aoff, soff, boff, acc)
            s += U
        while s < s1:
            step(w, sc, xb, s, t, half, aoff, soff, boff, acc)
            s += 1
    return mainloop


def ring_words(R, S, warps, nb=0):
    """Shared u32 words of the cp.async rings of a block: per warp S stages of 2R weight chunks (+ nb B chunks)."""
    return warps * S * (2 * R + nb) * RING_CHUNK


def _build_ring_mainloop(T, R, XS, S, BF=0, RB=0):
    """Device function: steps [s0, s1) of one warp (bf16 weights) through an S-stage cp.async ring in dynamic
    shared memory: the weights of the next S-1 steps are in flight while the tensor cores work on this one. Each lane
    copies and later reads its own 16-byte chunks (no barrier); warp w owns words [w, w+1) * S*NCH*RING_CHUNK.
    RB=1 (B tiled, BF=2): the step's T*XS B fragments ride in the same ring slot after the 2R weight chunks (every
    global load of a step is then issued S-1 steps ahead). Same signature and arithmetic as `build_mainloop`."""
    mma_step = cached(_build_bf16_mma, T, R, XS, 3 if RB else BF)
    NA, NQ, NB = 2 * R, 8 * R, T * XS * RB
    NCH, SSTR = NA + NB, T * XS * RING_CHUNK
    wait_ring = cp_wait(S - 1)

    @device
    def issue(ring, rb, slot, w, xb, s, t, lane, aoff):
        for h in range(NA):
            cp_async16(ring, rb + (slot * NCH + h) * RING_CHUNK, w, aoff[h] + s * 16 + t * 4)
        for j in range(NB):
            cp_async16(ring, rb + (slot * NCH + NA + j) * RING_CHUNK, xb, s * SSTR + j * RING_CHUNK + lane * 4)

    @device
    def mainloop(w, sc, xb, s0, s1, t, half, aoff, soff, boff, acc):
        ring = cuda.shared.array(0, uint32)
        lane = lane_id()
        rb = (cuda.threadIdx.x // 32) * S * NCH * RING_CHUNK + lane * 4
        qa = cuda.local.array(NQ, uint32)
        bsm = cuda.local.array(T, int32)
        for p in range(S - 1):                      # the ring's first S-1 steps in flight
            if s0 + p < s1:
                issue(ring, rb, p, w, xb, s0 + p, t, lane, aoff)
            cp_commit()
        slot = 0
        for s in range(s0, s1):
            nxt = slot - 1 if slot > 0 else S - 1   # the slot step s-1 used: step s+S-1 goes there
            if s + S - 1 < s1:
                issue(ring, rb, nxt, w, xb, s + S - 1, t, lane, aoff)
            cp_commit()                             # (empty groups past the end keep the count uniform)
            wait_ring()                             # step s has landed
            for h in range(NA):
                qa[4 * h], qa[4 * h + 1], qa[4 * h + 2], qa[4 * h + 3] = lds16(ring, rb + (slot * NCH + h) * RING_CHUNK)
            if RB:
                for tt in range(T):
                    bsm[tt] = rb + (slot * NCH + NA + tt * XS) * RING_CHUNK
                mma_step(qa, ring, s, t, half, bsm, acc)
            else:
                mma_step(qa, xb, s, t, half, boff, acc)
            slot = slot + 1 if slot < S - 1 else 0
    return mainloop


# --------------------------------------------------------------------------------------------------- kernels
@device
def split_range(piece, pieces, steps):
    """Steps [lo, hi) of `piece` when `steps` are cut into `pieces` near-equal parts."""
    return (piece * steps) // pieces, ((piece + 1) * steps) // pieces


MAX_WARPS = 8          # warps per block of the mma kernels (the in-block k-split reduction is sized for it)


def build_block_reduce(R, T, DYN=0):
    """Device function: the wk warps of a block that share row tiles add their acc in order wk = 0..nwk-1; the
    total ends in the wk == 0 warp. All threads of the block must call it. DYN=1: the exchange goes through the
    dynamic shared memory (red_bytes; it may alias the cp.async rings: a barrier first)."""
    NACC = R * T * 4
    NRED = (MAX_WARPS - 1) * NACC * 32

    @device
    def block_reduce(acc, wr, wk, nwr, nwk, lane):
        if nwk > 1:
            if DYN:
                red = cuda.shared.array(0, float32)
                cuda.syncthreads()
            else:
                red = cuda.shared.array(NRED, float32)
            if wk > 0:
                base = ((wk - 1) * nwr + wr) * NACC * 32 + lane
                for i in range(NACC):
                    red[base + i * 32] = acc[i]
            cuda.syncthreads()
            if wk == 0:
                for j in range(1, nwk):
                    base = ((j - 1) * nwr + wr) * NACC * 32 + lane
                    for i in range(NACC):
                        acc[i] += red[base + i * 32]
            cuda.syncthreads()
    return block_reduce


def red_bytes(R, T, WR, WK):
    """Shared bytes of the in-block k-split exchange of `build_block_reduce`."""
    return 4 * (WK - 1) * WR * R * T * 4 * 32


def _build_gemm(T, R, XS, U, PF=0, BF=0, FR=0, bounds=None, S=0, RB=0):
    mainloop = (cached(_build_ring_mainloop, T, R, XS, S, BF, RB) if S
                else cached(build_mainloop, BF16, T, R, XS, 1, U, PF, BF))
    block_reduce = cached(build_block_reduce, R, T, 1)
    NACC, NA = R * T * 4, 2 * R

    @device
    def body(xb, w, out, part, sync, m, n, kdim, nwr, nwk):
        """out f32[m, n] (or part f32[splits, m, n] when gridDim.y > 1) = x @ W^T over this block's k range.
        xb: f32 flat [m, k] (BF=1) or u32 tiled (BF=2, `prep_b` tiled=1); w: u32 flat [n, k/2].
        FR=1 with splits: the last block of a row range to finish (counter sync[blockIdx.x], left at 0) adds the
        splits' partials in order into out (no reduce launch). gridDim.z > 1 (BF=1, S=0, FR=0 only): blocks of 8T
        token rows, so x of any height is one launch (each row block reads the weights again: from L2 when they
        fit). S > 0: weights through per-warp cp.async rings (dynamic shared memory, ring_words(R, S, nwr*nwk)
        words; the in-block k-split exchange reuses it: gemm_smem bytes in all). Launch: grid (ceil(n/16/(nwr*R)),
        splits, row blocks), block 32*nwr*nwk (<= 256). Moves n*k*2 bytes of weights per row block (plus x through
        L1/L2, 2*splits*m*n*4 of partials)."""
        lane = lane_id()
        g, t = lane // 4, lane % 4
        warp = cuda.threadIdx.x // 32
        wr, wk = warp % nwr, warp // nwr
        tile0 = (cuda.blockIdx.x * nwr + wr) * R
        r0 = cuda.blockIdx.z * 8 * T                 # this block's token rows: [r0, r0 + mb)
        mb = min(m - r0, 8 * T)
        sb, nsb = cuda.blockIdx.y, cuda.gridDim.y
        half = kdim // 2
        s0, s1 = split_range(sb * nwk + wk, nsb * nwk, kdim // 32)
        aoff = cuda.local.array(NA, int32)
        boff = cuda.local.array(T, int32)
        acc = cuda.local.array(NACC, float32)
        for r in range(R):
            row = (tile0 + r) * 16 + g
            aoff[2 * r] = min(row, n - 1) * half
            aoff[2 * r + 1] = min(row + 8, n - 1) * half
        for tt in range(T):
            if BF >= 2:
                boff[tt] = tt * XS * RING_CHUNK + lane * 4
            else:
                boff[tt] = (r0 + min(tt * 8 + g, mb - 1)) * (kdim if BF else XS * half)
        for i in range(NACC):
            acc[i] = F0
        mainloop(w, w, xb, s0, s1, t, half, aoff, aoff, boff, acc)
        block_reduce(acc, wr, wk, nwr, nwk, lane)
        if wk == 0:
            for h in range(R):                       # weight tiles: m16 tiles
                for tt in range(T):
                    for e in range(4):
                        i = (h * T + tt) * 4 + e
                        row = (tile0 + h) * 16 + g + 8 * (e // 2)
                        tok = tt * 8 + 2 * t + e % 2
                        if row < n and tok < mb:
                            if nsb == 1:
                                out[r0 + tok, row] = acc[i]
                            else:
                                part[sb, r0 + tok, row] = acc[i]
        if FR and nsb > 1:
            last_split_reduce(part, out, sync, m, n, nwr * R * 16)

    opts = {"launch_bounds": bounds} if bounds else {}
    if FR:
        @kernel(**opts)
        def gemm_k(xb, w, out, part, sync, m, n, kdim, nwr, nwk):
            """body with the splits' reduce fused (FR): the last block of a row range adds them. Launch: grid
            (ceil(n/16/(nwr*R)), splits), block 32*nwr*nwk. Moves n*k*2 bytes of weights, x through L1/L2,
            2*splits*m*n*4 of partials."""
            grid_dep()
            body(xb, w, out, part, sync, m, n, kdim, nwr, nwk)
        return gemm_k

    @kernel(**opts)
    def gemm_k(xb, w, out, part, m, n, kdim, nwr, nwk):
        """body (out = x @ W^T). Launch: grid (ceil(n/16/(nwr*R)), splits, row blocks), block 32*nwr*nwk. Moves
        n*k*2 bytes of weights per row block, x through L1/L2, 2*splits*m*n*4 of partials when split."""
        grid_dep()
        body(xb, w, out, part, w, m, n, kdim, nwr, nwk)
    return gemm_k


@device
def last_split_reduce(part, out, sync, m, n, rows):
    """The last of the gridDim.y blocks of row range blockIdx.x to get here adds part[:, :, range] in split order
    into out (bitwise what reduce_k gives) and resets the counter. Partials are read at L2 (ld.global.cg: the other
    blocks' writes, no stale L1), four splits in flight per element. All threads of the block must call it."""
    last = cuda.shared.array(1, int32)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        last[0] = int32(cuda.atomic.add(sync, cuda.blockIdx.x, uint32(1)) == uint32(cuda.gridDim.y - 1))
    cuda.syncthreads()
    if last[0]:
        cuda.threadfence()
        row0, nsb, plane = cuda.blockIdx.x * rows, cuda.gridDim.y, m * n
        for idx in range(cuda.threadIdx.x, m * rows, cuda.blockDim.x):
            tok, row = idx // rows, row0 + idx % rows
            if row < n:
                i = tok * n + row
                v = as_f32(ld4_l2(part, i))
                s = 1
                while s + 4 <= nsb:
                    p0, p1 = ld4_l2(part, s * plane + i), ld4_l2(part, (s + 1) * plane + i)
                    p2, p3 = ld4_l2(part, (s + 2) * plane + i), ld4_l2(part, (s + 3) * plane + i)
                    v = (((v + as_f32(p0)) + as_f32(p1)) + as_f32(p2)) + as_f32(p3)
                    s += 4
                while s < nsb:
                    v += as_f32(ld4_l2(part, s * plane + i))
                    s += 1
                out[tok, row] = v
        if cuda.threadIdx.x == 0:
            sync[cuda.blockIdx.x] = uint32(0)


def _build_reduce():
    @kernel()
    def reduce_k(part, out, splits, m, n):
        """out[i, j] = sum over s of part[s, i, j], in order. Launch: grid (ceil(m*n/256)), block 256. Moves
        (splits + 1)*m*n*4 bytes."""
        grid_dep()
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if idx >= m * n:
            return
        i, j = idx // n, idx % n
        v = part[0, i, j]
        for s in range(1, splits):
            v += part[s, i, j]
        out[i, j] = v
    return reduce_k


# ---------------------------------------------------------------------------------------------------- launcher
SMEM_MAX = 227 * 1024 - 64     # dynamic shared bytes a block may ask for on sm_90 (less the static bytes)
TILES_MAX = 8      # token tiles (8 rows each) of one GEMM row block; taller x runs as grid-z row blocks
TILES_ONE_BLOCK = 9   # most token tiles one block takes when x cannot run as row blocks (m = 65: the GPU tests)
SMALL_WEIGHTS = 4 << 20    # bytes: below, a GEMM streams its weights in about a launch's time (gemm_config)
RING_STAGES = 4    # cp.async ring depth at one token tile without a k split (lm_head m=1: 89.9% -> 94.2% of copy)
RB_STAGES = 2      # ring depth with the B fragments in the ring (3 to 5 token tiles, see gemm_config); 3 stages:
#                    lm_head m = 17 74.8% of copy against 81.5 (H200, hi + lo activations)
RB_MIN_BYTES = 48 << 20    # weights from which 3-4 token tiles take the B-in-ring cut (5 tiles: always)


TARGET_WARPS = 2112    # warps the k split aims at (16 per SM on the H200's 132). H200, chained % of copy at m = 1 /
#   17 / 33 (tools/bench_kernels.py --only gemm): kv_b 59.2 / 50.0 / 40.9 against 50.2 / 33.8 / 25.8 at 4096 warps
#   (and R=2); 1056 lost on o and shared_gate_up (40 / 41% at m = 1), 8192 everywhere but q_b at m = 1
WG_ROWS = 1024         # x up to this many rows takes the wgmma path where it applies (kernels/gemm_wg.py; its B
#                        operand is x as bf16 in the workspace: taller prompts keep the mma path, which reads f32 x)
R2_MIN_BYTES = 100 << 20   # weights from which 2-3 token tiles take two row tiles per warp (o, lm_head)


@dataclass(frozen=True)
class GemmConfig:
    """How one GEMM is cut. split = WK * SB k-pieces (chosen from n, k only: batch invariance);
    R row tiles per warp and WR warps per block along n (chosen from the token tiles T)."""
    R: int
    WR: int
    WK: int
    SB: int
    U: int = 2
    PF: int = 1        # 1: weight loads with an L2 256-byte prefetch hint (measured: lm_head m=1 66% -> 89% of copy)
    BF: int = 1        # 1: read f32 x in the GEMM (no B prep launch) when x is contiguous
    MB: int = 0        # > 0: launch bounds asking ptxas to fit MB blocks per SM (caps registers)
    FR: int = 1        # 1: the k-split partials are added by the last block of each row range (needs ws.sync)
    S: int = 0         # >= 2: weights stream through an S-stage cp.async ring per warp (U, PF unused); 0: registers
    RB: int = 0        # 1 (with S, prepared B): the B fragments ride in the ring too
    XS: int = XS_DEFAULT   # activations as bf16 (1) or hi + lo parts (2), unless the call names xs
    WG: int = 0        # 1: kernels/gemm_wg.py (TMA ring + wgmma, sm_90; the fields above unused)


@dataclass
class GemmWorkspace:
    """Scratch of the dense GEMM, allocated once: xb u32 flat (B operand), part f32 flat (k-split partials),
    sync u32 flat (k-split counters: zero when allocated, left at zero by every call; None: a reduce launch)."""
    xb: object
    part: object
    sync: object = None


def gemm_config(m, n, k, target_warps=TARGET_WARPS, small=None, wg=WG_GEMM_DEFAULT):
    """Default cut: enough k-pieces that about `target_warps` warps stream weights (n, k decide the k split).
    On sm_90 the large-weight cut carries WG=1 up to WG_ROWS rows: kernels/gemm_wg.py runs it instead (TMA ring +
    wgmma; H200: 6-16 points of copy more at 17-33 rows on K2's projections, up to 6 fewer at one row on q_kv_a and
    the shared gate_up; docs/PERFORMANCE.md "Kernels"); the mma fields below are what NUMBAENGINE_GEMM_WG=0 and hi + lo
    activations run. Per token tiles T, H200, K2 shapes, chained % of copy (tools/bench_kernels.py --only gemm):
      R, U: one row tile per warp with 8 steps of loads in flight at T = 1 (U = 4 or 2 lost 1.5-13 points); at
          T = 2-3 R = 1 below R2_MIN_BYTES (R = 1 at 3 tiles lost 2-9 points on o and lm_head), R = 2 at 4-5 tiles
          (R = 1 there: -4 to +3 points); U = 4 at T = 2 with R = 1 (q_b at m = 9: 50.8 against 47.1 with U = 2;
          U = 4 with R = 2: 0.5-0.7 lower), U = 2 at T = 3 (q_b at m = 17: 44.0 against 40.4 with U = 1).
      MB = 2: 256-thread blocks capped at 128 registers, two per SM in one wave: at T = 1 o 82.4 against 75.1
          uncapped (162 registers, one block per SM), above one tile uncapped lost 12-30%.
      FR: the k-split partials added by the GEMM's last block at T = 1 (within 0.7 us of a reduce launch), by a
          reduce launch above (the in-GEMM reduce lost 1-7 us there).
      S: the cp.async weight ring (RING_STAGES) only at one token tile without a k split (lm_head m = 1: 94.2
          against 89.9 on registers); with a k split it lost 13-27 points at m = 1 (q_b 49.5 against 76.3), above
          one tile up to 10 (lm_head m = 33: 31.9 against 41.8). With the B fragments in the ring too (RB = 1) at
          3-5 token tiles it wins: see below."""
    tiles, steps = math.ceil(n / 16), k // 32
    pieces = max(1, min(target_warps // tiles, steps // 4, 64))
    wk = next(w for w in (8, 4, 2, 1) if pieces >= 2 * w or w == 1)
    sb = max(1, pieces // wk)
    T = min(math.ceil(m / 8), TILES_MAX)
    R = 2 if 3 < T <= 5 or (1 < T <= 3 and 2 * n * k >= R2_MIN_BYTES) else 1
    wr = max(1, 8 // wk)
    U = 8 if T == 1 else (4 if T == 2 and R == 1 else 2)
    # reading f32 x in the kernel saves a launch (wins at one token tile) but costs conversions per tile (loses above;
    # also on small weights: with the last-block reduce at T > 1 for weights under 4 MB the default pair's DDTree-16
    # round measured 1.54 ms against 1.12 on the H200, verify 1.03 against 0.78 ms, although it saves 2 launches per
    # GEMM)
    S = RING_STAGES if T == 1 and pieces == 1 else 0
    # B fragments riding in a 2-stage ring with the weights (RB=1) at 3-5 token tiles (at 3-4 from RB_MIN_BYTES):
    # H200, bf16 activations, % of copy at m = 17 / 33 without / with: lm_head 74.7 / 68.7 -> 90.2 / 87.2, o 60.8 /
    # 48.0 -> 63.4 / 54.7; at m = 33 every shape gained, at m = 17 the weights up to 38 MB lost 0.6-2.9 points (q_b
    # 49.7 -> 46.8). Four tiles: not measured (the three-tile rule). 3 stages lost.
    RB = int(3 <= T <= 5 and (T == 5 or 2 * n * k >= RB_MIN_BYTES))
    if RB:
        S = RB_STAGES
    if 2 * n * k < (SMALL_WEIGHTS if small is None else small):
        # latency-bound: one launch, f32 x read in the GEMM, the k split only inside a block (up to 8 warps along k,
        # >= 2 steps each; pieces from k alone, so every T sums in the same order). H200, default pair, DDTree-16
        # round GPU ms (python -m tools.bench_gemm_rules; launch-bound, 0.6-0.9% of the byte floor): this cut 0.93
        # (AR 0.48), the large-weight cut 1.07 (AR 0.54); this cut with the prep launch (BF=0) 0.99; the large cut
        # with the last-block reduce (FR=1) at T > 1 1.46 (one block reads m*rows*splits partials), without a
        # split across blocks 1.14. R=1 at every T: AR / DDTree-16 0.489 / 0.759 ms against 0.508 / 0.850 with R=2.
        # U (8 at one tile, 1 at three, else 2): timed on the pair's rounds, no figures kept.
        wk = next(w for w in (8, 4, 2, 1) if steps >= 2 * w or w == 1)
        return GemmConfig(R=1, WR=max(1, min(MAX_WARPS // wk, tiles)), WK=wk, SB=1,
                          U=8 if T == 1 else (1 if T == 3 else 2), BF=1, MB=2 if T > 1 else 0, FR=0, S=0, XS=SMALL_XS)
    return GemmConfig(R=R, WR=wr, WK=wk, SB=sb, U=U, BF=int(T == 1), MB=2, FR=int(T == 1), S=S,
                      RB=RB, WG=int(m <= WG_ROWS and gemm_wg_applies(m, n, k, wg)))


def with_xs(cfg, xs):
    """The cut that runs for activations xs: hi + lo parts (xs=2) take the mma path (wgmma takes bf16 x only)."""
    return replace(cfg, WG=0) if cfg.WG and xs not in (None, 1) else cfg


def token_tiles(m, cfg):
    """Token tiles of m rows in a GEMM block: 8 rows each."""
    return math.ceil(m / 8)


def gemm_workspace_words(m, n, k, xs=None, cfg=None, wg=WG_GEMM_DEFAULT):
    """(xb words, part floats) a call needs (xb: the tiled B operand, token rows padded to 8; none for x taller than
    one block, which the GEMM reads itself; the wgmma path's boxes per wg's token blocks)."""
    cfg = with_xs(cfg or gemm_config(m, n, k, wg=wg), xs)
    if cfg.WG:
        return wg_xb_words(m, k, wg.nb_max), 0
    rows = token_tiles(m, cfg) * 8
    xb = rows * (xs or cfg.XS) * k // 2 if m <= 8 * TILES_ONE_BLOCK else 0
    return xb, (cfg.SB * m * n if cfg.SB > 1 else 0)


def gemm_sync_words(m, n, k, cfg=None, xs=None):
    """Counters (u32, zeroed once by the caller) a call with a fused k-split reduce needs: one per row range."""
    cfg = with_xs(cfg or gemm_config(m, n, k), xs)
    return math.ceil(n / 16 / (cfg.WR * cfg.R)) if cfg.SB > 1 and cfg.FR and not cfg.WG else 0


def gemm_smem(T, cfg, nb=0):
    """Dynamic shared bytes of the GEMM kernel: the cp.async rings (nb B chunks per stage), or the in-block k-split
    exchange if larger."""
    ring = 4 * ring_words(cfg.R, cfg.S, cfg.WR * cfg.WK, nb) if cfg.S else 0
    return max(ring, red_bytes(cfg.R, T, cfg.WR, cfg.WK))


def gemm(x, w, out, ws, xs=None, cfg=None, wg=WG_GEMM_DEFAULT):
    """out f32[m, n] = x f32[m, k] @ bf16(w u16[n, k])^T on the GPU: [prep of B,] mma GEMM [, k-split reduce]
    (the reduce runs inside the GEMM when ws.sync is given). wg: the wgmma path's choices where the cut takes it."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape != (n, k) or out.shape != (m, n):
        raise ValueError(f"gemm: x {x.shape}, w {w.shape}, out {out.shape} do not fit x @ w^T")
    if k % 32:
        raise ValueError(f"gemm: k={k} is not a multiple of 32")
    cfg = with_xs(cfg or gemm_config(m, n, k, wg=wg), xs)
    if cfg.WG:
        return gemm_wg(x, w, out, ws.xb, cfg=wg)
    xs = xs or cfg.XS
    nxb, npart = gemm_workspace_words(m, n, k, xs, cfg, wg)
    if ws.xb.size < nxb or ws.part.size < npart:
        raise ValueError(f"gemm: workspace too small ({ws.xb.size}/{ws.part.size} < {nxb}/{npart})")
    nsync = gemm_sync_words(m, n, k, cfg) if ws.sync is not None else 0
    if nsync and ws.sync.size < nsync:
        raise ValueError(f"gemm: sync counters too few ({ws.sync.size} < {nsync})")
    T, zb = token_tiles(m, cfg), 1
    fused = cfg.BF and contiguous(x)
    if T > TILES_MAX and fused and not cfg.S and not nsync:
        T, zb = TILES_MAX, math.ceil(m / (8 * TILES_MAX))      # row blocks (grid z) of TILES_MAX token tiles
    elif T > TILES_ONE_BLOCK:
        raise ValueError(f"gemm: x of {m} rows (> {8 * TILES_ONE_BLOCK}) needs contiguous f32 x, BF=1, S=0 and no "
                         f"fused reduce (got {cfg}, contiguous={contiguous(x)})")
    if fused:
        xb = x.reshape(m * k)
    else:
        xb = ws.xb[:nxb]
        prep_b(x, xb, xs, 0, tiled=1)
    if cfg.WR * cfg.WK > MAX_WARPS:
        raise ValueError(f"gemm: {cfg} has more than {MAX_WARPS} warps per block")
    threads = 32 * cfg.WR * cfg.WK
    rb = int(bool(cfg.S and cfg.RB and not fused))
    kern = cached(_build_gemm, T, cfg.R, xs, cfg.U, cfg.PF, 1 if fused else 2, int(nsync > 0),
                   (threads, cfg.MB) if cfg.MB else None, cfg.S, rb)
    grid = (math.ceil(n / 16 / (cfg.WR * cfg.R)), cfg.SB, zb)
    part = ws.part[:npart].reshape(cfg.SB, m, n) if npart else ws.part[:1].reshape(1, 1, 1)
    sync = (ws.sync[:nsync],) if nsync else ()
    args = (xb, u32_words(w), out, part, *sync, int32(m), int32(n), int32(k), int32(cfg.WR), int32(cfg.WK))
    smem = gemm_smem(T, cfg, xs * T * rb)
    if smem > SMEM_MAX:
        raise ValueError(f"gemm: {cfg} needs {smem} bytes of shared memory (> {SMEM_MAX})")
    if smem > 44 * 1024 and not SIM:      # (above 48 KB less the static bytes: the limit must be raised first)
        launch_smem(kern, grid, threads, max(smem, 48 * 1024 + 16), args)
    else:
        launch(kern, grid, threads, *args, shmem=smem)
    if cfg.SB > 1 and not nsync:
        launch(cached(_build_reduce), math.ceil(m * n / 256), 256, part, out, int32(cfg.SB), int32(m), int32(n))
    return out


# ------------------------------------------------------------------------------------------------ per-head GEMM
@dataclass(frozen=True)
class HeadGemmConfig:
    """Cut of the per-head GEMM: T token tiles (8 tokens each) per block, R row tiles per warp, WR warps along b and
    WK along a per block (WK is chosen from a only: batch invariance)."""
    T: int
    R: int
    WR: int
    WK: int
    U: int = 2
    PF: int = 1


def head_gemm_config(n, h, b, a):
    """Default cut: up to 32 tokens per block; k split in the block when a is long (w_uv: a = kv_lora)."""
    steps, T = a // 32, min(math.ceil(n / 8), 4)
    wk = 4 if steps >= 16 else (2 if steps >= 8 else 1)
    R = 2 if T <= 2 else 1
    return HeadGemmConfig(T=T, R=R, WR=max(1, min(math.ceil(b / 16 / R), 4 // wk)), WK=wk)


def head_gemm_workspace_words(n, h, b, a, cfg=None):
    """(xb words, part floats) a head_gemm call needs: none with the current cuts (x is read in place, no k split
    across blocks); callers still hand a GemmWorkspace so later cuts can use scratch."""
    return 0, 0


def _build_head_gemm(T, R, XS, U, PF):
    mainloop = cached(build_mainloop, BF16, T, R, XS, 1, U, PF, 1)
    block_reduce = cached(build_block_reduce, R, T)
    NACC, NA = R * T * 4, 2 * R

    @kernel()
    def head_gemm_k(x, w, out, n, b, a, sx0, sx1, nwr, nwk):
        """out[tok, hd, row] = sum_c x[tok, hd, c] * W[hd, row, c] for head hd = blockIdx.z, tokens from 8T*blockIdx.y.
        x: f32 addressed flat from x[0, 0, 0] with element strides (sx0, sx1, 1); w: u32 flat [h, b, a/2];
        out f32[n, h, b] (any strides). Launch: grid (ceil(b/16/(nwr*R)), ceil(n/(8T)), h), block 32*nwr*nwk.
        Moves h*b*a*2 bytes of weights, n*h*(a + b)*4 of activations and outputs."""
        grid_dep()
        lane = lane_id()
        g, t = lane // 4, lane % 4
        warp = cuda.threadIdx.x // 32
        wr, wk = warp % nwr, warp // nwr
        hd = cuda.blockIdx.z
        tile0 = (cuda.blockIdx.x * nwr + wr) * R
        tok0 = cuda.blockIdx.y * 8 * T
        half = a // 2
        s0, s1 = split_range(wk, nwk, a // 32)
        aoff = cuda.local.array(NA, int32)
        boff = cuda.local.array(T, int32)
        acc = cuda.local.array(NACC, float32)
        for r in range(R):
            row = (tile0 + r) * 16 + g
            aoff[2 * r] = (hd * b + min(row, b - 1)) * half
            aoff[2 * r + 1] = (hd * b + min(row + 8, b - 1)) * half
        for tt in range(T):
            boff[tt] = min(tok0 + tt * 8 + g, n - 1) * sx0 + hd * sx1
        for i in range(NACC):
            acc[i] = F0
        mainloop(w, w, x, s0, s1, t, half, aoff, aoff, boff, acc)
        block_reduce(acc, wr, wk, nwr, nwk, lane)
        if wk == 0:
            for r in range(R):
                for tt in range(T):
                    i = (r * T + tt) * 4
                    for e in range(4):
                        row = (tile0 + r) * 16 + g + 8 * (e // 2)
                        tok = tok0 + tt * 8 + 2 * t + e % 2
                        if row < b and tok < n:
                            out[tok, hd, row] = acc[i + e]
    return head_gemm_k


def head_gemm(x, w, out, ws, cfg=None):
    """Per head hd: out[:, hd] = x[:, hd] @ bf16(w[hd])^T in one launch. x f32[n, h, a] and out f32[n, h, b] may be
    strided views (x rows: unit stride, 16-byte aligned, e.g. q[:, :, :nope]); w u16[h, b, a] contiguous."""
    n, h, a = x.shape
    b = w.shape[1]
    if w.shape != (h, b, a) or out.shape != (n, h, b):
        raise ValueError(f"head_gemm: x {x.shape}, w {w.shape}, out {out.shape} do not fit per-head x @ w^T")
    sx = [s // 4 for s in x.strides]
    if a % 32 or sx[2] != 1 or sx[0] % 4 or sx[1] % 4 or data_ptr(x) % 16:
        raise ValueError(f"head_gemm: x rows must be 16-byte aligned with unit stride and a % 32 == 0 "
                         f"(a={a}, strides {x.strides})")
    cfg = cfg or head_gemm_config(n, h, b, a)
    nxb, npart = head_gemm_workspace_words(n, h, b, a, cfg)
    if ws.xb.size < nxb or ws.part.size < npart:
        raise ValueError(f"head_gemm: workspace too small ({ws.xb.size}/{ws.part.size} < {nxb}/{npart})")
    if cfg.WR * cfg.WK > MAX_WARPS:
        raise ValueError(f"head_gemm: {cfg} has more than {MAX_WARPS} warps per block")
    kern = cached(_build_head_gemm, cfg.T, cfg.R, HEAD_XS, cfg.U, cfg.PF)
    grid = (math.ceil(b / 16 / (cfg.WR * cfg.R)), math.ceil(n / (8 * cfg.T)), h)
    launch(kern, grid, 32 * cfg.WR * cfg.WK, flat_span(x) if SIM else x, u32_words(w), out, int32(n), int32(b),
           int32(a), int32(sx[0]), int32(sx[1]), int32(cfg.WR), int32(cfg.WK))
    return out


