"""kernels/wgmma.py, the sm_90a warpgroup-MMA building block: its shared-memory layout and PTX on the CPU, one
wgmma against NumPy on a GPU (marked gpu; the simulator has no twin)."""
import re

import numpy as np
import pytest
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16


def test_smem_offset_core_matrices():
    """Each core matrix (8 rows x 8 bf16) is 128 contiguous bytes, rows 16 bytes apart; core matrices LBO apart
    along k and SBO apart along rows; a 64 x 16 tile fills [0, 2048) once."""
    from numbaengine.kernels.wgmma import LBO, SBO, core_offset
    offs = np.array([[core_offset(r, k, 2) for k in range(16)] for r in range(64)])
    assert sorted(offs.ravel().tolist()) == list(range(0, 2048, 2))
    assert (offs[:, 8:] - offs[:, :8] == LBO).all() and (offs[8:] - offs[:-8] == SBO).all()
    core = offs[8:16, 8:16]
    assert core.min() % 128 == 0 and core.max() - core.min() == 126 and (np.diff(core[:, 0]) == 16).all()


@pytest.mark.parametrize("N,K,trans_b,swizzle", [(8, 16, False, 0), (64, 64, True, 128)])   # the GPU test: the rest
def test_wgmma_ptx_sm90a(N, K, trans_b, swizzle):
    """The tile kernel compiles for sm_90a (numba-cuda's target on Hopper): one m64nNk16 wgmma with N/2
    accumulators, the async-proxy fence before it, no local memory; ptxas accepts it where the toolkit is
    installed, with no spill and the wgmma not serialized."""
    from cudasim import f64_lines, ptxas_check
    from numba import cuda
    from numba import types as ty

    from numbaengine.kernels.wgmma import wgmma_tile_kernel
    sig = (ty.uint16[:, :], ty.uint16[:, :], ty.float32[:, :])
    ptx = cuda.compile_ptx(wgmma_tile_kernel(N, K, trans_b, swizzle=swizzle).py_func, sig, cc=(9, 0, "a"))[0]
    assert re.search(r"\.target\s+sm_90a", ptx)
    ops = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{N}k16\.f32\.bf16\.bf16\s*\{{([^}}]*)\}}([^;]*);", ptx)
    assert len(ops) == K // 16 and all(len(o[0].split(",")) == N // 2 for o in ops), ops
    assert all(o[1].replace(" ", "").endswith(f",p,1,1,0,{int(trans_b)}") for o in ops), [o[1] for o in ops]
    assert "fence.proxy.async.shared::cta" in ptx and "wgmma.wait_group.sync.aligned 0" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx) and not f64_lines(ptx)
    ptxas_check(ptx)


def test_core_offset_blocks():
    """core_offset: row blocks of kcores core matrices, each 128 contiguous bytes; every element of a 24 x 40 tile
    once; LBO = 128 along k, SBO = 128 kcores along rows."""
    from numbaengine.kernels.wgmma import core_offset
    offs = np.array([[core_offset(r, k, 5) for k in range(40)] for r in range(24)])
    assert sorted(offs.ravel().tolist()) == list(range(0, 24 * 40 * 2, 2))
    assert (offs[:, 8:] - offs[:, :-8] == 128).all() and (offs[8:] - offs[:-8] == 640).all()


def test_sw128_offset_atoms():
    """sw128_offset: every element of a 32 x 128 tile once; 1024-byte atoms of 8 rows x 64 k; within a row the
    16-byte chunks permuted by row % 8 (8 rows of one chunk column hit 8 different bank groups)."""
    from numbaengine.kernels.wgmma import sw128_offset
    offs = np.array([[sw128_offset(r, k, 32) for k in range(128)] for r in range(32)])
    assert sorted(offs.ravel().tolist()) == list(range(0, 32 * 128 * 2, 2))
    assert (offs[8:, :] - offs[:-8, :] == 1024).all() and (offs[:, 64:] - offs[:, :64] == 32 * 128).all()
    chunks = (offs[:8, 0:64:8] % 128) // 16                       # chunk slot of chunk column c in row r
    assert all(sorted(chunks[:, c]) == list(range(8)) for c in range(8)), chunks


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,trans_b,swizzle", [(8, 16, False, 0), (64, 16, False, 0), (256, 16, False, 0),
                                                 (32, 64, False, 0), (64, 32, True, 0), (256, 48, True, 0),
                                                 (32, 128, False, 128), (64, 64, True, 128), (256, 32, True, 128)])
def test_gpu_wgmma_tile(N, K, trans_b, swizzle):
    """K/16 wgmmas (A 64xK from shared memory, B NxK K-major or KxN MN-major, no swizzle or 128-byte swizzle, f32
    accumulators, the first overwriting them) against NumPy on random bf16 tiles."""
    from numba import cuda

    from numbaengine.kernels.wgmma import wgmma_tile
    rng = np.random.default_rng()
    a = f32_to_bf16(rng.standard_normal((64, K)).astype(np.float32))
    b = f32_to_bf16(rng.standard_normal((K, N) if trans_b else (N, K)).astype(np.float32))
    got = wgmma_tile(cuda.to_device(a), cuda.to_device(b), N, trans_b, swizzle=swizzle).copy_to_host()
    bf = bf16_to_f32(b).astype(np.float64)
    want = bf16_to_f32(a).astype(np.float64) @ (bf if trans_b else bf.T)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), np.abs(got - want).max()


def test_wgmma_roof_kernel_ptx():
    """tools/bench_attention.py's wgmma roof kernel compiles for sm_90a: the m64n256k16 wgmma in its loop, the
    128 accumulators in registers."""
    from numba import cuda
    from numba import types as ty

    from tools.bench_attention import wgmma_loop_kernel
    ptx = cuda.compile_ptx(wgmma_loop_kernel(256, 8).py_func, (ty.float32[::1], ty.int64), cc=(9, 0, "a"))[0]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16") >= 1 and "wgmma.commit_group" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx), "accumulators in local memory"
