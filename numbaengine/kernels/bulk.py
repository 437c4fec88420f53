"""Bulk copies global -> shared memory by the Hopper copy engine (cp.async.bulk), each stage completed on an mbarrier.

Why: a warp streaming weights through registers keeps only a few KB per SM in flight, too little to cover HBM
latency on the small decode GEMMs. A bulk copy of any multiple of 16 bytes holds no register; one lane per weight row
issues its row's piece of a stage, the stage's mbarrier counts the bytes (expect_tx by one lane) and flips its phase
when they have all landed. A ring of S such stages per warp has S - 1 stages in flight while the warp computes on one.

Protocol of one ring slot: init once (count 1, `mbar_init` + `mbar_fence_init` by one lane, then syncwarp); per use:
`mbar_expect(bars, i, bytes)` by one lane, syncwarp, `bulk_load(..., bars, i)` by the copying lanes; consumers
`mbar_wait(bars, i, parity)` with parity = (use count of the slot) & 1; a syncwarp after the last read of a slot
before it is refilled.
Tensor copies (TMA, `tensor_load_2d`): a box of a 2-D row-major tensor described by a tensor map (`tensor_map_2d`,
made once on the host and kept in device memory) lands in shared memory in the 128-byte-swizzle layout wgmma reads
(kernels/wgmma.py sw128_offset), completing on an mbarrier like a bulk copy; rows past the tensor's end land as zeros.
Simulator twins: a copy lands at once, the barrier operations are no-ops and `mbar_wait` is a barrier of the warp
(all 32 lanes of a warp wait together: the lanes run as unsynchronized threads there, so a lane could otherwise read
a row another lane has not copied yet).
"""
import numpy as np

from numbaengine.kernels.device import SIM, device, syncwarp


def tensor_map_2d(addr, rows, cols, box_rows, box_cols):
    """Tensor map (u64[16], host) of a row-major bf16 [rows, cols] tensor at device address addr, copied in boxes of
    box_rows x box_cols (box_cols * 2 = 128 bytes: one swizzle span) into the 128-byte-swizzle layout, L2 asked for
    256-byte lines, rows past the end read as zeros."""
    if box_cols != 64 or not 0 < box_rows <= 256 or addr % 16 or cols * 2 % 16:
        raise ValueError(f"tensor_map_2d: boxes of {box_rows} x {box_cols} bf16 (<= 256 rows, 64 columns), address "
                         f"{addr:#x} and row pitch {cols * 2} bytes (must be 16-byte aligned)")
    from cuda.bindings import driver as d
    err, tmap = d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, addr, [d.cuuint64_t(cols), d.cuuint64_t(rows)],
        [d.cuuint64_t(cols * 2)], [d.cuuint32_t(box_cols), d.cuuint32_t(box_rows)], [d.cuuint32_t(1)] * 2,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"tensor_map_2d: cuTensorMapEncodeTiled failed ({err}) for [{rows}, {cols}] at "
                           f"{addr:#x}, box [{box_rows}, {box_cols}]")
    return np.array([int(v) for v in tmap.opaque], np.uint64)


if SIM:
    def mbar_init(bars, i):
        bars[i] = 0

    def mbar_fence_init():
        pass

    def mbar_expect(bars, i, nbytes):
        pass

    def mbar_try_wait(bars, i, parity):
        return 1

    def mbar_wait(bars, i, parity):
        syncwarp()

    def tensor_load_2d(dst, di, tmap, x, y, bars, i):
        raise NotImplementedError("tensor_load_2d: TMA has no simulator twin (kernels/mla_wg.py runs on sm_90 only)")

    tensormap_acquire = tensor_load_2d

    def bulk_load(dst, di, src, si, nbytes, bars, i):
        """Simulator: nbytes from flat element si of the contiguous array src -> element di of the shared array dst;
        what the copy engine faults on (a size of 0 or not a multiple of 16, an unaligned end) is an error here."""
        src_at, dst_at = si * src.itemsize, di * dst.itemsize
        if nbytes <= 0 or nbytes % 16 or src_at % 16 or dst_at % 16:
            raise ValueError(f"bulk_load: {nbytes} bytes from byte {src_at} to shared byte {dst_at}: the size must be "
                             f"a positive multiple of 16 and both ends 16-byte aligned")
        s = src.reshape(src.size).view(np.uint8)[src_at:src_at + nbytes]
        dst.view(np.uint8)[dst_at:dst_at + nbytes] = s
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import element_address, shared_address

    def _bar_op(name, asm, nargs, ret=False):
        """An intrinsic on mbarrier bars[i] (a shared uint64 array) with nargs more u32 operands ($1.. in asm)."""
        def op(typingctx, bars, i, *more):
            if len(more) != nargs:
                return None
            sig = (types.uint32 if ret else types.void)(bars, i, types.StarArgTuple(more))

            def codegen(ctx, b, sig, args):
                i32 = ir.IntType(32)
                addr = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
                vals = [addr] + [ctx.cast(b, b.extract_value(args[2], k), ty, types.uint32)
                                 for k, ty in enumerate(sig.args[2])]
                fn = ir.FunctionType(i32 if ret else ir.VoidType(), [i32] * len(vals))
                cons = ("=r," if ret else "") + ",".join(["r"] * len(vals)) + ",~{memory}"
                return b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), vals)
            return sig, codegen
        op.__name__ = op.__qualname__ = name
        return intrinsic(op)

    mbar_init = _bar_op("mbar_init", "mbarrier.init.shared::cta.b64 [$0], 1;", 0)
    mbar_expect = _bar_op("mbar_expect", "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", 1)
    mbar_try_wait = _bar_op("mbar_try_wait", "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;"
                            " selp.u32 $0, 1, 0, p; }", 1, ret=True)

    @intrinsic
    def mbar_fence_init(typingctx):
        """Make mbarrier.init visible to the copy engine (the async proxy) before any copy completes on it."""
        def codegen(ctx, b, sig, args):
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "fence.mbarrier_init.release.cluster;",
                                "~{memory}", side_effect=True), [])
        return types.void(), codegen

    @intrinsic
    def bulk_load(typingctx, dst, di, src, si, nbytes, bars, i):
        """cp.async.bulk of nbytes (multiple of 16) from flat element si of the contiguous global array src to element
        di of the shared array dst (both 16-byte aligned), completing on mbarrier bars[i]."""
        sig = types.void(dst, di, src, si, nbytes, bars, i)

        def codegen(ctx, b, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            d = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
            g = element_address(ctx, b, sig.args[2], args[2], args[3], sig.args[3])
            n = ctx.cast(b, args[4], sig.args[4], types.uint32)
            m = shared_address(ctx, b, sig.args[5], args[5], sig.args[6], args[6])
            asm = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                   "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [ga], $2, [$3]; }")
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32]), asm, "r,l,r,r,~{memory}",
                                side_effect=True), [d, g, n, m])
        return sig, codegen

    @intrinsic
    def tensor_load_2d(typingctx, dst, di, tmap, x, y, bars, i):
        """TMA: the box at column x, row y of the tensor map held in the global u64 array tmap (64-byte aligned) ->
        element di of the shared array dst (1024-byte aligned for the 128-byte swizzle), completing on mbarrier
        bars[i] (`tensormap_acquire(tmap)` once before the first)."""
        sig = types.void(dst, di, tmap, x, y, bars, i)

        def codegen(ctx, b, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            dd = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
            g = element_address(ctx, b, sig.args[2], args[2], ir.Constant(i32, 0), types.int32)
            xv = ctx.cast(b, args[3], sig.args[3], types.int32)
            yv = ctx.cast(b, args[4], sig.args[4], types.int32)
            m = shared_address(ctx, b, sig.args[5], args[5], sig.args[6], args[6])
            asm = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[$0], [$1, {$2, $3}], [$4];")
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32, i32]), asm, "r,l,r,r,r,~{memory}",
                                side_effect=True), [dd, g, xv, yv, m])
        return sig, codegen

    @intrinsic
    def tensormap_acquire(typingctx, tmap):
        """Order this thread's later tensor copies after the host's write of the tensor map in global memory (no
        stale copy of an earlier map at that address in the descriptor cache)."""
        def codegen(ctx, b, sig, args):
            g = element_address(ctx, b, sig.args[0], args[0], ir.Constant(ir.IntType(32), 0), types.int32)
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                                "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l,~{memory}",
                                side_effect=True), [g])
        return types.void(tmap), codegen

    @device
    def mbar_wait(bars, i, parity):
        """Spin until the phase of mbarrier bars[i] with this parity has completed (its stage's bytes landed)."""
        while mbar_try_wait(bars, i, parity) == 0:
            pass

