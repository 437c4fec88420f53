"""One process, every GPU of a host: a rank per device (its shard of the target, its own op table and
communicator) and a pool that runs the same function on every rank, each from its own thread (rank 0: the
caller's).

Why a thread per device: collectives of several GPUs issued from one thread can deadlock, so each device's eager
ops, its graph capture and its graph launches come from its own thread (CuPy releases the GIL while a graph
launches; ../shared/spec/GPU.md "NCCL"). Layout: numbaengine/parallel.py. Per layer, one all-reduce after attention
and one after the MoE block (Target.forward_into); lm_head is split by vocabulary and the slices are all-gathered,
so every rank holds the whole logits. Tree build, walk and commit are replicated: every rank runs the whole round
on inputs that are bitwise equal on every device (all-reduce and all-gather give every rank the same bits), so all
ranks commit the same tokens without a broadcast; the host reads rank 0's and checks that the others agree.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from numbaengine.reference import all_gather_cols


class NcclComm:
    """One rank's collectives over cupy.cuda.nccl, issued on CuPy's current stream (a captured round records them).
    Buffers are f32 and C-contiguous."""

    def __init__(self, comm, rank: int, size: int):
        self.comm, self.rank, self.size = comm, rank, size

    def all_reduce(self, x):
        """x f32 (any shape) <- the sum of every rank's x, in place."""
        import cupy
        from cupy.cuda import nccl
        _check_flat(x, "all_reduce")
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                            cupy.cuda.get_current_stream().ptr)
        return x

    def all_gather(self, part, buf):
        """buf f32[size, *part.shape] <- every rank's part, in rank order."""
        import cupy
        from cupy.cuda import nccl
        _check_flat(part, "all_gather")
        _check_flat(buf, "all_gather")
        self.comm.allGather(part.data.ptr, buf.data.ptr, part.size, nccl.NCCL_FLOAT32,
                            cupy.cuda.get_current_stream().ptr)
        return buf


def nccl_comms(devices) -> list:
    """One NcclComm per device of this process (NcclCommunicator.initAll)."""
    from cupy.cuda import nccl
    comms = nccl.NcclCommunicator.initAll(list(devices))
    return [NcclComm(c, r, len(devices)) for r, c in enumerate(comms)]


class ThreadComm:
    """The same collectives between the threads of one process on NumPy arrays: the stand-in for NCCL in CPU
    tests. Sums run in rank order, so every rank gets the same bits (as with NCCL)."""

    def __init__(self, group, rank: int):
        self.group, self.rank, self.size = group, rank, len(group.slots)

    @staticmethod
    def make(size: int) -> list:
        group = SimpleNamespace(slots=[None] * size, barrier=threading.Barrier(size, timeout=600))
        return [ThreadComm(group, r) for r in range(size)]

    def _exchange(self, x):
        self.group.slots[self.rank] = np.array(x, copy=True)
        self.group.barrier.wait()
        parts = list(self.group.slots)
        self.group.barrier.wait()                    # everyone has read the slots before they are reused
        return parts

    def all_reduce(self, x):
        parts = self._exchange(x)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        x[...] = total
        return x

    def all_gather(self, part, buf):
        for r, p in enumerate(self._exchange(part)):
            buf[r] = p
        return buf

    def abort(self):
        self.group.barrier.abort()


def _check_flat(a, what):
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{what}: needs a C-contiguous float32 buffer, got {a.dtype} strides {a.strides}")


class Ranks:
    """The devices an engine drives, their comms, and a thread per device. targets[r] and drafters[r] are rank r's
    Target (its shard) and drafter (replicated) once loaded."""

    def __init__(self, devices, comms, use_device: bool):
        self.devices, self.comms, self.use_device = list(devices), comms, use_device
        self.targets, self.drafters = [], []
        self._pool = ThreadPoolExecutor(max(len(self.devices) - 1, 1), thread_name_prefix="rank")

    @property
    def size(self) -> int:
        return len(self.devices)

    def _on_device(self, r, fn):
        if not self.use_device:
            return fn(r)
        import cupy
        with cupy.cuda.Device(self.devices[r]):
            return fn(r)

    def run(self, fn) -> list:
        """[fn(rank) for every rank], all at once, each on its own thread with its device current: rank 0 on the
        calling thread (always the same one: the engine's), the others on the pool's. An exception on one rank
        aborts the others' pending host-side collectives and is raised here."""
        def call(r):
            try:
                return self._on_device(r, fn)
            except BaseException as e:
                for c in self.comms:
                    getattr(c, "abort", lambda: None)()
                return _Failed(e)
        futures = [self._pool.submit(call, r) for r in range(1, self.size)]
        answers = [call(0)] + [f.result() for f in futures]
        errors = [a.error for a in answers if isinstance(a, _Failed)]
        if errors:                                   # the cause, not another rank's broken collective
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return answers

    def each(self, fn) -> list:
        """[fn(rank) for every rank], one after the other on this thread (loading: one shard in host memory at once)."""
        return [self._on_device(r, fn) for r in range(self.size)]


class _Failed:
    def __init__(self, error):
        self.error = error


def rank_ops(backend: str, comm):
    """The op table of one rank: the backend's table with this rank's all_reduce and all_gather."""
    if backend == "numpy":
        from numbaengine.backends import NUMPY
        ops = SimpleNamespace(**vars(NUMPY))
        ops.comm = comm
        ops.max_shards = 1
        ops.all_reduce = lambda parts: comm.all_reduce(_one(parts))
        ops.all_gather = lambda part, out: all_gather_cols(comm, part, out,
                                                           np.empty((comm.size,) + part.shape, np.float32))
        return ops
    from numbaengine.ops_cuda import cuda_ops, sim_ops
    return (cuda_ops if backend == "cuda" else sim_ops)(comm)


def _one(parts):
    if len(parts) != 1:
        raise ValueError(f"all_reduce: a rank holds one shard, got {len(parts)} partial results")
    return parts[0]


def check_devices(devices, backend: str) -> list:
    """The device list of Engine.load, checked: one-line errors for an empty list, repeats, or GPUs not present."""
    devices = [int(d) for d in devices]
    if not devices:
        raise ValueError("devices: need at least one device")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: {devices} lists a device twice")
    if backend == "cuda":
        import cupy
        present = cupy.cuda.runtime.getDeviceCount()
        missing = [d for d in devices if not 0 <= d < present]
        if missing:
            raise ValueError(f"devices: {devices} asks for GPU {missing[0]} but this host has {present} GPU(s)")
    if backend == "sim" and len(devices) > 1:
        raise ValueError("devices: the CUDA simulator runs one rank (its kernels are not thread-safe); "
                         "use backend 'numpy' for a simulated layout of several devices")
    return devices


def load_ranks(cfg, model_dir, draft_dir, backend: str, devices, cache_dtype="bf16") -> Ranks:
    """Every rank's shard of the target (read from the checkpoint straight to its device, one rank at a time) and
    a replicated drafter, on `backend` (cuda: NCCL; numpy, sim: threads standing in for NCCL)."""
    from numbaengine.checkpoint import load_target_weights
    from numbaengine.drafter import load_drafter
    from numbaengine.model import Target
    from numbaengine.parallel import check_divisible
    from numbaengine.weights.shards import Checkpoint
    devices = check_devices(devices, backend)
    check_divisible(cfg, len(devices))
    comms = nccl_comms(devices) if backend == "cuda" else ThreadComm.make(len(devices))
    ranks, ckpt, n = Ranks(devices, comms, backend == "cuda"), Checkpoint(model_dir), len(devices)

    def load(r):
        ops = rank_ops(backend, comms[r])
        target = Target(cfg, [load_target_weights(cfg, ckpt, r, n)], ops, cache_dtype)
        return target, (load_drafter(draft_dir, target, ops) if draft_dir is not None else None)
    loaded = ranks.each(load)
    ranks.targets, ranks.drafters = [t for t, _ in loaded], [d for _, d in loaded]
    return ranks
