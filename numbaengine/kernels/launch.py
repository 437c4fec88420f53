"""Host side of the kernels: compiling (kernel(): PDL, the on-disk cache), launching on CuPy's current stream with
the launch attributes numba has no API for (PDL, clusters; dynamic shared memory above 48 KB), and the
array views and pointers the launchers pass."""
import contextlib
import threading

import numpy as np
from numba import cuda

from numbaengine.kernels import device as dev
from numbaengine.kernels.device import SIM


def kernel(**opts):
    """`cuda.jit` for kernels; drops the options the simulator does not know. A kernel's first statement is
    grid_dep(): with PDL this one waits until the previous kernel has finished and its writes are visible
    (griddepcontrol.wait; the next kernel launches as this one's blocks exit); nothing
    of the body (no read, no write) runs before the wait, so every ordering of a plain launch holds. launch() gives
    the PDL attribute only to kernels whose code calls grid_dep (tests/test_structure.py checks that every kernel of
    the package starts with it). Compiled kernels are kept on disk (kernels/cache.py)."""
    from numbaengine.kernels import cache as kernel_cache
    if SIM:
        return cuda.jit

    def deco(fn):
        k = kernel_cache.install(cuda.jit(**opts)(fn))
        code = fn.__code__                             # launch() gives the PDL attribute where it calls grid_dep
        k.grid_dep = bool(dev.PDL) and "grid_dep" in code.co_names + code.co_freevars
        return k
    return deco


_PDL_THREAD = threading.local()       # this thread's launch settings: .on (PDL, inside pdl()), .cluster


def _launch_config(*args, **kwargs):
    """numba.cuda.dispatcher's LaunchConfig, with programmatic_stream_serialization while this thread is in pdl(),
    and a thread-block cluster shape while it is in clusters() (cuda.core then counts the grid in clusters)."""
    if getattr(_PDL_THREAD, "on", False):
        kwargs["programmatic_stream_serialization"] = True
    dims = getattr(_PDL_THREAD, "cluster", None)
    if dims is not None:
        kwargs["grid"] = tuple(g // c for g, c in zip(kwargs["grid"], dims))
        kwargs["cluster"] = dims
    return _launch_config.orig(*args, **kwargs)


def _patch_launch_config():
    import numba.cuda.dispatcher as D
    if D.LaunchConfig is not _launch_config:
        _launch_config.orig, D.LaunchConfig = D.LaunchConfig, _launch_config


@contextlib.contextmanager
def _launch_flag(name, value):
    """Context: this thread's numba launches carry `value` as _launch_config's thread-local `name`."""
    _patch_launch_config()
    was = getattr(_PDL_THREAD, name, None)
    setattr(_PDL_THREAD, name, value)
    try:
        yield
    finally:
        setattr(_PDL_THREAD, name, was)


def pdl():
    """Context: numba's launches from this thread carry the PDL attribute. numba builds a cuda.core LaunchConfig per
    launch in numba.cuda.dispatcher; that name is replaced once by `_launch_config`, which adds the attribute while
    a thread-local flag is set, so ranks launching from several threads (numbaengine.devices) do not see each
    other's setting."""
    return _launch_flag("on", True)


def clusters(dims):
    """Context: numba's launches from this thread run as thread-block clusters of dims = (x, y, z) blocks (each
    grid dimension a multiple of its cluster dimension; blockIdx and gridDim still count blocks)."""
    return _launch_flag("cluster", tuple(dims))


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------
_STREAMS = {}


def current_stream():
    """numba's view of CuPy's current stream (so launches order with CuPy work and can be graph-captured);
    stream 0 under the simulator or without CuPy."""
    if SIM:
        return 0
    try:
        import cupy
    except ImportError:
        return 0
    ptr = cupy.cuda.get_current_stream().ptr
    if ptr not in _STREAMS:
        _STREAMS[ptr] = cuda.external_stream(ptr) if ptr else cuda.default_stream()
    return _STREAMS[ptr]


def launch(kern, grid, block, *args, shmem=0, cluster=None):
    """Launch `kern` on the current stream (cluster: thread-block cluster dims, GPU only). Arguments: numba device
    arrays (NumPy arrays under the simulator, used in place: no copies, so views with any strides and aliased outputs
    behave as on the GPU)."""
    if SIM:
        if cluster is not None:
            raise NotImplementedError("launch: thread-block clusters have no simulator twin")
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        args = [FakeCUDAArray(a) if isinstance(a, np.ndarray) and a.ndim > 0 else a for a in args]
        kern[grid, block, current_stream(), shmem](*args)
        return
    from numbaengine.kernels import cache as kernel_cache
    if kernel_cache.record_launch(kern, args):         # precompile's dry run: recorded, nothing runs
        return
    if cluster is not None:
        with clusters(cluster):
            launch(kern, grid, block, *args, shmem=shmem)
    elif dev.PDL and getattr(kern, "grid_dep", False):
        with pdl():
            kern[grid, block, current_stream(), shmem](*args)
    else:
        kern[grid, block, current_stream(), shmem](*args)



# --- compiled kernels, arrays and pointers ----------------------------------------------------------------------
_COMPILED = {}

def cached(builder, *key):
    """One compiled kernel per (builder, compile-time parameters)."""
    k = (builder.__name__,) + key
    if k not in _COMPILED:
        _COMPILED[k] = builder(*key)
    return _COMPILED[k]

_PLACEHOLDERS = {}

def placeholder(like, shape, dtype):
    """A small array standing in for an unused kernel argument, made once per (array kind, shape, dtype)."""
    key = (isinstance(like, np.ndarray), shape, np.dtype(dtype).str)
    if key not in _PLACEHOLDERS:
        a = np.zeros(shape, dtype)
        _PLACEHOLDERS[key] = a if key[0] else cuda.to_device(a)
    return _PLACEHOLDERS[key]

def strided(a, shape, strides):
    """A view of a with the given shape and element strides (no copy): NumPy, CuPy or numba device arrays."""
    nbytes = tuple(int(x) * a.dtype.itemsize for x in strides)
    if isinstance(a, np.ndarray):
        return np.lib.stride_tricks.as_strided(a, shape, nbytes)
    if hasattr(a, "gpu_data"):                                  # numba device array
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        return DeviceNDArray(shape, nbytes, a.dtype, gpu_data=a.gpu_data)
    import cupy
    return cupy.lib.stride_tricks.as_strided(a, shape, nbytes)

def elem_strides(a):
    return tuple(x // a.dtype.itemsize for x in a.strides)

def contiguous(a):
    """C-contiguous (numpy or numba device array)."""
    flags = getattr(a, "flags", None)
    return bool(flags["C_CONTIGUOUS"]) if flags is not None else a.is_c_contiguous()

def u32_words(a):
    """Contiguous array -> flat uint32 view (numpy or numba device array)."""
    return a.reshape(a.size).view(np.uint32)

def data_ptr(a):
    """Data pointer of a NumPy, CuPy or numba array."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return iface["data"][0]

def flat_span(a):
    """Simulator: the memory from a[0, ...] to its last element as a flat array (kernels address it by strides)."""
    span = sum((d - 1) * s for d, s in zip(a.shape, a.strides)) // a.itemsize + 1
    return np.lib.stride_tricks.as_strided(a, (span,), (a.itemsize,))

_SMEM_CF = {}       # (kernel, argument types, shared bytes, device) -> its compiled function, limit raised

def raise_smem_limit(kern, args, smem):
    """Raise `kern`'s dynamic shared memory limit to `smem` bytes where they and its static shared memory pass 48 KB
    (once per compiled overload; numba has no API for the attribute) -> the compiled function (GPU), None under the
    simulator. (A block of 36 KB dynamic and 14 KB static shared memory is refused at launch without it:
    CUDA_ERROR_INVALID_VALUE.)"""
    if SIM:
        return None
    types_ = tuple(kern.typeof_pyval(a) for a in args)
    key = (id(kern), types_, smem, cuda.get_current_device().id)      # (the attribute is set per device)
    if key not in _SMEM_CF:
        cf = kern.compile(types_)._codelibrary.get_cufunc()
        if smem + cf.attrs.shared > 48 * 1024:
            from numba.cuda.cudadrv.driver import binding, driver
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, smem, cf.handle, cf.device.id)
        _SMEM_CF[key] = cf
    return _SMEM_CF[key]

def launch_smem(kern, grid, threads, smem, args, cluster=None):
    """device.launch with `smem` bytes of dynamic shared memory (raise_smem_limit first), thread-block clusters of
    `cluster` blocks. In precompile's dry run the limit is left alone: raising it needs the compiled kernel, and
    waiting for each one's compile would make the dry run meet the next kernel only after it."""
    from numbaengine.kernels import cache as kernel_cache
    if not kernel_cache.dry_run():
        raise_smem_limit(kern, args, smem)
    launch(kern, grid, threads, *args, shmem=smem, cluster=cluster)
