"""The CUDA simulator made usable for this package's kernels (NUMBA_ENABLE_CUDASIM=1): a lock around its
shared-array table, a block manager that sleeps instead of spinning, and the warp exchange the simulator twins of
kernels/device.py use (shuffles, mma fragments: the 32 threads of a warp meet at a barrier)."""
import threading
import weakref

import numpy as np

from numbaengine.env import SIM


def lock_sim_shared():
    """numba-cuda's simulator makes a block's static shared array when the first thread asks for it (one per source
    line), checking and filling its table without a lock: two threads arriving together could each get their own
    array (seen as a rare failure of the MoE routing plan, whose shared arrays every thread asks for at once). The
    same lookup, under a lock."""
    import sys

    from numba import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support
    if getattr(FakeCUDAShared.array, "locked", False):
        return
    lock, unlocked = threading.Lock(), FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:     # dynamic shared memory (one buffer), or the simulator's error
            return unlocked(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    array.locked = True
    FakeCUDAShared.array = array


def sleeping_block_manager():
    """Make numba-cuda's simulator wait for its block's threads instead of polling them: its BlockManager spins in
    the launching thread holding the GIL, so each wake-up of a simulated thread waits for the interpreter's switch
    interval (measured: one 32-lane shuffle 14 ms with the spinning manager, 1.3 ms with a sleeping one). Here the
    block counts its settled threads (blocked in syncthreads() or ended) under a condition, and the last one to
    settle (or one that failed) wakes the manager, which sleeps on it (a 10 ms timeout rechecks anyway). The same
    rules as numba's loop: an exception aborts every thread of the block and is re-raised; when every live thread
    is blocked, all are released. syncthreads() is this module's own: with numba's, which marks the thread blocked
    again after the mark here, a thread the manager released in between went on marked blocked, and the next
    barrier could open before it arrived."""
    from numba.cuda.simulator import kernel as K
    if getattr(K.BlockManager, "sleeping", False):
        return
    import inspect
    known = inspect.getsource(K.BlockThread) + inspect.getsource(K.BlockManager)
    if not all(name in known for name in ("syncthreads_blocked", "syncthreads_event", "abort", "exception",
                                          "_manager", "_block_dim", "_debug", "self._f")):
        return                 # a numba-cuda whose simulator differs from 0.30: keep its own (slower) manager
    changed = threading.Condition()

    class Thread(K.BlockThread):
        def run(self):
            try:
                super().run()
            finally:
                with changed:
                    self.done = True
                    self._manager.settled += 1
                    if self.exception or self._manager.settled == self._manager.threads:
                        changed.notify_all()

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            with changed:
                self.syncthreads_blocked = True
                self._manager.settled += 1
                if self._manager.settled == self._manager.threads:
                    changed.notify_all()
            self.syncthreads_event.wait()
            self.syncthreads_event.clear()
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        threads = [Thread(lambda: self._f(*args), self, grid_point, p, self._debug)
                   for p in np.ndindex(*self._block_dim)]
        self.threads, self.settled = len(threads), 0
        for t in threads:
            t.done = False
            t.start()
        with changed:
            while True:
                failed = next((t for t in threads if t.exception), None)
                if failed is not None:
                    for t in threads:
                        t.abort, t.syncthreads_blocked = True, False
                        t.syncthreads_event.set()
                    raise failed.exception[0].with_traceback(failed.exception[1])
                if self.settled == self.threads:
                    blocked = [t for t in threads if t.syncthreads_blocked]
                    if not blocked:                    # every thread ended
                        break
                    for t in blocked:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                    self.settled -= len(blocked)
                    continue
                changed.wait(0.01)
        for t in threads:
            t.join()

    K.BlockManager.run, K.BlockManager.sleeping = run, True


if SIM:
    lock_sim_shared()
    sleeping_block_manager()

# ---------------------------------------------------------------------------------------------------------------
# Simulator twins: warp exchange through a barrier per (block, warp)
# ---------------------------------------------------------------------------------------------------------------
_WARPS = weakref.WeakKeyDictionary()   # BlockManager -> {warp id: (barrier, slots)}
_WARPS_LOCK = threading.Lock()


class WarpBarrier:
    """threading.Barrier's wait for the lanes of a warp, each waiter asleep on a lock of its own: released, it runs
    on without taking a shared lock again (threading.Barrier's waiters all take its condition's lock in turn on
    wake-up). On a 2-core CPU: a 32-lane shuffle 0.7-0.9 ms against 1.6-2.2 ms; the CPU suite's simulator cases
    869 CPU s against 1,087 (`python -m pytest -q`: 10:30 against 12:34). A lane left waiting `timeout` seconds (a
    warp whose lanes diverged) raises BrokenBarrierError."""

    def __init__(self, n, timeout):
        self.n, self.timeout, self.count, self.lock, self.gates = n, timeout, 0, threading.Lock(), []

    def wait(self):
        with self.lock:
            self.count += 1
            if self.count == self.n:                   # the last lane: release the others
                gates, self.gates, self.count = self.gates, [], 0
            else:
                gate, gates = threading.Lock(), None
                gate.acquire()
                self.gates.append(gate)
        if gates is not None:
            for g in gates:
                g.release()
        elif not gate.acquire(timeout=self.timeout):
            raise threading.BrokenBarrierError(f"a warp's lanes did not all arrive within {self.timeout} s")


def _warp_state():
    """(this thread's warp state, its lane), kept on the thread after the first call (no shared lock per step)."""
    t = threading.current_thread()                      # the simulator's BlockThread
    state = getattr(t, "warp_state", None)
    if state is not None:
        return state
    nthreads = int(np.prod(t._manager._block_dim))
    warp, lane = divmod(t.thread_id, 32)
    with _WARPS_LOCK:
        per_block = _WARPS.setdefault(t._manager, {})
        if warp not in per_block:
            n = min(32, nthreads - 32 * warp)
            per_block[warp] = (WarpBarrier(n, timeout=300), ([None] * 32, [None] * 32), [(-1, None)] * 2,
                               [0] * 32, threading.Lock())
    t.warp_state = (per_block[warp], lane)
    return t.warp_state


def collective(value, fn):
    """Warp-collective step (simulator only): the first lane past the barrier applies fn to all lanes' values;
    every lane gets (result, lane). One barrier per call: calls alternate between two sets of slots, and a lane can
    only write a set again two calls later, after every lane has passed the barrier between (so has read it)."""
    (barrier, slots, result, calls, lock), lane = _warp_state()
    call = calls[lane]
    calls[lane] = call + 1
    k = call & 1
    slots[k][lane] = value
    barrier.wait()
    with lock:
        if result[k][0] != call:
            result[k] = (call, fn(list(slots[k])))
    return result[k][1], lane


def unwrap(arr):
    """The NumPy array behind a simulator kernel argument."""
    item = getattr(arr, "_item", arr)
    return getattr(item, "_ary", item)


def flat(arr):
    """Elements from a kernel argument's first one on, as the GPU's pointer arithmetic sees them: a view of the
    memory the array spans (a strided view's element offsets, computed from its strides, index it as on the GPU;
    reshape(-1) would copy it and index the copy)."""
    a = unwrap(arr)
    if a.flags.c_contiguous or a.size == 0:
        return a.reshape(-1)
    if min(a.strides) < 0:
        raise ValueError("simulator loads: negative strides are not supported")
    span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.strides)) // a.itemsize
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))


def bits_f32(u):
    return np.array(u, dtype=np.uint32).view(np.float32)[()]


def f32_bits(f):
    return np.array(f, dtype=np.float32).view(np.uint32)[()]


def bf16_rne(f):
    u = int(f32_bits(f))
    if np.isnan(f):
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def pair_f32(u):
    u = int(u)
    return np.float32(bits_f32(u << 16 & 0xFFFFFFFF)), np.float32(bits_f32(u & 0xFFFF0000))

