"""numba.cuda dense kernels (mma GEMM, RMSNorm, SiLU-mul, RoPE, argmax/top-k) against their reference ops: on the
simulator (a child process, tiny shapes, see tests/cudasim.py) and on a GPU (K2 shapes, marked gpu)."""
import pytest

import cuda_cases as C
from cudasim import Env, simulate
from kernels.gemm import GemmConfig

SIM_CASES = {
    "gemm_2tiles_split_in_and_across_blocks": lambda env: C.check_gemm(env, 9, 40, 96, 2,
                                                                        GemmConfig(R=1, WR=1, WK=2, SB=2)),
    "gemm_bf16_activations_default_cut": lambda env: C.check_gemm(env, 3, 32, 64, 1),
    "gemm_prep_launch_split": lambda env: C.check_gemm(env, 5, 32, 64, 2, GemmConfig(R=1, WR=1, WK=2, SB=2, BF=0)),
    "gemm_1token_tile_past_end_u_tail": lambda env: C.check_gemm(env, 1, 16, 128, 2,
                                                                  GemmConfig(R=2, WR=1, WK=1, SB=1, U=3)),
    "rmsnorm": lambda env: C.check_norm(env, 3, 100, False),
    "add_rmsnorm": lambda env: C.check_norm(env, 3, 100, True),
    "rmsnorm_strided_in_place": C.check_norm_strided,
    "silu_mul": lambda env: C.check_silu_mul(env, 2, 70),
    "rope_interleaved": lambda env: C.check_rope(env, 3, 2, 8, 8, True),
    "rope_rotate_half": lambda env: C.check_rope(env, 3, 2, 8, 8, False),
    "argmax_topk": lambda env: C.check_argmax_topk(env, 2, 300, 4),
}


@pytest.fixture(scope="module")
def sim_results():
    return simulate("test_cuda_dense")


@pytest.mark.parametrize("case", sorted(SIM_CASES))
def test_simulator(sim_results, case):
    assert sim_results[case] == "", sim_results[case]


# --- GPU (K2 shapes) ----------------------------------------------------------------------------------------------
K2_GEMMS = {"q_a": (1536, 7168), "q_b": (12288, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512),
            "o": (7168, 8192), "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 9, 17, 33, 65])
@pytest.mark.parametrize("name", sorted(K2_GEMMS))
def test_gpu_gemm(name, m):
    n, k = K2_GEMMS[name]
    C.check_gemm(Env(gpu=True), m, n, k, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17])
def test_gpu_gemm_bf16_activations(m):
    C.check_gemm(Env(gpu=True), m, 4096, 7168, 1)


@pytest.mark.gpu
def test_gpu_gemm_odd_n():
    C.check_gemm(Env(gpu=True), 5, 1000, 256, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("add", [False, True])
def test_gpu_norm(add):
    C.check_norm(Env(gpu=True), 65, 7168, add)


@pytest.mark.gpu
def test_gpu_norm_strided():
    C.check_norm_strided(Env(gpu=True))


@pytest.mark.gpu
def test_gpu_silu_mul():
    C.check_silu_mul(Env(gpu=True), 17, 18432)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_rope(interleaved):
    C.check_rope(Env(gpu=True), 33, 64, 128, 64, interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1, 8), (17, 16)])
def test_gpu_argmax_topk(n, k):
    C.check_argmax_topk(Env(gpu=True), n, 163840, k)
