"""Warpgroup MMA (sm_90a `wgmma.mma_async`) from numba: the tensor-core path that reads both operands from shared
memory. mma.sync feeds every operand through registers, which is what caps the 64-head MLA at 24% of the mma.sync
roof (README, "Kernel performance"); FlashMLA's design rests on wgmma. numba-cuda compiles kernels for sm_90a on
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
from numba import cuda, float32, uint32, uint64

from kernels.device import SIM

LBO, SBO = 128, 256          # a 16-wide K-major tile (2 core matrices per row block): bytes between core matrices
#                              adjacent in k / in rows
MN_LBO_IS_K = True           # MN-major descriptors: LBO is the k stride (as for K-major), SBO the n stride


def core_offset(row, k, kcores):
    """Byte offset of element (row, k) of a bf16 tile laid out by row blocks of 8, each holding `kcores` core
    matrices (8 x 8) side by side: LBO = 128 along k, SBO = 128 kcores along rows."""
    return ((row >> 3) * kcores + (k >> 3)) * 128 + (row & 7) * 16 + (k & 7) * 2


def smem_offset(row, k):
    """Byte offset of element (row, k), k < 16, of a 16-wide K-major tile (LBO, SBO above)."""
    return core_offset(row, k, 2)


def mn_strides(k_stride, n_stride):
    """(LBO, SBO) of an MN-major operand whose core matrices are k_stride bytes apart along k, n_stride along n."""
    return (k_stride, n_stride) if MN_LBO_IS_K else (n_stride, k_stride)


if SIM:
    def _no_twin(*args):
        raise NotImplementedError("wgmma has no simulator twin: run kernels/wgmma.py on an sm_90a GPU")

    wg_fence = wg_commit = wg_wait0 = fence_proxy_async = smem_desc = _no_twin

    def make_desc(lbo, sbo):
        return _no_twin

    def make_wgmma(N, trans_b=False, accumulate=True):
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

    _DESC = {}

    def make_desc(lbo, sbo):
        """smem_desc(shared array, byte offset) -> u64 matrix descriptor: start address >> 4 in bits 0-13, lbo >> 4
        in 16-29, sbo >> 4 in 32-45, base offset 0, layout type 0 (no swizzle) in bits 62-63. Advancing the start
        by b bytes (16-aligned) is adding b >> 4."""
        if (lbo, sbo) in _DESC:
            return _DESC[lbo, sbo]
        if lbo % 16 or sbo % 16 or not (0 < lbo < 1 << 18 and 0 < sbo < 1 << 18):
            raise ValueError(f"make_desc: strides {lbo}, {sbo} are not 16-byte multiples below 256 KB")

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
                fixed = ((lbo >> 4) << 16) | ((sbo >> 4) << 32)
                return b.or_(start, ir.Constant(i64, fixed))
            return sig, codegen
        _DESC[lbo, sbo] = desc
        return desc

    smem_desc = make_desc(LBO, SBO)

    _WGMMA = {}

    def make_wgmma(N, trans_b=False, accumulate=True):
        """wgmma(desc_a, desc_b, *acc) -> acc': D = A @ B^T + D for A 64x16 and B Nx16 (both K-major in shared
        memory; trans_b: B is MN-major, the tile 16xN with n contiguous), f32 accumulators (N/2 per thread, in and
        out), bf16 inputs. accumulate=False: D = A B^T (the accumulators passed in are ignored). N % 8 == 0,
        8 <= N <= 256."""
        key = (N, trans_b, accumulate)
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

        def typer(typingctx, desc_a, desc_b, *acc):
            if len(acc) != nacc:
                return None
            sig = types.UniTuple(types.float32, nacc)(desc_a, desc_b, *acc)

            def codegen(ctx, b, sig, args):
                f32 = ir.FloatType()
                scale_d = ir.Constant(ir.IntType(32), int(accumulate))
                vals = [ctx.cast(b, args[i], sig.args[i], types.uint64) for i in (0, 1)] + [scale_d]
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
        _WGMMA[key] = intrinsic(ns[f"wgmma_m64n{N}"])
        return _WGMMA[key]


def wgmma_tile_kernel(N, K=16, trans_b=False, b_strides=None):
    """Kernel: one warpgroup (128 threads) computes d f32[64, N] = a @ b^T for a u16[64, K] and b u16[N, K] (bf16
    bits; trans_b: d = a @ b for b u16[K, N], MN-major): both tiles staged in shared memory by core_offset, K/16
    wgmmas (the first with accumulate=False), the accumulators written out by the fragment layout above.
    b_strides: B's (LBO, SBO), default the layout's (mn_strides for trans_b). Moves (64 + N) * 2K bytes in and 256 N
    out."""
    nacc, ak, bk = N // 2, K // 8, (N // 8 if trans_b else K // 8)    # core matrices per row block of A and of B
    a_words, b_rows = 64 * K // 2, K if trans_b else N
    lbo_b, sbo_b = b_strides or (mn_strides(128 * bk, 128) if trans_b else (128, 128 * bk))
    b_step = 256 * bk if trans_b else 256               # bytes between B's k16 steps (two core matrices along k)
    acc = ", ".join(f"c{i}" for i in range(nacc))
    calls = "\n".join(
        f"    {acc} = {'wg0' if ks == 0 else 'wg1'}(da + uint64({ks * 16}), db + uint64({ks * b_step // 16}), {acc})"
        for ks in range(K // 16))
    src = f'''
def wgmma_tile(a, b, d):
    sm = cuda.shared.array({a_words + b_rows * bk * 4}, uint32)
    tid = cuda.threadIdx.x
    for i in range(tid, {a_words + b_rows * bk * 4}, 128):    # word i: a bf16 pair of A (i < {a_words}) or of B
        j = i if i < {a_words} else i - {a_words}
        cols = {K} if i < {a_words} else {bk * 8}
        row, k = j // (cols // 2), 2 * (j % (cols // 2))
        src = a if i < {a_words} else b
        word = uint32(src[row, k]) | (uint32(src[row, k + 1]) << uint32(16))
        base = 0 if i < {a_words} else {a_words * 4}
        sm[(base + core_offset(row, k, cols // 8)) // 4] = word
    fence_proxy_async()
    cuda.syncthreads()
    {acc} = {", ".join(["float32(0)"] * nacc)}
    da, db = desc_a(sm, 0), desc_b(sm, {a_words * 4})
    wg_fence()
{calls}
    wg_commit()
    wg_wait0()
    res = ({acc},)
    w, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    for i in range({nacc}):
        d[16 * w + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] = res[i]
'''
    ns = dict(cuda=cuda, uint32=uint32, uint64=uint64, float32=float32, core_offset=cuda.jit(device=True)(core_offset),
              fence_proxy_async=fence_proxy_async, wg_fence=wg_fence, wg_commit=wg_commit, wg_wait0=wg_wait0,
              desc_a=make_desc(128, 128 * ak), desc_b=make_desc(lbo_b, sbo_b),
              wg0=make_wgmma(N, trans_b, accumulate=False), wg1=make_wgmma(N, trans_b))
    exec(src, ns)
    return cuda.jit(ns["wgmma_tile"])


def wgmma_tile(a, b, N, trans_b=False, b_strides=None):
    """d = a @ b^T (trans_b: a @ b) on the GPU through K/16 wgmmas (a u16[64, K], b u16[N, K] or u16[K, N] device
    arrays of bf16 bits)."""
    d = cuda.device_array((64, N), np.float32)
    wgmma_tile_kernel(N, a.shape[1], trans_b, b_strides)[1, 128](a, b, d)
    return d
