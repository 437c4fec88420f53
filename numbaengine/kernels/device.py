"""Device helpers shared by the kernel families, each with a plain-Python twin for the CUDA simulator.

The simulator (NUMBA_ENABLE_CUDASIM=1, read before numba is imported) runs kernels as Python threads and has no
warp shuffles and no inline PTX. Every helper that needs them comes in two versions: the compiled one (numba
intrinsics with inline PTX, `shfl_*_sync`) and a Python one that exchanges values between the 32 threads of a
warp through a per-warp barrier. Kernels call the helpers only, so one kernel source runs in both modes.

bf16 values travel as raw bits: `uint16` arrays, or `uint32` words holding a pair (element 0 in the low half).
"""
import math
import threading
import time

import numpy as np
from numba import cuda, float32, int32, uint32

from numbaengine.env import PDL, SIM
from numbaengine.kernels.sim import (
    bf16_rne,
    bits_f32,
    collective,
    f32_bits,
    flat,
    pair_f32,
)

FULL = 0xFFFFFFFF
F0, F1 = float32(0.0), float32(1.0)
BF16_ONE2 = uint32(0x3F803F80)         # bf16 pair (1.0, 1.0)
INT4_MAGIC = uint32(0x43004300)        # bf16 pair (128.0, 128.0): OR a nibble u into the mantissa -> 128 + u
INT4_OFFSET2 = uint32(0xC308C308)      # bf16 pair (-136.0, -136.0): 128 + u - 136 = u - 8, exact
NEG_INF = float32(-math.inf)
LOG2E = float32(1 / math.log(2))       # split maxes are stored in log2 units (merge_splits uses exp2)

# Programmatic dependent launch (PDL), ON ("wait" mode) by default: every kernel made by launch.kernel() starts with
# grid_dep() and launch() gives it the PDL launch attribute: with no explicit trigger a kernel's blocks trigger as they
# exit, so the next kernel is launched as this one's last blocks end (ahead of its completion being signalled), and
# its blocks first wait (griddepcontrol.wait) until this kernel has finished and its writes are visible.
# NUMBAENGINE_PDL (numbaengine/env.py): "wait" (default) or "off". H200, K2.6-shaped 2 layers
# (`python -m tools.bench --synth-k2 2 --modes ar,ddtree --budgets 16 --batches 1 --new-tokens 32`): AR step 1.249
# against 1.273 ms of GPU time with it off (-1.8%). PDL is this module's copy (tests flip it).


def device(fn):
    """A device function, inlined at the NVVM level on the GPU (plain callable under the simulator)."""
    if SIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


if SIM:
    def ld16(arr, i):
        """Four uint32 words from element i of an array (16 bytes, 16-byte aligned; see flat for views)."""
        a = flat(arr)
        w = a[i:i + 16 // a.itemsize].view(np.uint32)
        return w[0], w[1], w[2], w[3]

    def ld8(arr, i):
        a = flat(arr)
        w = a[i:i + 8 // a.itemsize].view(np.uint32)
        return w[0], w[1]

    def ld4(arr, i):
        a = flat(arr)
        return a[i:i + 4 // a.itemsize].view(np.uint32)[0]

    ld16_pf = ld16
    ld4_l2 = ld4
    lds16 = ld16

    def sts8(arr, i, v0, v1):
        """Two float32 -> elements i, i + 1 of a float32 shared array (8 bytes, 8-byte aligned)."""
        arr[i], arr[i + 1] = v0, v1

    def st16(arr, i, w0, w1, w2, w3):
        """Four uint32 words -> element i of an array (16 bytes, 16-byte aligned)."""
        a = flat(arr)
        a[i:i + 16 // a.itemsize].view(np.uint32)[:] = (w0, w1, w2, w3)

    def _quad_load(arr, i):
        a = flat(arr)
        if a.dtype == np.uint16:                  # bf16 bits -> the f32 bit patterns
            return tuple(np.uint32(int(x) << 16) for x in a[i:i + 4])
        return ld16(arr, i)

    ld_quad = _quad_load

    def st_quad(arr, i, w0, w1, w2, w3):
        """Four float32 (bit patterns) -> elements i .. i + 3 of a float32 array, or of a bf16 (uint16) one rounded
        to nearest even (16 / 8 bytes, aligned)."""
        a = flat(arr)
        if a.dtype == np.uint16:
            a[i:i + 4] = [bf16_rne(bits_f32(w)) for w in (w0, w1, w2, w3)]
        else:
            st16(arr, i, w0, w1, w2, w3)

    def timer_regs():
        """Simulator: (ns, ns, SM 0) from the host clock (see the GPU version)."""
        t = np.uint32(time.perf_counter_ns() & 0xFFFFFFFF)
        return t, t, np.uint32(0)

    def as_f32(u):
        return np.float32(bits_f32(u))

    def as_u32(f):
        return np.uint32(f32_bits(f))

    def pack_bf16x2(lo, hi):
        return np.uint32(bf16_rne(np.float32(lo)) | (bf16_rne(np.float32(hi)) << 16))

    def fma_bf16x2(a, b, c):
        """Lane-wise bf16 a*b+c, rounded once (the operands used here make it exact)."""
        (a0, a1), (b0, b1), (c0, c1) = pair_f32(a), pair_f32(b), pair_f32(c)
        r0 = np.float32(np.float64(a0) * b0 + c0)
        r1 = np.float32(np.float64(a1) * b1 + c1)
        return pack_bf16x2(r0, r1)

    def lop3_and_or(a, b, c):
        return np.uint32((int(a) & int(b)) | int(c))

    def _pairs(words):
        """uint32 words -> float32 (low, high) halves, elementwise."""
        w = np.asarray(words, dtype=np.uint32)
        return (w << np.uint32(16)).view(np.float32), (w & np.uint32(0xFFFF0000)).view(np.float32)

    def _mma_tile(regs):
        """Full 16x8 product of one m16n8k16 tile from the 32 lanes' (a0..a3, b0, b1) registers."""
        lo, hi = _pairs([r for r in regs])                 # [32, 6] each
        g, t = np.arange(32) // 4, np.arange(32) % 4
        a = np.zeros((16, 16), np.float64)
        b = np.zeros((16, 8), np.float64)
        for j, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            a[g + dr, 2 * t + dc], a[g + dr, 2 * t + dc + 1] = lo[:, j], hi[:, j]
        b[2 * t, g], b[2 * t + 1, g] = lo[:, 4], hi[:, 4]
        b[2 * t + 8, g], b[2 * t + 9, g] = lo[:, 5], hi[:, 5]
        return a @ b

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one m16n8k16 tile held by the warp (fragment layout of the PTX ISA)."""
        d, lane = collective((a0, a1, a2, a3, b0, b1), _mma_tile)
        g, t = divmod(lane, 4)
        return (np.float32(d[g, 2 * t] + c0), np.float32(d[g, 2 * t + 1] + c1),
                np.float32(d[g + 8, 2 * t] + c2), np.float32(d[g + 8, 2 * t + 1] + c3))

    def shfl_xor(value, mask):
        values, lane = collective(value, list)
        return values[lane ^ mask]

    def shfl_idx(value, src):
        values, _ = collective(value, list)
        return values[src]

    def lane_id():
        return threading.current_thread().thread_id % 32

    def match_rank(value):
        values, lane = collective(value, list)
        return sum(v == value for v in values[:lane]), sum(v == value for v in values)

    def syncwarp():
        """The simulator's warp exchange is a barrier of the warp (and its shared memory is one array)."""
        collective(0, list)

    def cp_commit():
        """Simulator: cp.async copies land at once, so groups and waits are no-ops."""

    def grid_dep():
        """Simulator: launches run one after another (no PDL)."""

    def cp_wait(n):
        return cp_commit

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def element_address(ctx, b, aty, arr, idx, idxty):
        """Byte address of flat element `idx` of a contiguous array."""
        a = ctx.make_array(aty)(ctx, b, arr)
        i64 = ir.IntType(64)
        if idx.type.width < 64:
            idx = b.sext(idx, i64) if idxty.signed else b.zext(idx, i64)
        size = ctx.get_abi_sizeof(ctx.get_data_type(aty.dtype))
        return b.add(b.ptrtoint(a.data, i64), b.mul(idx, ir.Constant(i64, size)))

    def shared_address(context, builder, aryty, ary, idxty, idx):
        """32-bit shared-window address of element idx of a 1-D shared array (32-bit math: fewer registers)."""
        arr = context.make_array(aryty)(context, builder, value=ary)
        i64, i32 = ir.IntType(64), ir.IntType(32)
        cvta = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
        base = builder.trunc(builder.call(cvta, [builder.ptrtoint(arr.data, i64)]), i32)
        i = context.cast(builder, idx, idxty, types.int32)
        size = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        return builder.add(base, builder.mul(i, ir.Constant(i32, size)))

    def _make_load(words, hint="", space=".nc"):
        ordered = space != ".nc"     # not reorderable across barriers/fences: it reads data this kernel writes
        regs = ",".join(f"${k}" for k in range(words))
        vec = f".v{words}" if words > 1 else ""
        asm = (f"ld.global{space}{hint}{vec}.u32 {{{regs}}}, [${words}];" if words > 1
               else f"ld.global{space}{hint}.u32 $0, [$1];")
        cons = ",".join(["=r"] * words) + ",l"

        @intrinsic
        def load(typingctx, arr, idx):
            if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
                return None
            ret = types.UniTuple(types.uint32, words) if words > 1 else types.uint32
            sig = ret(arr, idx)

            def codegen(ctx, b, sig, args):
                addr = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
                i32 = ir.IntType(32)
                if words == 1:
                    fn = ir.FunctionType(i32, [ir.IntType(64)])
                    return b.call(ir.InlineAsm(fn, asm, cons, side_effect=ordered), [addr])
                fn = ir.FunctionType(ir.LiteralStructType([i32] * words), [ir.IntType(64)])
                r = b.call(ir.InlineAsm(fn, asm, cons, side_effect=ordered), [addr])
                return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, k) for k in range(words)])
            return sig, codegen
        return load

    ld16 = _make_load(4)
    ld16.__doc__ = "Four uint32 words from flat element i of a contiguous array: one ld.global.nc.v4 (16 B aligned)."
    ld8 = _make_load(2)
    ld4 = _make_load(1)
    ld16_pf = _make_load(4, ".L2::256B")    # same, asking L2 to fetch the surrounding 256 bytes
    ld4_l2 = _make_load(1, space=".cg")     # one word cached at L2 only: sees other blocks' writes of this kernel

    _BF16_OR_F32 = (types.float32, types.uint16)

    def _make_quad_load(space):
        """ld_quad: four values from flat element idx of a float32 array (one 16-byte load) or of a
        bf16 (uint16 bits) one (one 8-byte load, widened) -> their float32 bit patterns as four uint32."""
        @intrinsic
        def load(typingctx, arr, idx):
            if not (isinstance(arr, types.Array) and arr.dtype in _BF16_OR_F32 and isinstance(idx, types.Integer)):
                return None
            sig, bf = types.UniTuple(types.uint32, 4)(arr, idx), arr.dtype == types.uint16
            words = 2 if bf else 4
            regs = ",".join(f"${k}" for k in range(words))
            asm = f"ld.global{space}.v{words}.u32 {{{regs}}}, [${words}];"

            def codegen(ctx, b, sig, args):
                addr = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
                i32 = ir.IntType(32)
                fn = ir.FunctionType(ir.LiteralStructType([i32] * words), [ir.IntType(64)])
                r = b.call(ir.InlineAsm(fn, asm, ",".join(["=r"] * words) + ",l", side_effect=space != ".nc"),
                           [addr])
                w = [b.extract_value(r, k) for k in range(words)]
                if bf:                            # word k holds values 2k (low half) and 2k + 1 (high half)
                    hi = ir.Constant(i32, 0xFFFF0000)
                    w = [f(x) for x in w for f in (lambda x: b.shl(x, ir.Constant(i32, 16)),
                                                   lambda x: b.and_(x, hi))]
                return ctx.make_tuple(b, sig.return_type, w)
            return sig, codegen
        return load

    ld_quad = _make_quad_load(".nc")

    @intrinsic
    def st_quad(typingctx, arr, idx, w0, w1, w2, w3):
        """Four float32 (bit patterns as uint32) -> flat elements idx .. idx + 3 of a float32 array (one 16-byte
        store) or of a bf16 (uint16 bits) one, rounded to nearest even (one 8-byte store)."""
        if not (isinstance(arr, types.Array) and arr.dtype in _BF16_OR_F32):
            return None
        sig, bf = types.void(arr, idx, w0, w1, w2, w3), arr.dtype == types.uint16
        asm = ("{ .reg .b32 p, q; cvt.rn.bf16x2.f32 p, $2, $1; cvt.rn.bf16x2.f32 q, $4, $3; "
               "st.global.v2.u32 [$0], {p, q}; }" if bf else "st.global.v4.u32 [$0], {$1, $2, $3, $4};")

        def codegen(ctx, b, sig, args):
            addr = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
            words = [ctx.cast(b, v, ty, types.uint32) for v, ty in zip(args[2:], sig.args[2:])]
            vty = ir.FloatType() if bf else ir.IntType(32)
            vals = [b.bitcast(w, vty) for w in words]
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [vty] * 4)
            cons = "l," + ",".join(["f" if bf else "r"] * 4) + ",~{memory}"
            b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), [addr] + vals)
        return sig, codegen

    @intrinsic
    def st16(typingctx, arr, idx, w0, w1, w2, w3):
        """Four uint32 words -> flat element idx of a contiguous global array: one st.global.v4 (16 B aligned)."""
        sig = types.void(arr, idx, w0, w1, w2, w3)

        def codegen(ctx, b, sig, args):
            addr = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
            words = [ctx.cast(b, v, ty, types.uint32) for v, ty in zip(args[2:], sig.args[2:])]
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] + [ir.IntType(32)] * 4)
            b.call(ir.InlineAsm(fn, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}",
                                side_effect=True), [addr] + words)
        return sig, codegen

    def smem_load4(op, clobber=True):
        """An intrinsic (1-D shared array, element idx) -> four uint32 from the PTX `op {$0..$3}, [addr]` on the
        element's 32-bit shared address; clobber: it also orders memory (a plain load of data this kernel writes)."""
        asm = op + " {$0, $1, $2, $3}, [$4];"
        cons = "=r,=r,=r,=r,r" + (",~{memory}" if clobber else "")

        @intrinsic
        def load(typingctx, arr, idx):
            sig = types.UniTuple(types.uint32, 4)(arr, idx)

            def codegen(ctx, b, sig, args):
                addr = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
                i32 = ir.IntType(32)
                fn = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                r = b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), [addr])
                return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, k) for k in range(4)])
            return sig, codegen
        return load

    lds16 = smem_load4("ld.shared.v4.u32")
    lds16.__doc__ = "Four uint32 words from element idx of a 1-D shared array: one ld.shared.v4 (16 B aligned)."

    @intrinsic
    def sts8(typingctx, arr, idx, v0, v1):
        """Two float32 -> elements idx, idx + 1 of a 1-D float32 shared array: one st.shared.v2 (8 B aligned)."""
        sig = types.void(arr, idx, v0, v1)

        def codegen(ctx, b, sig, args):
            addr = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
            vals = [ctx.cast(b, v, ty, types.float32) for v, ty in zip(args[2:], sig.args[2:])]
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.FloatType(), ir.FloatType()])
            b.call(ir.InlineAsm(fn, "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f,~{memory}", side_effect=True),
                   [addr] + vals)
        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, arr, idx):
        """prefetch.global.L2 of flat element idx of a contiguous array (no register held)."""
        sig = types.void(arr, idx)

        def codegen(ctx, b, sig, args):
            addr = element_address(ctx, b, sig.args[0], args[0], args[1], sig.args[1])
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)])
            b.call(ir.InlineAsm(fn, "prefetch.global.L2 [$0];", "l", side_effect=True), [addr])
        return sig, codegen

    def barrier_op(asm):
        """A no-argument PTX statement that orders memory (side effect, memory clobber)."""
        @intrinsic
        def op(typingctx):
            def codegen(ctx, b, sig, args):
                b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), asm, "~{memory}", side_effect=True), [])
            return types.void(), codegen
        return op

    cp_commit = barrier_op("cp.async.commit_group;")
    _launch_dependents = barrier_op("griddepcontrol.launch_dependents;")
    _wait_previous = barrier_op("griddepcontrol.wait;")

    @intrinsic
    def grid_dep(typingctx):
        """A kernel's first statement (kernel()): with PDL on when the kernel is compiled, wait for the previous
        kernel to finish and its writes to be visible; nothing with PDL off. A no-op without the launch attribute."""
        def codegen(ctx, b, sig, args):
            for asm in ["griddepcontrol.wait;"] if PDL else []:
                b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), asm, "~{memory}", side_effect=True), [])
        return types.void(), codegen

    def cp_wait(n):
        """cp.async.wait_group n: all but this thread's n most recent groups have landed."""
        return barrier_op(f"cp.async.wait_group {n};")

    @intrinsic
    def timer_regs(typingctx):
        """(SM cycles, global ns, SM id) as u32 (the low halves of %clock64 and %globaltimer): phase stamps of a
        block (kernels/mla_wg.py MlaWgConfig.stamps); volatile, so not moved across the code it brackets."""
        sig = types.UniTuple(types.uint32, 3)()

        def codegen(ctx, b, sig, args):
            i32 = ir.IntType(32)
            fn = ir.FunctionType(ir.LiteralStructType([i32] * 3), [])
            asm = ("{ .reg .u64 c, g; mov.u64 c, %clock64; mov.u64 g, %globaltimer; cvt.u32.u64 $0, c; "
                   "cvt.u32.u64 $1, g; mov.u32 $2, %smid; }")
            r = b.call(ir.InlineAsm(fn, asm, "=r,=r,=r,~{memory}", side_effect=True), [])
            return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, k) for k in range(3)])
        return sig, codegen

    def asm_op(name, asm, cons, argtys, retty):
        """An intrinsic around one inline-PTX instruction; arguments are cast to `argtys` first."""
        def op(typingctx, *args):
            if len(args) != len(argtys):
                return None
            sig = retty(types.StarArgTuple(args))

            def codegen(ctx, b, sig, llargs):
                vals = [ctx.cast(b, b.extract_value(llargs[0], k), ty, want)
                        for k, (ty, want) in enumerate(zip(sig.args[0], argtys))]
                if isinstance(retty, types.UniTuple):
                    lty = ir.LiteralStructType([ctx.get_value_type(retty.dtype)] * retty.count)
                else:
                    lty = ctx.get_value_type(retty)
                fn = ir.FunctionType(lty, [ctx.get_value_type(t) for t in argtys])
                r = b.call(ir.InlineAsm(fn, asm, cons), vals)
                if isinstance(retty, types.UniTuple):
                    return ctx.make_tuple(b, retty, [b.extract_value(r, k) for k in range(retty.count)])
                return r
            return sig, codegen
        op.__name__ = op.__qualname__ = name
        return intrinsic(op)

    _u32, _f32 = types.uint32, types.float32
    as_f32 = asm_op("as_f32", "mov.b32 $0, $1;", "=f,r", [_u32], _f32)
    as_u32 = asm_op("as_u32", "mov.b32 $0, $1;", "=r,f", [_f32], _u32)
    # cvt packs its first source into the upper half: pass (hi, lo) to get lo in the low half
    cvt_pair = asm_op("cvt_pair", "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [_f32, _f32], _u32)
    fma_bf16x2 = asm_op("fma_bf16x2", "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [_u32] * 3, _u32)
    # (a & b) | c in one LOP3: written as `&` then `|`, ptxas emits two LOP3s when b and c are both constants
    # (one immediate per LOP3); here c is a register operand.
    lop3_and_or = asm_op("lop3_and_or", "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [_u32] * 3, _u32)
    mma_bf16 = asm_op(
        "mma_bf16",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [_u32] * 6 + [_f32] * 4, types.UniTuple(_f32, 4))

    @cuda.jit(device=True, forceinline=True)
    def pack_bf16x2(lo, hi):
        """Two float32 -> one word of two bf16 (round to nearest even), lo in the low half."""
        return cvt_pair(hi, lo)

    @cuda.jit(device=True, forceinline=True)
    def shfl_xor(value, mask):
        return cuda.shfl_xor_sync(FULL, value, mask)

    @cuda.jit(device=True, forceinline=True)
    def shfl_idx(value, src):
        return cuda.shfl_sync(FULL, value, src)

    @cuda.jit(device=True, forceinline=True)
    def lane_id():
        return int32(cuda.laneid)

    @cuda.jit(device=True, forceinline=True)
    def match_rank(value):
        """(lanes below this one holding the same value, lanes holding it): match.any and two popc."""
        m = cuda.match_any_sync(FULL, value)
        return int32(cuda.popc(m & cuda.lanemask_lt())), int32(cuda.popc(m))

    @cuda.jit(device=True, forceinline=True)
    def syncwarp():
        """Barrier of the warp's 32 lanes that also orders their shared and global memory accesses."""
        cuda.syncwarp(FULL)


# ---------------------------------------------------------------------------------------------------------------
# Helpers written once for both modes
# ---------------------------------------------------------------------------------------------------------------
@device
def stamp_point(arr, row, word):
    """Timeline stamp of a block: now's (SM cycles, global ns) at arr[row, word], arr[row, word + 1] (int32 bits of
    the low halves) -> the SM id. Used by kernels/mla_wg.py MlaWgConfig.stamps and kernels/moe.py ExpertConfig.stamps."""
    cyc, ns, sm = timer_regs()
    arr[row, word], arr[row, word + 1] = int32(cyc), int32(ns)
    return sm


@device
def bf16_lo(w):
    """Low bf16 of a word -> float32."""
    return as_f32(uint32(w) << uint32(16))


@device
def bf16_hi(w):
    """High bf16 of a word -> float32."""
    return as_f32(uint32(w) & uint32(0xFFFF0000))


@device
def bf16_f32(u16):
    """One bf16 (uint16 bits) -> float32."""
    return as_f32(uint32(u16) << uint32(16))


@device
def split_bf16x2(x0, x1):
    """(x0, x1) float32 -> (hi, lo) bf16 pairs with hi + lo = x to about 16 bits."""
    hi = pack_bf16x2(x0, x1)
    lo = pack_bf16x2(x0 - bf16_lo(hi), x1 - bf16_hi(hi))
    return hi, lo


@device
def int4_pair(q, shift):
    """Nibbles `shift/4` and `shift/4 + 4` of word q (u = q + 8 storage) -> bf16 pair of (u - 8), exact."""
    v = lop3_and_or(uint32(q) >> uint32(shift), uint32(0x000F000F), INT4_MAGIC)
    return fma_bf16x2(v, BF16_ONE2, INT4_OFFSET2)


@device
def warp_sum(v):
    """Sum over the 32 lanes (butterfly: every lane gets the total, same order on every lane)."""
    for m in (16, 8, 4, 2, 1):
        v += shfl_xor(v, int32(m))
    return v


@device
def warp_max(v):
    for m in (16, 8, 4, 2, 1):
        v = max(v, shfl_xor(v, int32(m)))
    return v


@device
def warp_argmax(v, i):
    """(value, index) of the largest v over the warp; lowest index among equals. Every lane gets the answer."""
    for m in (16, 8, 4, 2, 1):
        ov = shfl_xor(v, int32(m))
        oi = shfl_xor(i, int32(m))
        if ov > v or (ov == v and oi < i):
            v, i = ov, oi
    return v, i


@device
def block_scan(x, wsum, nw):
    """Inclusive prefix sum of int32 x over the block's nw warps of threads (nw = blockDim / 32 <= 32, a constant
    at the call: the fold over the warps unrolls) and the total; every thread must call it (barriers inside).
    wsum: int32 shared scratch, one per warp."""
    t = cuda.threadIdx.x
    lane, w = t & 31, t >> 5
    for off in (1, 2, 4, 8, 16):
        y = shfl_idx(x, int32(max(lane - off, 0)))
        if lane >= off:
            x += y
    if lane == 31:
        wsum[w] = x
    cuda.syncthreads()
    base, tot = int32(0), int32(0)
    for j in range(nw):
        s = wsum[j]
        tot += s
        if j < w:
            base += s
    cuda.syncthreads()
    return base + x, tot


@device
def block_sum(v):
    """Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total. Contains barriers:
    every thread of the block must call it."""
    sh = cuda.shared.array(32, float32)
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    v = warp_sum(v)
    if lane == 0:
        sh[warp] = v
    cuda.syncthreads()
    tot = F0
    for j in range(cuda.blockDim.x // 32):
        tot += sh[j]
    cuda.syncthreads()
    return tot


@device
def block_argmax(v, i):
    """(value, index) of the block's largest v, lowest index among equals; every thread gets it. Barriers inside."""
    shv = cuda.shared.array(32, float32)
    shi = cuda.shared.array(32, int32)
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    v, i = warp_argmax(v, i)
    if lane == 0:
        shv[warp], shi[warp] = v, i
    cuda.syncthreads()
    bv, bi = shv[0], shi[0]
    for j in range(1, cuda.blockDim.x // 32):
        if shv[j] > bv or (shv[j] == bv and shi[j] < bi):
            bv, bi = shv[j], shi[j]
    cuda.syncthreads()
    return bv, bi


