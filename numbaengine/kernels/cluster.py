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
"""
from numbaengine.kernels.device import SIM

_MAX_CLUSTERS = {}


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


if SIM:
    def _no_twin(*args):
        raise NotImplementedError("thread-block clusters have no simulator twin (its blocks run one at a time): run "
                                  "kernels/cluster.py on a GPU")

    cluster_sync = dsmem_ld4 = dsmem_ld16 = _no_twin
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from numbaengine.kernels.device import barrier_op, shared_address

    cluster_sync = barrier_op("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;")

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
                addr = shared_address(ctx, b, sig.args[0], args[0], sig.args[1], args[1])
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
