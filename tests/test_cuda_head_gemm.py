"""kernels.gemm.head_gemm (MLA's per-head products in one launch) against reference.head_gemm_ref: on the simulator
(tiny shapes, strided x/out views as the model passes them), on a GPU (K2 and default-model shapes, marked gpu), and
compiled for sm_90 on the CPU (no float64, no local memory)."""
import numpy as np
import pytest
from cuda_cases import assert_close, poisoned, rand_bf16
from cudasim import Env, f64_lines, ptx_or_skip, simulator_test
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

from numbaengine.kernels.gemm import HeadGemmConfig
from numbaengine.weights.dtypes import bf16_to_f32


def check_head_gemm(env, n, h, b, a, cfg=None, pad_x=32, pad_out=16, seed=0):
    """x = q[:, :, :a] of f32[n, h, a + pad_x], out = o[:, :, :b] of a poisoned f32[n, h, b + pad_out]: the
    padding columns must stay poisoned."""
    from numbaengine.kernels.gemm import (
        GemmWorkspace,
        head_gemm,
        head_gemm_workspace_words,
    )
    from numbaengine.reference import head_gemm_ref
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h, a + pad_x)).astype(np.float32)
    w = rand_bf16(rng, h, b, a)
    nxb, npart = head_gemm_workspace_words(n, h, b, a, cfg)
    ws = GemmWorkspace(poisoned(env, (max(nxb, 1),), np.uint32), poisoned(env, (max(npart, 1),), np.float32))
    o = poisoned(env, (n, h, b + pad_out), np.float32)
    head_gemm(env.dev(q)[:, :, :a], env.dev(w), o[:, :, :b], ws, cfg)
    got = env.host(o)
    if n * h * b * a <= 1 << 26:
        ref = head_gemm_ref(q[:, :, :a], w, np.empty((n, h, b), np.float32), transpose_w=True)
    else:    # the same product through batched BLAS (einsum takes seconds at n = 1040)
        ref = np.matmul(q[:, :, :a].transpose(1, 0, 2), bf16_to_f32(w).transpose(0, 2, 1)).transpose(1, 0, 2)
    scale = np.matmul(np.abs(q[:, :, :a]).transpose(1, 0, 2), np.abs(bf16_to_f32(w)).transpose(0, 2, 1)).max()
    assert_close(f"head_gemm n={n} h={h} b={b} a={a} {cfg}", got[:, :, :b], ref, 2e-5, scale)
    assert np.isnan(got[:, :, b:]).all(), "head_gemm wrote past the output view"


SIM_CASES = {
    "head_gemm_1token_strided": lambda env: check_head_gemm(env, 1, 3, 16, 32),
    "head_gemm_5tokens_2warp_rows": lambda env: check_head_gemm(env, 5, 3, 48, 64),
    "head_gemm_k_split_in_block": lambda env: check_head_gemm(env, 5, 3, 16, 64,
                                                              HeadGemmConfig(T=1, R=1, WR=1, WK=2)),
    "head_gemm_token_chunks_contiguous": lambda env: check_head_gemm(env, 9, 3, 48, 32,
                                                                     HeadGemmConfig(T=1, R=2, WR=2, WK=1, U=3),
                                                                     pad_x=0, pad_out=0),
}


test_simulator = simulator_test(__name__)


def test_ptx_head_gemm():
    """Every default cut's kernel compiles for sm_90 without float64 and with the accumulators in registers."""
    import re

    from numba import types as ty

    from numbaengine.kernels.gemm import HEAD_XS, _build_head_gemm, head_gemm_config
    sig = (ty.float32[:, :, :], ty.uint32[::1], ty.float32[:, :, :]) + (ty.int32,) * 7
    cuts = {(c.T, c.R, c.U, c.PF) for n in (1, 9, 17, 33) for c in [head_gemm_config(n, 64, 512, 128)]}
    for T, R, U, PF in sorted(cuts):
        ptx = ptx_or_skip(_build_head_gemm(T, R, HEAD_XS, U, PF).py_func, sig)
        assert not f64_lines(ptx), f"T={T} R={R}: float64 instructions:\n" + "\n".join(f64_lines(ptx)[:5])
        assert "mma.sync.aligned.m16n8k16" in ptx
        assert not re.search(r"\b(ld|st)\.local", ptx), f"T={T} R={R}: local memory"


# --- GPU ----------------------------------------------------------------------------------------------------------
HEAD_SHAPES = {"k2_w_uk": (64, 512, 128), "k2_w_uv": (64, 128, 512), "tp8_w_uk": (8, 512, 128),
               "tp8_w_uv": (8, 128, 512), "default_w_uk": (6, 128, 64), "default_w_uv": (6, 64, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 17, 33, 130, 1040])
@pytest.mark.parametrize("name", sorted(HEAD_SHAPES))
def test_gpu_head_gemm(name, n):
    h, b, a = HEAD_SHAPES[name]
    check_head_gemm(Env(gpu=True), n, h, b, a, pad_x=64)
