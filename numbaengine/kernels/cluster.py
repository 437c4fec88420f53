"""Thread-block clusters (sm_90): the blocks of one cluster run at once on one GPC and read each other's shared
memory (distributed shared memory, DSMEM) after a cluster barrier.

Why: the flash-decoding splits of one 64-head MLA row tile can merge inside the kernel. Each split block leaves its
partial O and (max, sum) in its own shared memory, the cluster barrier publishes them, and every block folds its
share of the rows from all the cluster's blocks straight into the output: no partials in global memory and no merge
launch (kernels/mla_wg.py). Launch such a kernel with `device.launch(..., cluster=dims)`.

Protocol: `cluster_sync()` by every thread of every block (release of this block's shared writes, acquire of the
others'), then `dsmem_ld4` / `dsmem_ld16` of any block's shared array by its rank in the cluster, then
`cluster_sync()` again before any block exits (its shared memory must outlive the others' reads).
The simulator has no twin (its blocks do not share memory): these raise there.
A cluster's blocks must all be resident together on one GPC, so fewer blocks may run at once than without clusters
(H200: 16 clusters of 8 blocks of 225 KB took 2x the time of 128 plain blocks); `max_clusters` asks the
driver's occupancy calculator how many fit.

Grid-wide groups (`group_barrier`, `group_leave`): where more blocks must merge than a cluster holds, the blocks
of a cooperative launch (`device.launch(..., coop=True)`: all resident at once, or the launch fails) meet at a
counter in global memory instead and read each other's partials at L2; `max_resident_blocks` says how many blocks
a launch may have for that.
"""
from numba import cuda

from numbaengine.kernels.device import SIM

_MAX_CLUSTERS = {}
_MAX_BLOCKS = {}


def max_clusters(cf, threads, smem, dims):
    """Clusters of dims = (x, y, z) blocks of `threads` threads and `smem` dynamic shared bytes of the compiled
    kernel cf (attention.raise_smem_limit's) that can be resident at once (cuOccupancyMaxActiveClusters), cached;
    0, with a warning, where the driver cannot tell."""
    key = (id(cf), threads, smem, tuple(dims))
    if key not in _MAX_CLUSTERS:
        from cuda.bindings import driver as d
        err, fn = d.cuKernelGetFunction(cf.handle)
        if err != d.CUresult.CUDA_SUCCESS:            # a module function already
            fn = cf.handle
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = dims
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = smem
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = dims
        cfg.attrs, cfg.numAttrs = [attr], 1
        err, n = d.cuOccupancyMaxActiveClusters(fn, cfg)
        if err != d.CUresult.CUDA_SUCCESS:       # the caller then runs without clusters (results are the same)
            import warnings
            warnings.warn(f"max_clusters: cuOccupancyMaxActiveClusters failed ({err}) for clusters of {dims} "
                          f"blocks of {threads} threads and {smem} shared bytes: counted as 0 (no clusters)")
            n = 0
        _MAX_CLUSTERS[key] = int(n)
    return _MAX_CLUSTERS[key]


def max_resident_blocks(cf, threads, smem):
    """Blocks of `threads` threads and `smem` dynamic shared bytes of the compiled kernel cf that the whole GPU holds
    at once (cuOccupancyMaxActiveBlocksPerMultiprocessor x SMs): the most a cooperative launch may have; 0, with a
    warning, where the driver cannot tell."""
    key = (id(cf), threads, smem)
    if key not in _MAX_BLOCKS:
        from cuda.bindings import driver as d
        err, fn = d.cuKernelGetFunction(cf.handle)
        if err != d.CUresult.CUDA_SUCCESS:
            fn = cf.handle
        err, n = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem)
        if err != d.CUresult.CUDA_SUCCESS:
            import warnings
            warnings.warn(f"max_resident_blocks: cuOccupancyMaxActiveBlocksPerMultiprocessor failed ({err}) for "
                          f"{threads} threads and {smem} shared bytes: counted as 0 (no grid-wide groups)")
            n = 0
        _MAX_BLOCKS[key] = int(n) * cf.device.MULTIPROCESSOR_COUNT
    return _MAX_BLOCKS[key]


if SIM:
    def _no_twin(*args):
        raise NotImplementedError("thread-block clusters and grid-wide groups have no simulator twin (its blocks run "
                                  "one at a time): run kernels/cluster.py on a GPU")

    cluster_sync = dsmem_ld4 = dsmem_ld16 = group_barrier = group_leave = _no_twin
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import _barrier_op, _smem_addr

    cluster_sync = _barrier_op("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;")

    def _dsmem_load(words):
        regs = ", ".join(f"${k}" for k in range(words))
        vec = f".v{words}" if words > 1 else ""
        asm = (f"{{ .reg .u32 ra; mapa.shared::cluster.u32 ra, ${words}, ${words + 1}; "
               f"ld.shared::cluster{vec}.u32 {{{regs}}}, [ra]; }}" if words > 1 else
               "{ .reg .u32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.u32 $0, [ra]; }")
        cons = ",".join(["=r"] * words) + ",r,r,~{memory}"

        @intrinsic
        def load(typingctx, arr, idx, rank):
            """`words` uint32 from element idx of the 1-D shared array arr in the cluster's block `rank`."""
            ret = types.UniTuple(types.uint32, words) if words > 1 else types.uint32
            sig = ret(arr, idx, rank)

            def codegen(ctx, b, sig, args):
                i32 = ir.IntType(32)
                addr = _smem_addr(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
                rk = ctx.cast(b, args[2], sig.args[2], types.uint32)
                lty = ir.LiteralStructType([i32] * words) if words > 1 else i32
                r = b.call(ir.InlineAsm(ir.FunctionType(lty, [i32, i32]), asm, cons, side_effect=True), [addr, rk])
                if words == 1:
                    return r
                return ctx.make_tuple(b, sig.return_type, [b.extract_value(r, k) for k in range(words)])
            return sig, codegen
        return load

    dsmem_ld4 = _dsmem_load(1)
    dsmem_ld16 = _dsmem_load(4)

    @cuda.jit(device=True, inline="always")
    def group_barrier(count, b, t, n):
        """The n blocks sharing the int32 counter count[b, t] (zero before) meet: every thread of each block calls
        it, then group_leave once it is done. They must be resident together (a cooperative launch): a block
        spins until the others have arrived. Global writes before it (any thread) are seen after it by L2 loads
        (ld.global.cg). Thread 0 alone fences, after the block barrier (CUTLASS's semaphore does the same)."""
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            cuda.threadfence()                    # the block's writes, before its arrival
            cuda.atomic.add(count, (b, t), 1)
            while cuda.atomic.add(count, (b, t), 0) < n:      # (an atomic: read at L2, never a stale copy)
                pass
            cuda.threadfence()                    # the others' writes, before this block's loads
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def group_leave(count, b, t, n):
        """After group_barrier (off its critical path): the last of the n blocks to leave puts count[b, t] back to
        zero, when every block is past its wait (what the next launch, or a graph replay, needs)."""
        if cuda.threadIdx.x == 0:
            if cuda.atomic.add(count, (b, t), 1) == 2 * n - 1:
                cuda.atomic.exch(count, (b, t), 0)
