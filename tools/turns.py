"""Benchmark variants in child processes that compile at the same time and time one at a time.

A variant's kernels take ~35 s to compile (numba's Python-side typing and lowering, one core) and a second to
time, so a sweep of N variants in one process is mostly N compiles in a row. Here each variant runs in its own
process: all compile (warm) together, meet at a barrier, then take turns on the GPU under an exclusive file lock, so
no timing overlaps another process's GPU work. Use: the parent calls `run_children(cmds, folder)`; each child wraps
its timed part in `with turn(folder, index, count):` after its warm part.
"""
import contextlib
import fcntl
import os
import subprocess
import time

ABORT = "abort"


def _ready(folder, index):
    return os.path.join(folder, f"ready.{index}")


@contextlib.contextmanager
def turn(folder, index, count, timeout_s=3600.0, poll_s=0.2):
    """Mark child `index` of `count` warm, wait until all are (or a sibling failed: RuntimeError), then hold the
    folder's lock for the block."""
    open(_ready(folder, index), "w").close()
    t0 = time.time()
    while not all(os.path.exists(_ready(folder, i)) for i in range(count)):
        if os.path.exists(os.path.join(folder, ABORT)):
            raise RuntimeError(f"turns: a sibling of child {index} failed before its turn; not timing")
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"turns: child {index} waited {timeout_s:.0f} s for {count} siblings to warm up")
        time.sleep(poll_s)
    with open(os.path.join(folder, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_children(cmds, folder, timeout_s=None):
    """Start every command (argument lists; they inherit this process's stdout / stderr), wait for all; where one
    fails, the others waiting at the barrier give up (turn raises). Returns the exit codes in order."""
    os.makedirs(folder, exist_ok=True)
    procs = [subprocess.Popen(c) for c in cmds]
    codes = [None] * len(procs)
    t0 = time.time()
    while None in codes:
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i] = p.returncode
                if p.returncode:
                    open(os.path.join(folder, ABORT), "w").close()
        if timeout_s is not None and time.time() - t0 > timeout_s:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    p.kill()
                    codes[i] = p.wait()
            break
        time.sleep(0.1)
    return codes
