"""mma.sync building blocks shared by the tensor-core attention kernels (kernels/attention.py, mla.py, mla_wg.py):
ldmatrix fragments of bf16 tiles in shared memory (m16n8k16 A and B operands), vector shared loads and stores, cp.async
pieces of cache rows, exp2 and bf16 rounding. Each with its simulator twin (the registers ldmatrix would hand a lane).
"""
import numpy as np
from numba import cuda, float32, uint16, uint32

from numbaengine.kernels.device import SIM, ld16
from numbaengine.weights.dtypes import f32_to_bf16

LAZY = float32(8)           # online softmax (log2 units): the running max moves only when a row's max grows by more
#                             than this (P <= 2^LAZY)


if not SIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import (
        asm_op,
        cvt_pair,
        element_address,
        shared_address,
        smem_load4,
    )

    def _make_ldsm(trans):
        """ldmatrix .x4 (optionally .trans): this lane passes the address of its row (uint16 element idx)."""
        return smem_load4("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16", clobber=False)

    @intrinsic
    def slot_addr(typingctx, sary, sidx):
        """32-bit shared-window address of uint16 element sidx of a 1-D shared array (a ring slot's start)."""
        sig = types.uint32(sary, sidx)

        def codegen(context, builder, sig, args):
            return shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return sig, codegen

    @intrinsic
    def row_addr(typingctx, gary, gidx):
        """Generic byte address of flat element gidx of a contiguous global array."""
        sig = types.uint64(gary, gidx)

        def codegen(context, builder, sig, args):
            return element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return sig, codegen

    def make_cp_piece(d8, npieces):
        """cp.async of 16-byte piece idx (< npieces) of a tile of rows of d8 pieces: global gptr + 16*idx -> shared
        slot + 16*(idx + idx // d8) (rows padded by 16 bytes). Rows idx // d8 >= nvalid read nothing (zeros) from
        gsafe. All 32-bit index math in one PTX block."""
        asm = ("{ .reg .u32 kr, so, sz, c, t; .reg .u64 ga, off; .reg .pred ok, in;"
               f" div.u32 kr, $2, {d8}; setp.lt.u32 in, $2, {npieces}; setp.lt.s32 ok, kr, $3;"
               " add.u32 so, $2, kr; shl.b32 so, so, 4; add.u32 so, so, $0;"
               " mul.wide.u32 off, $2, 16; add.u64 ga, $1, off; selp.b64 ga, ga, $4, ok; selp.u32 sz, 16, 0, ok;"
               " cvta.to.global.u64 ga, ga; @in cp.async.cg.shared.global [so], [ga], 16, sz; }")

        @intrinsic
        def cp_piece(typingctx, sary, slot, gary, gptr, gsafe, idx, nvalid):
            sig = types.void(sary, slot, gary, gptr, gsafe, idx, nvalid)

            def codegen(context, builder, sig, args):
                i32, i64 = ir.IntType(32), ir.IntType(64)
                vals = [context.cast(builder, args[1], sig.args[1], types.uint32),
                        context.cast(builder, args[3], sig.args[3], types.uint64),
                        context.cast(builder, args[5], sig.args[5], types.uint32),
                        context.cast(builder, args[6], sig.args[6], types.int32),
                        context.cast(builder, args[4], sig.args[4], types.uint64)]
                fn = ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32, i64])
                builder.call(ir.InlineAsm(fn, asm, "r,l,r,r,l,~{memory}", side_effect=True), vals)
            return sig, codegen
        return cp_piece

    @intrinsic
    def opaque0(typingctx):
        """int32 0 the compiler cannot see through: offsets derived from it are recomputed where they are used
        instead of being hoisted out of the step loop into registers (one per address: spills)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            return builder.call(ir.InlineAsm(ir.FunctionType(i32, []), "mov.u32 $0, 0;", "=r", side_effect=True), [])
        return types.int32(), codegen

    ldsm, ldsm_t = _make_ldsm(False), _make_ldsm(True)

    def _make_lds(n):
        """ld.shared.v{n}.f32 at element idx of a 1-D float32 shared array (idx * 4 aligned to 4n bytes)."""
        asm = f"ld.shared.v{n}.f32 {{{','.join(f'${k}' for k in range(n))}}}, [${n}];"

        @intrinsic
        def lds(typingctx, ary, idx):
            sig = types.UniTuple(types.float32, n)(ary, idx)

            def codegen(context, builder, sig, args):
                a = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                fn = ir.FunctionType(ir.LiteralStructType([ir.FloatType()] * n), [ir.IntType(32)])
                rr = builder.call(ir.InlineAsm(fn, asm, ",".join(["=f"] * n) + ",r", side_effect=True), [a])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(rr, k) for k in range(n)])
            return sig, codegen
        return lds

    def _make_sts2(kind):
        """st.shared.v2.{kind} of (x, y) at element idx of a 1-D shared array (8-byte aligned)."""
        ty = types.float32 if kind == "f32" else types.uint32
        asm = f"st.shared.v2.{kind} [$0], {{$1, $2}};"

        @intrinsic
        def sts2(typingctx, ary, idx, x, y):
            sig = types.void(ary, idx, x, y)

            def codegen(context, builder, sig, args):
                a = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                v = [context.cast(builder, args[k], sig.args[k], ty) for k in (2, 3)]
                lt = context.get_value_type(ty)
                fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), lt, lt])
                cons = "r," + ("f,f" if kind == "f32" else "r,r") + ",~{memory}"
                builder.call(ir.InlineAsm(fn, asm, cons, side_effect=True), [a] + v)
            return sig, codegen
        return sts2

    lds2, lds4 = _make_lds(2), _make_lds(4)
    sts2f, sts2u = _make_sts2("f32"), _make_sts2("u32")
    ex2 = asm_op("ex2", "ex2.approx.ftz.f32 $0, $1;", "=f,f", [types.float32], types.float32)

    @cuda.jit(device=True, inline="always")
    def to_bf16(x):
        """float32 -> bf16 bits, round to nearest even."""
        u = uint32(libdevice.float_as_int(x))
        return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))

    @cuda.jit(device=True, inline="always")
    def pack2(lo, hi):
        """Two float32 -> bf16 pair (round to nearest even, one cvt), lo in the low half."""
        return cvt_pair(hi, lo)

    @cuda.jit(device=True, inline="always")
    def frag_a(sm, base, stride, r0, c0):
        """A fragment of the 16x16 tile at (r0, c0) of a row-major tile sm[base + r*stride + c] (one ldmatrix.x4)."""
        lane = cuda.threadIdx.x & 31
        return ldsm(sm, base + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + c0 + (lane >> 4) * 8)

    @cuda.jit(device=True, inline="always")
    def frag_bt(sm, base, stride, k0, n0):
        """B fragments of n-tiles n0 and n0+8, k rows k0..k0+15 of a row-major [k][n] tile (ldmatrix.x4.trans)."""
        lane = cuda.threadIdx.x & 31
        return ldsm_t(sm, base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + n0 + (lane >> 4) * 8)

    @cuda.jit(device=True, inline="always")
    def frag_bn(sm, base, stride, n0, k0):
        """B fragments of k-steps k0 and k0+16 for rows n0..n0+7 of a row-major [n][k] tile (ldmatrix.x4)."""
        lane = cuda.threadIdx.x & 31
        return ldsm(sm, base + (n0 + (lane & 7)) * stride + k0 + (lane >> 3) * 8)
else:
    # Simulator twins: each lane reads exactly the registers ldmatrix would hand it; cp.async copies at once.
    def to_bf16(x):
        return f32_to_bf16(np.array([x], np.float32))[0]

    def pack2(lo, hi):
        return np.uint32(int(to_bf16(np.float32(lo))) | (int(to_bf16(np.float32(hi))) << 16))

    def _pair(sm, i, j):
        return np.uint32(int(sm[i]) | (int(sm[j]) << 16))

    def frag_a(sm, base, stride, r0, c0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (r0 + g + 8 * (k & 1)) * stride + c0 + 2 * t + 8 * (k >> 1) for k in range(4)]
        return tuple(_pair(sm, a, a + 1) for a in at)

    def frag_bt(sm, base, stride, k0, n0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (k0 + 2 * t + 8 * (k & 1)) * stride + n0 + g + 8 * (k >> 1) for k in range(4)]
        return tuple(_pair(sm, a, a + stride) for a in at)

    def frag_bn(sm, base, stride, n0, k0):
        lane = cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        at = [base + (n0 + g) * stride + k0 + 2 * t + 8 * k for k in range(4)]
        return tuple(_pair(sm, a, a + 1) for a in at)

    # as device functions: the simulator hands them its cuda module (threadIdx) as it does the kernel's
    frag_a, frag_bt, frag_bn = (cuda.jit(device=True)(f) for f in (frag_a, frag_bt, frag_bn))

    def lds2(sm, i):
        return np.float32(sm[i]), np.float32(sm[i + 1])

    def lds4(sm, i):
        return np.float32(sm[i]), np.float32(sm[i + 1]), np.float32(sm[i + 2]), np.float32(sm[i + 3])

    def sts2f(sm, i, x, y):
        sm[i], sm[i + 1] = x, y

    sts2u = sts2f

    def ex2(x):
        return np.float32(np.exp2(np.float32(x)))

    def slot_addr(sm, sidx):
        return sidx

    def row_addr(arr, gidx):
        return gidx

    def make_cp_piece(d8, npieces):
        def cp_piece(sm, slot, arr, gptr, gsafe, idx, nvalid):
            if idx < npieces:
                kr = idx // d8
                o = slot + 8 * (idx + kr)
                sm[o:o + 8] = np.array(ld16(arr, gptr + 8 * idx) if kr < nvalid else (0, 0, 0, 0),
                                       np.uint32).view(np.uint16)
        return cp_piece

    def opaque0():
        return 0


@cuda.jit(device=True, inline="always")
def bf16_pair(lo, hi):
    """Two float32 -> one word of two bf16 (round to nearest even), lo in the low half."""
    return uint32(to_bf16(lo)) | (uint32(to_bf16(hi)) << uint32(16))
