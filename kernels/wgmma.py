"""Warpgroup MMA (sm_90a `wgmma.mma_async`) from numba: the tensor-core path that reads both operands from shared
memory. mma.sync feeds every operand through registers, which is what caps the 64-head MLA at 24% of the mma.sync
roof (README, "Kernel performance"); FlashMLA's design rests on wgmma. numba-cuda compiles kernels for sm_90a on
Hopper (compute capability (9, 0, "a")), so the instruction is reachable through inline PTX.

A building block, checked against NumPy by `wgmma_tile` on a GPU (tests/test_wgmma.py, marked gpu; the simulator has
no twin: these helpers raise there). Layout used here: no swizzle, both operands K-major. A core matrix is 8 rows of
8 bf16 (16 bytes per row, 128 contiguous bytes); `smem_offset` places element (row, k) of a tile so that core
matrices adjacent in k are LBO bytes apart and those adjacent in rows SBO bytes apart. The accumulator of
m64nNk16 is spread like N/8 mma.sync D fragments per warp: warp w of the group holds rows 16w .. 16w + 15, and
register 4j + i of a thread (lane 4g + t) is (row 16w + g + 8 (i // 2), column 8j + 2t + i % 2).
"""
import numpy as np
from numba import cuda, float32, uint32

from kernels.device import SIM

LBO, SBO = 128, 256          # bytes between core matrices adjacent in k / in rows (a 16-wide k slab: 2 per row group)


def smem_offset(row, k):
    """Byte offset of element (row, k), k < 16, of a K-major bf16 tile in the no-swizzle core-matrix layout."""
    return (row // 8) * SBO + (k // 8) * LBO + (row % 8) * 16 + (k % 8) * 2


if SIM:
    def _no_twin(*args):
        raise NotImplementedError("wgmma has no simulator twin: run kernels/wgmma.py on an sm_90a GPU")

    wg_fence = wg_commit = wg_wait0 = fence_proxy_async = smem_desc = _no_twin

    def make_wgmma(N):
        return _no_twin
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kernels.device import _barrier_op as _statement      # a PTX statement that orders memory

    wg_fence = _statement("wgmma.fence.sync.aligned;")
    wg_commit = _statement("wgmma.commit_group.sync.aligned;")
    wg_wait0 = _statement("wgmma.wait_group.sync.aligned 0;")
    fence_proxy_async = _statement("fence.proxy.async.shared::cta;")   # generic-proxy smem writes -> wgmma reads

    @intrinsic
    def smem_desc(typingctx, sary, byte_off):
        """Matrix descriptor (u64) of the tile at byte_off of a shared array: start address >> 4 in bits 0-13, LBO
        >> 4 in 16-29, SBO >> 4 in 32-45, base offset 0, layout type 0 (no swizzle) in bits 62-63."""
        sig = types.uint64(sary, byte_off)

        def codegen(ctx, b, sig, args):
            arr = ctx.make_array(sig.args[0])(ctx, b, value=args[0])
            i64 = ir.IntType(64)
            cvta = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
            addr = b.add(b.call(cvta, [b.ptrtoint(arr.data, i64)]),
                         ctx.cast(b, args[1], sig.args[1], types.uint64))
            start = b.and_(b.lshr(addr, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF))
            fixed = ((LBO >> 4) << 16) | ((SBO >> 4) << 32)
            return b.or_(start, ir.Constant(i64, fixed))
        return sig, codegen

    _WGMMA = {}

    def make_wgmma(N):
        """wgmma(desc_a, desc_b, *acc) -> acc': D = A @ B^T + D for A 64x16 and B Nx16 (both K-major in shared
        memory), f32 accumulators (N/2 per thread, in and out), bf16 inputs. N % 8 == 0, 8 <= N <= 256."""
        if N in _WGMMA:
            return _WGMMA[N]
        if N % 8 or not 8 <= N <= 256:
            raise ValueError(f"wgmma: N = {N} is not a multiple of 8 in [8, 256]")
        nacc = N // 2
        regs = ",".join(f"${i}" for i in range(nacc))
        # scale-d is a predicate (1: D += A B); scale-a, scale-b = 1; no transpose (both operands K-major)
        asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${nacc + 2}, 0; wgmma.mma_async.sync.aligned.m64n{N}k16.f32.bf16.bf16"
               f" {{{regs}}}, ${nacc}, ${nacc + 1}, p, 1, 1, 0, 0; }}")
        cons = ",".join(["=f"] * nacc + ["l", "l", "r"] + [str(i) for i in range(nacc)])

        def typer(typingctx, desc_a, desc_b, *acc):
            if len(acc) != nacc:
                return None
            sig = types.UniTuple(types.float32, nacc)(desc_a, desc_b, *acc)

            def codegen(ctx, b, sig, args):
                f32 = ir.FloatType()
                one = ir.Constant(ir.IntType(32), 1)
                vals = [ctx.cast(b, args[i], sig.args[i], types.uint64) for i in (0, 1)] + [one]
                vals += [ctx.cast(b, v, t, types.float32) for v, t in zip(args[2:], sig.args[2:])]
                fn = ir.FunctionType(ir.LiteralStructType([f32] * nacc),
                                     [ir.IntType(64)] * 2 + [ir.IntType(32)] + [f32] * nacc)
                r = b.call(ir.InlineAsm(fn, asm, cons, side_effect=True), vals)
                return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, i) for i in range(nacc)])
            return sig, codegen
        params = ", ".join(f"a{i}" for i in range(nacc))
        ns = {"typer": typer}
        exec(f"def wgmma_m64n{N}(typingctx, desc_a, desc_b, {params}):\n"
             f"    return typer(typingctx, desc_a, desc_b, {params})", ns)
        _WGMMA[N] = intrinsic(ns[f"wgmma_m64n{N}"])
        return _WGMMA[N]


def wgmma_tile_kernel(N):
    """Kernel: one warpgroup (128 threads) computes d f32[64, N] = a @ b^T for a u16[64, 16], b u16[N, 16] (bf16
    bits): both tiles staged in shared memory in the core-matrix layout, one wgmma, the accumulators written out by
    the fragment layout above. Moves (64 + N) * 32 bytes in and 256 N out."""
    wgmma = make_wgmma(N)
    nacc, nsm = N // 2, (64 + N) * 8          # shared u32 words: A then B
    a_words = 64 * 8
    acc_args = ", ".join(f"acc[{i}]" for i in range(nacc))
    src = f'''
def wgmma_tile(a, b, d):
    sm = cuda.shared.array({nsm}, uint32)
    tid = cuda.threadIdx.x
    for i in range(tid, {nsm}, 128):             # word i: a bf16 pair of A (i < {a_words}) or of B
        j = i if i < {a_words} else i - {a_words}
        row, k = j // 8, 2 * (j % 8)
        src = a if i < {a_words} else b
        word = uint32(src[row, k]) | (uint32(src[row, k + 1]) << uint32(16))
        base = 0 if i < {a_words} else {a_words * 4}
        sm[(base + smem_offset(row, k)) // 4] = word
    fence_proxy_async()
    cuda.syncthreads()
    acc = cuda.local.array({nacc}, float32)
    for i in range({nacc}):
        acc[i] = float32(0)
    wg_fence()
    res = wgmma(smem_desc(sm, 0), smem_desc(sm, {a_words * 4}), {acc_args})
    wg_commit()
    wg_wait0()
    w, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    for i in range({nacc}):
        d[16 * w + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] = res[i]
'''
    ns = dict(cuda=cuda, uint32=uint32, float32=float32, smem_offset=cuda.jit(device=True)(smem_offset),
              fence_proxy_async=fence_proxy_async, wg_fence=wg_fence, wg_commit=wg_commit, wg_wait0=wg_wait0,
              smem_desc=smem_desc, wgmma=wgmma)
    exec(src, ns)
    return cuda.jit(ns["wgmma_tile"])


def wgmma_tile(a, b, N):
    """d = a @ b^T on the GPU through one wgmma (a u16[64, 16], b u16[N, 16] device arrays of bf16 bits)."""
    d = cuda.device_array((64, N), np.float32)
    wgmma_tile_kernel(N)[1, 128](a, b, d)
    return d
