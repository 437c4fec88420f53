"""Warpgroup MMA (sm_90a `wgmma.mma_async`) from numba: the tensor-core path that reads both operands from shared
memory. mma.sync feeds every operand through registers, which is what caps the 64-head MLA at 24% of the mma.sync
roof (H200); FlashMLA's design rests on wgmma. numba-cuda compiles kernels for sm_90a on
Hopper (compute capability (9, 0, "a")), so the instruction is reachable through inline PTX.

A building block, checked against NumPy by `wgmma_tile` on a GPU (tests/test_wgmma.py, marked gpu; the simulator has
no twin: these helpers raise there). Layout used here: no swizzle. A core matrix is 8 rows of 16 bytes (8 bf16), 128
contiguous bytes; `core_offset(row, k, kcores)` lays a tile out row block by row block, the kcores core matrices of
a row block side by side, so core matrices adjacent in k are LBO = 128 bytes apart and those adjacent in rows
SBO = 128 kcores. K-major operands (A, and B of D = A B^T) index (row, k); an MN-major B (`trans_b`: D = A B with
B stored k-row by k-row, its n contiguous) indexes (k, n) in the same layout: then its core matrices adjacent in
k are 128 (N/8) apart, adjacent in n 128 apart. The accumulator of m64nNk16 is spread like N/8 mma.sync D
fragments per warp: warp w of the group holds rows 16w .. 16w + 15, and register 4j + i of a thread (lane 4g + t)
is (row 16w + g + 8 (i // 2), column 8j + 2t + i % 2).
"""
import numpy as np
from numba import cuda, uint32, uint64

from numbaengine.kernels.device import SIM

LBO, SBO = 128, 256          # a 16-wide K-major tile (2 core matrices per row block): bytes between core matrices
#                              adjacent in k / in rows


def core_offset(row, k, kcores):
    """Byte offset of element (row, k) of a bf16 tile laid out by row blocks of 8, each holding `kcores` core
    matrices (8 x 8) side by side: LBO = 128 along k, SBO = 128 kcores along rows."""
    return ((row >> 3) * kcores + (k >> 3)) * 128 + (row & 7) * 16 + (k & 7) * 2


def mn_strides(k_stride, n_stride):
    """(LBO, SBO) of a no-swizzle MN-major operand whose core matrices are k_stride bytes apart along k, n_stride
    along n: LBO is the k stride, as for K-major (H200, tests/test_wgmma.py; the other order reads out of bounds)."""
    return k_stride, n_stride


def sw128_offset(row, k, rows):
    """Byte offset of element (row, k) of a [rows, K] bf16 tile in the 128-byte-swizzle layout: atoms of 8 rows x
    64 k (1024 bytes, 1024-aligned), 16-byte chunk c of row r at chunk c ^ (r % 8); atoms stacked down the rows
    (SBO = 1024), then the 64-wide k slabs (128 rows bytes apart). The same bytes are a K-major operand indexed
    (row, k) and an MN-major one indexed (k = row, n = k): 8 k rows x 64 n per atom."""
    return ((k >> 6) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + ((((k >> 3) & 7) ^ (row & 7)) << 4)
            + (k & 7) * 2)


def sw128_mn_strides(n_atom_stride, k_group_stride):
    """(LBO, SBO) of a 128-byte-swizzled MN-major operand: 64-wide n atoms n_atom_stride bytes apart, 8-row k groups
    k_group_stride apart. Here LBO is the n-atom stride (H200, tests/test_wgmma.py; the other order read out of
    bounds: an illegal address)."""
    return n_atom_stride, k_group_stride


if SIM:
    def _no_twin(*args):
        raise NotImplementedError("wgmma has no simulator twin: run kernels/wgmma.py on an sm_90a GPU")

    wg_fence = wg_commit = wg_wait0 = wg_wait1 = fence_proxy_async = smem_desc = _no_twin

    def make_desc(lbo, sbo, swizzle=0):
        return _no_twin

    def make_wgmma(N, trans_b=False):
        return _no_twin

    _core_offset, _sw128_offset = core_offset, sw128_offset
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import (
        barrier_op as _statement,  # a PTX statement that orders memory
    )

    wg_fence = _statement("wgmma.fence.sync.aligned;")
    wg_commit = _statement("wgmma.commit_group.sync.aligned;")
    wg_wait0 = _statement("wgmma.wait_group.sync.aligned 0;")       # every committed group done
    wg_wait1 = _statement("wgmma.wait_group.sync.aligned 1;")       # all but the newest group done
    fence_proxy_async = _statement("fence.proxy.async.shared::cta;")   # generic-proxy smem writes -> wgmma reads

    _DESC = {}

    _LAYOUT = {0: 0, 128: 1, 64: 2, 32: 3}      # swizzle bytes -> layout type (bits 62-63)

    def make_desc(lbo, sbo, swizzle=0):
        """smem_desc(shared array, byte offset) -> u64 matrix descriptor: start address >> 4 in bits 0-13, lbo >> 4
        in 16-29, sbo >> 4 in 32-45, base offset 0 (swizzled tiles 1024-aligned), the layout type (swizzle 0 /
        128 / 64 / 32 bytes) in bits 62-63. Advancing the start by b bytes (16-aligned) is adding b >> 4."""
        key = (lbo, sbo, swizzle)
        if key in _DESC:
            return _DESC[key]
        if lbo % 16 or sbo % 16 or not (0 < lbo < 1 << 18 and 0 < sbo < 1 << 18) or swizzle not in _LAYOUT:
            raise ValueError(f"make_desc: strides {lbo}, {sbo} are not 16-byte multiples below 256 KB, or swizzle "
                             f"{swizzle} is not 0/32/64/128")

        @intrinsic
        def desc(typingctx, sary, byte_off):
            sig = types.uint64(sary, byte_off)

            def codegen(ctx, b, sig, args):
                arr = ctx.make_array(sig.args[0])(ctx, b, value=args[0])
                i64 = ir.IntType(64)
                cvta = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
                addr = b.add(b.call(cvta, [b.ptrtoint(arr.data, i64)]),
                             ctx.cast(b, args[1], sig.args[1], types.uint64))
                start = b.and_(b.lshr(addr, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF))
                fixed = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (_LAYOUT[swizzle] << 62)
                return b.or_(start, ir.Constant(i64, fixed))
            return sig, codegen
        _DESC[key] = desc
        return desc

    smem_desc = make_desc(LBO, SBO)

    _WGMMA = {}

    def make_wgmma(N, trans_b=False):
        """wgmma(desc_a, desc_b, acc, accumulate) -> acc': D = A @ B^T (+ D where accumulate is nonzero) for A 64x16
        and B Nx16 (both K-major in shared memory; trans_b: B is MN-major, the tile 16xN with n contiguous), f32
        accumulators acc (a tuple of N/2 per thread, in and out), bf16 inputs. N % 8 == 0, 8 <= N <= 256."""
        key = (N, trans_b)
        if key in _WGMMA:
            return _WGMMA[key]
        if N % 8 or not 8 <= N <= 256:
            raise ValueError(f"wgmma: N = {N} is not a multiple of 8 in [8, 256]")
        nacc = N // 2
        regs = ",".join(f"${i}" for i in range(nacc))
        # scale-d is a predicate (1: D += A B); scale-a, scale-b = 1; transpose flags of A (never) and B
        asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${nacc + 2}, 0; wgmma.mma_async.sync.aligned.m64n{N}k16.f32.bf16.bf16"
               f" {{{regs}}}, ${nacc}, ${nacc + 1}, p, 1, 1, 0, {int(trans_b)}; }}")
        cons = ",".join(["=f"] * nacc + ["l", "l", "r"] + [str(i) for i in range(nacc)])
        acc_type = types.UniTuple(types.float32, nacc)

        @intrinsic
        def wgmma(typingctx, desc_a, desc_b, acc, accumulate):
            if acc != acc_type:
                return None
            sig = acc_type(desc_a, desc_b, acc, accumulate)

            def codegen(ctx, b, sig, args):
                f32 = ir.FloatType()
                vals = [ctx.cast(b, args[i], sig.args[i], types.uint64) for i in (0, 1)]
                vals.append(ctx.cast(b, args[3], sig.args[3], types.int32))
                vals += [b.extract_value(args[2], i) for i in range(nacc)]
                fn = ir.FunctionType(ir.LiteralStructType([f32] * nacc),
                                     [ir.IntType(64)] * 2 + [ir.IntType(32)] + [f32] * nacc)
                r = b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), vals)
                return ctx.make_tuple(b, acc_type, [b.extract_value(r, i) for i in range(nacc)])
            return sig, codegen
        _WGMMA[key] = wgmma
        return wgmma

    _core_offset, _sw128_offset = cuda.jit(device=True)(core_offset), cuda.jit(device=True)(sw128_offset)


def wgmma_tile_kernel(N, K=16, trans_b=False, b_strides=None, swizzle=0):
    """Kernel (a, b, d), one warpgroup (grid 1, block 128): d f32[64, N] = a @ b^T for a u16[64, K] and b u16[N, K]
    (bf16 bits; trans_b: d = a @ b for b u16[K, N], MN-major): both tiles staged in shared memory (1024-aligned) by
    core_offset (swizzle=0) or sw128_offset (swizzle=128), K/16 wgmmas (the first overwriting the accumulators),
    the accumulators written out by the fragment layout above. b_strides: B's (LBO, SBO), default the layout's.
    Moves (64 + N) * 2K bytes in and 256 N out."""
    from numbaengine.kernels.device import F0
    from numbaengine.kernels.unroll import fill, unroll
    NACC, B_ROWS, B_COLS, KS, TRANS_B = N // 2, (K if trans_b else N), (N if trans_b else K), K // 16, trans_b
    A_WORDS, SWIZZLE, KH, BH = 64 * K // 2, bool(swizzle), K // 2, (N if trans_b else K) // 2
    if swizzle:                  # 8-row atoms 1024 bytes apart; 64-wide slabs rows * 128 apart; k16 = 32 bytes
        lbo_a, sbo_a = 16, 1024
        lbo_b, sbo_b = b_strides or (sw128_mn_strides(K * 128, 1024) if trans_b else (16, 1024))
        A_BYTES, B_BYTES = 64 * 128 * -(-K // 64), B_ROWS * 128 * -(-B_COLS // 64)   # rows of 128-byte atoms
    else:                        # core matrices: k16 = two of them along k
        lbo_a, sbo_a = 128, 16 * K
        lbo_b, sbo_b = b_strides or (mn_strides(16 * N, 128) if trans_b else (128, 16 * K))
        A_BYTES, B_BYTES = 64 * K * 2, B_ROWS * B_COLS * 2
    NWORDS, AKC, BKC = (A_BYTES + B_BYTES) // 4, K // 8, B_COLS // 8
    desc_a, desc_b = make_desc(lbo_a, sbo_a, swizzle), make_desc(lbo_b, sbo_b, swizzle)
    wgmma = make_wgmma(N, trans_b)

    @cuda.jit(device=True, forceinline=True)
    def k_step(ks, acc, da, db):
        """The wgmma of k16 step ks (the first one overwrites acc): A and B advanced by its bytes (16-byte units)."""
        if SWIZZLE:
            a_off = (ks // 4) * 64 * 128 + (ks % 4) * 32
            b_off = ks * 2048 if TRANS_B else (ks // 4) * N * 128 + (ks % 4) * 32
        else:
            a_off = 256 * ks
            b_off = (32 * N if TRANS_B else 256) * ks
        return wgmma(da + uint64(a_off // 16), db + uint64(b_off // 16), acc, ks > 0)

    @cuda.jit
    def wgmma_tile(a, b, d):
        sm = cuda.shared.array(NWORDS, uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(tid, A_WORDS + B_ROWS * B_COLS // 2, 128):   # a bf16 pair of A (i < A_WORDS) or of B
            if i < A_WORDS:
                row, k = i // KH, 2 * (i % KH)
                o = _sw128_offset(row, k, 64) if SWIZZLE else _core_offset(row, k, AKC)
                word = uint32(a[row, k]) | (uint32(a[row, k + 1]) << uint32(16))
            else:
                row, k = (i - A_WORDS) // BH, 2 * ((i - A_WORDS) % BH)
                o = A_BYTES + (_sw128_offset(row, k, B_ROWS) if SWIZZLE else _core_offset(row, k, BKC))
                word = uint32(b[row, k]) | (uint32(b[row, k + 1]) << uint32(16))
            sm[o // 4] = word
        fence_proxy_async()
        cuda.syncthreads()
        da, db = desc_a(sm, 0), desc_b(sm, A_BYTES)
        wg_fence()
        acc = unroll(KS, k_step, fill(NACC, F0), da, db)
        wg_commit()
        wg_wait0()
        w, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        for i in range(NACC):
            d[16 * w + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] = acc[i]
    return wgmma_tile


def wgmma_tile(a, b, N, trans_b=False, b_strides=None, swizzle=0):
    """d = a @ b^T (trans_b: a @ b) on the GPU through K/16 wgmmas (a u16[64, K], b u16[N, K] or u16[K, N] device
    arrays of bf16 bits)."""
    d = cuda.device_array((64, N), np.float32)
    wgmma_tile_kernel(N, a.shape[1], trans_b, b_strides, swizzle)[1, 128](a, b, d)
    return d
