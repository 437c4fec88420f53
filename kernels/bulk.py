"""Bulk copies global -> shared memory by the Hopper copy engine (cp.async.bulk), each stage completed on an mbarrier.

Why: a warp streaming weights through registers keeps only a few KB per SM in flight, too little to cover HBM
latency on the small decode GEMMs. A bulk copy of any multiple of 16 bytes holds no register; one lane per weight row
issues its row's piece of a stage, the stage's mbarrier counts the bytes (expect_tx by one lane) and flips its phase
when they have all landed. A ring of S such stages per warp has S - 1 stages in flight while the warp computes on one.

Protocol of one ring slot: init once (count 1, `mbar_init` + `mbar_fence_init` by one lane, then syncwarp); per use:
`mbar_expect(bars, i, bytes)` by one lane, syncwarp, `bulk_load(..., bars, i)` by the copying lanes; consumers
`mbar_wait(bars, i, parity)` with parity = (use count of the slot) & 1; a syncwarp after the last read of a slot
before it is refilled.
Simulator twins: a copy lands at once, the barrier operations are no-ops and `mbar_wait` is a barrier of the warp
(all 32 lanes of a warp wait together: the lanes run as unsynchronized threads there, so a lane could otherwise read
a row another lane has not copied yet).
"""
import numpy as np

from kernels.device import SIM, device, syncwarp

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

    from kernels.device import _address, _smem_addr

    def _bar_op(name, asm, nargs, ret=False):
        """An intrinsic on mbarrier bars[i] (a shared uint64 array) with nargs more u32 operands ($1.. in asm)."""
        def typer(typingctx, bars, i, *more):
            sig = (types.uint32 if ret else types.void)(bars, i, *more)

            def codegen(ctx, b, sig, args):
                i32 = ir.IntType(32)
                addr = _smem_addr(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
                vals = [addr] + [ctx.cast(b, v, ty, types.uint32) for v, ty in zip(args[2:], sig.args[2:])]
                fn = ir.FunctionType(i32 if ret else ir.VoidType(), [i32] * len(vals))
                cons = ("=r," if ret else "") + ",".join(["r"] * len(vals)) + ",~{memory}"
                return b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), vals)
            return sig, codegen
        params = ", ".join(f"a{k}" for k in range(nargs))
        ns = {"typer": typer}
        exec(f"def {name}(typingctx, bars, i{', ' if nargs else ''}{params}):\n"
             f"    return typer(typingctx, bars, i{', ' if nargs else ''}{params})", ns)
        return intrinsic(ns[name])

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
            d = _smem_addr(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
            g = _address(ctx, b, sig.args[2], args[2], args[3], sig.args[3])
            n = ctx.cast(b, args[4], sig.args[4], types.uint32)
            m = _smem_addr(ctx, b, sig.args[5], args[5], sig.args[6], args[6])
            asm = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                   "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [ga], $2, [$3]; }")
            b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64, i32, i32]), asm, "r,l,r,r,~{memory}",
                                side_effect=True), [d, g, n, m])
        return sig, codegen

    @device
    def mbar_wait(bars, i, parity):
        """Spin until the phase of mbarrier bars[i] with this parity has completed (its stage's bytes landed)."""
        while mbar_try_wait(bars, i, parity) == 0:
            pass

