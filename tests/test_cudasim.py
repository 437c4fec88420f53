"""The simulator harness itself (tests/cudasim.py, kernels/device.py's twins), run in a simulator child like every
module's cases: the sleeping block manager keeps numba's rules (syncthreads releases when every live thread waits,
threads that returned do not count, an exception in one thread aborts the block and reaches the launcher), and the
one-barrier warp collectives give every lane the right values call after call (two slot sets in turn)."""
import numpy as np
from cudasim import simulator_test
from numba import (
    cuda,  # module level: the simulator swaps a kernel's global `cuda` for its fake module
)


def _kernels():
    from numbaengine.kernels.device import lane_id, shfl_idx, shfl_xor

    @cuda.jit
    def neighbours(out, rounds):
        """Each round: write shared, barrier, read the next thread's value, barrier. Threads >= 48 return first."""
        sh = cuda.shared.array(64, np.float32)
        i = cuda.threadIdx.x
        if i >= 48:
            return
        v = np.float32(i)
        for _ in range(rounds):
            sh[i] = v
            cuda.syncthreads()
            v = sh[(i + 1) % 48] + np.float32(1)
            cuda.syncthreads()
        out[i] = v

    @cuda.jit
    def butterfly(x, out, rounds):
        """`rounds` warp sums by xor shuffles, each of fresh values, then a broadcast of lane 7's sum."""
        lane = lane_id()
        w = cuda.threadIdx.x // 32
        total = np.float32(0)
        for r in range(rounds):
            v = x[w * 32 + lane] * np.float32(r + 1)
            for m in (16, 8, 4, 2, 1):
                v += shfl_xor(v, m)
            total += v
        out[w * 32 + lane] = shfl_idx(total + np.float32(lane), 7)

    @cuda.jit
    def fails(out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        out[i + 2 * (i == 5) * out.shape[0]] = 1.0          # thread 5 indexes past the end
    return neighbours, butterfly, fails


def check_block_barriers(env):
    neighbours, _, _ = _kernels()
    out = np.full(64, np.nan, np.float32)
    neighbours[1, 64](out, 3)
    want = (np.arange(48) + 3) % 48 + 3                      # after 3 rounds: the value 3 threads on, plus 3
    assert (out[:48] == want).all() and np.isnan(out[48:]).all(), out


def check_warp_collectives(env):
    _, butterfly, _ = _kernels()
    x = np.random.default_rng().integers(-8, 8, 64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    butterfly[1, 64](x, out, 5)
    sums = x.reshape(2, 32).sum(1) * sum(range(1, 6))        # exact: small integers
    assert (out.reshape(2, 32) == (sums + 7)[:, None]).all(), out


def check_exception_reaches_launcher(env):
    _, _, fails = _kernels()
    try:
        fails[1, 32](np.zeros(32, np.float32))
    except IndexError as e:
        assert "tid=[5, 0, 0]" in str(e), e
    else:
        raise AssertionError("an out-of-bounds store in thread 5 did not raise")


def check_sleeping_manager_installed(env):
    from numba.cuda.simulator import kernel as K
    assert getattr(K.BlockManager, "sleeping", False), \
        "numba-cuda's simulator changed: cudasim.sleeping_block_manager kept numba's polling manager (suite ~2x slower)"


SIM_CASES = {"sleeping_manager_installed": check_sleeping_manager_installed, "block_barriers": check_block_barriers,
             "warp_collectives": check_warp_collectives, "exception_reaches_launcher": check_exception_reaches_launcher}
test_simulator = simulator_test(__name__)
