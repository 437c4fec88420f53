"""numba.cuda dense kernels (mma GEMM, RMSNorm, SiLU-mul, RoPE, argmax/top-k) against their reference ops: on the
simulator (a child process, tiny shapes, see tests/cudasim.py) and on a GPU (K2 shapes, marked gpu)."""
import cuda_cases as C
import numpy as np
import pytest
from cudasim import Env, simulator_test
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

from numbaengine.kernels.gemm import GemmConfig


def check_gemm_fused_reduce(env, m, n, k, cfg=None, calls=2, seed=0, xs=2):
    """The k-split partials added by the last block of each row range (ws.sync): right twice in a row, counters
    left at zero."""
    from numbaengine.kernels.gemm import (
        GemmWorkspace,
        gemm,
        gemm_sync_words,
        gemm_workspace_words,
    )
    from numbaengine.reference import gemm_ref
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = C.rand_bf16(rng, n, k)
    nxb, npart = gemm_workspace_words(m, n, k, xs, cfg)
    nsync = gemm_sync_words(m, n, k, cfg)
    assert nsync > 0, "no k split across blocks in this cut"
    ws = GemmWorkspace(C.poisoned(env, (max(nxb, 1),), np.uint32), C.poisoned(env, (npart,), np.float32),
                       env.zeros((nsync,), np.uint32))
    ref = gemm_ref(x, w, np.empty((m, n), np.float32))
    scale = (np.abs(x) @ np.abs(C.bf16_to_f32(w)).T).max()
    dx, dw = env.dev(x), env.dev(w)
    for call in range(calls):
        out = C.poisoned(env, (m, n), np.float32)
        gemm(dx, dw, out, ws, xs, cfg)
        C.assert_close(f"gemm fused reduce m={m} n={n} k={k} call {call}", env.host(out), ref,
                       2e-5 if xs == 2 else 4e-3, scale)
        assert not env.host(ws.sync).any(), "k-split counters not left at zero"

def check_ops_gemm_tall(env, m=73, n=16, k=64):
    """KernelOps.gemm on x taller than one block: contiguous x (one launch, row blocks) and a strided view (a
    launch per block) against gemm_ref."""
    from numbaengine.ops_cuda import sim_ops
    from numbaengine.reference import gemm_ref
    ops = sim_ops()
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((m, k + 32)).astype(np.float32)
    w = C.rand_bf16(rng, n, k)
    for x in (np.ascontiguousarray(wide[:, :k]), wide[:, :k]):
        out = C.poisoned(env, (m, n), np.float32)
        ops.gemm(x, w, out)                              # small weights: hi + lo parts (SMALL_XS)
        ref = gemm_ref(x, w, np.empty((m, n), np.float32))
        C.assert_close(f"ops.gemm m={m} contiguous={x.flags.c_contiguous}", env.host(out), ref, 2e-5,
                       (np.abs(x) @ np.abs(C.bf16_to_f32(w)).T).max())


def check_prep_wg_boxes(env):
    """prep_b tiled=3 (kernels/gemm_wg.py's B boxes): every bf16 of x at its swizzled place in its token block,
    rows past m repeating row m - 1, for one block (33 rows -> 40) and two (70 -> 2 x 40; 130 rows in blocks of at
    most 128: 2 x 72)."""
    from numbaengine.kernels.prep import prep_b, token_blocks, xb_words
    rng = np.random.default_rng(5)
    for m, k, nb_max in ((33, 128, 64), (70, 192, 64), (130, 128, 128)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        xb = C.poisoned(env, (xb_words(m, k, nb_max),), np.uint32)
        prep_b(env.dev(x), xb, 1, 0, tiled=3, nb_max=nb_max)
        nb, zb = token_blocks(m, nb_max)
        assert (nb, zb) == {33: (40, 1), 70: (40, 2), 130: (72, 2)}[m], (m, nb, zb)
        got = env.host(xb).view(np.uint16).reshape(zb, k // 64, nb, 8, 8)         # z, box, row, chunk, element
        r = np.arange(nb)
        rows = np.minimum(np.arange(zb)[:, None] * nb + r, m - 1)                  # [zb, nb] source rows
        want = C.f32_to_bf16(x[rows].reshape(zb, nb, k // 64, 8, 8)).transpose(0, 2, 1, 3, 4)
        unswizzled = got[:, :, r[:, None], np.arange(8)[None, :] ^ (r[:, None] % 8)]
        np.testing.assert_array_equal(unswizzled, want, err_msg=f"prep tiled=3 m={m} k={k}")


SIM_CASES = {
    "prep_wg_boxes_one_and_two_token_blocks": check_prep_wg_boxes,
    "shared_arrays_one_per_line": lambda env: C.check_shared_arrays(env),
    "gemm_2tiles_split_in_and_across_blocks": lambda env: C.check_gemm(env, 9, 40, 96, 2,
                                                                        GemmConfig(R=1, WR=1, WK=2, SB=2)),
    "gemm_bf16_activations_default_cut": lambda env: C.check_gemm(env, 3, 32, 64, 1),
    "gemm_small_weights_default_cut_3tiles": lambda env: C.check_gemm(env, 17, 32, 128, 2),
    "gemm_tall_x_2_row_blocks": lambda env: C.check_gemm(env, 73, 16, 64, 2, GemmConfig(R=1, WR=1, WK=1, SB=1)),
    "gemm_tall_x_split_reduce": lambda env: C.check_gemm(env, 70, 16, 64, 2, GemmConfig(R=1, WR=1, WK=1, SB=2, FR=0)),
    "gemm_65_rows_prepped_in_one_block": lambda env: C.check_gemm(env, 65, 16, 64, 2,
                                                                   GemmConfig(R=1, WR=1, WK=1, SB=1, BF=0)),
    "ops_gemm_tall_one_launch_and_strided_blocks": lambda env: check_ops_gemm_tall(env),
    "gemm_prep_launch_split": lambda env: C.check_gemm(env, 5, 32, 64, 2, GemmConfig(R=1, WR=1, WK=2, SB=2, BF=0)),
    "gemm_1token_tile_past_end_u_tail": lambda env: C.check_gemm(env, 1, 16, 128, 2,
                                                                  GemmConfig(R=2, WR=1, WK=1, SB=1, U=3)),
    "gemm_fused_reduce_2tiles_6splits": lambda env: check_gemm_fused_reduce(env, 9, 40, 224,
                                                                            GemmConfig(R=1, WR=1, WK=1, SB=6, MB=0)),
    "gemm_fused_reduce_prep": lambda env: check_gemm_fused_reduce(env, 5, 48, 128,
                                                                  GemmConfig(R=2, WR=1, WK=1, SB=2, BF=0)),
    "gemm_ring_wraps_2tiles": lambda env: C.check_gemm(env, 9, 40, 256, 2, GemmConfig(R=1, WR=1, WK=1, SB=1, S=3)),
    "gemm_ring_fewer_steps_than_stages": lambda env: C.check_gemm(env, 3, 32, 64, 2,
                                                                   GemmConfig(R=2, WR=1, WK=1, SB=1, S=4)),
    "gemm_ring_fused_reduce_split": lambda env: check_gemm_fused_reduce(env, 5, 48, 320,
                                                                        GemmConfig(R=2, WR=1, WK=2, SB=2, S=2)),
    "gemm_ring_prep_2warp_rows": lambda env: C.check_gemm(env, 9, 80, 160, 2,
                                                          GemmConfig(R=1, WR=2, WK=1, SB=1, BF=0, S=2)),
    "gemm_ring_b_in_ring_wraps": lambda env: C.check_gemm(env, 9, 40, 256, 2,
                                                          GemmConfig(R=1, WR=1, WK=1, SB=1, BF=0, S=3, RB=1)),
    "gemm_ring_b_in_ring_split_fused": lambda env: check_gemm_fused_reduce(env, 17, 32, 320, GemmConfig(
        R=2, WR=1, WK=2, SB=2, BF=0, S=2, RB=1)),
    "gemm_ring_b_in_ring_bf16_activations": lambda env: C.check_gemm(env, 17, 32, 320, 1, GemmConfig(
        R=2, WR=1, WK=1, SB=2, BF=0, MB=2, FR=0, S=2, RB=1)),    # the default cut of 3 tiles on large weights
    "rmsnorm": lambda env: C.check_norm(env, 3, 100, False),
    "add_rmsnorm": lambda env: C.check_norm(env, 3, 100, True),
    "add_rmsnorm_keep": lambda env: C.check_norm(env, 2, 70, "keep"),
    "rmsnorm_strided_in_place": C.check_norm_strided,
    "silu_mul": lambda env: C.check_silu_mul(env, 2, 70),
    "rope_interleaved": lambda env: C.check_rope(env, 3, 2, 8, 8, True),
    "rope_rotate_half": lambda env: C.check_rope(env, 3, 2, 8, 8, False),
    "qk_norm_rope_stacked": lambda env: C.check_qk_norm_rope(env, 2, 3, 1, 8, False),
    "qk_norm_rope_keys_only_interleaved": lambda env: C.check_qk_norm_rope(env, 2, 0, 2, 70, True),
    "argmax_topk": lambda env: C.check_argmax_topk(env, 2, 300, 4),
}


@pytest.mark.parametrize("T,R,BF,S,RB", [(1, 2, 1, 0, 0), (3, 2, 2, 0, 0), (5, 2, 1, 0, 0), (1, 2, 1, 4, 0),
                                         (3, 2, 2, 4, 0), (9, 1, 2, 3, 0), (3, 2, 2, 3, 1), (9, 1, 2, 2, 1)])
def test_ptx_gemm_fused_reduce(T, R, BF, S, RB):
    """The GEMM with the in-kernel k-split reduce (and the cp.async ring when S) compiles for sm_90: no float64,
    accumulators and weight fragments in registers."""
    import re

    from cudasim import f64_lines, ptx_or_skip
    from numba import types as ty

    from numbaengine.kernels.gemm import _build_gemm
    u32, f32 = ty.uint32[::1], ty.float32
    sig = ((f32[::1] if BF == 1 else u32), u32, f32[:, :], f32[:, :, :], u32) + (ty.int32,) * 5
    ptx = ptx_or_skip(_build_gemm(T, R, 2, 2, 1, BF, 1, (256, 2), S, RB).py_func, sig)
    assert not f64_lines(ptx), "float64 instructions:\n" + "\n".join(f64_lines(ptx)[:5])
    assert "mma.sync.aligned.m16n8k16" in ptx and "atom.global.add.u32" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory"
    assert ("cp.async.cg.shared.global" in ptx and "ld.shared.v4" in ptx) == bool(S)


test_simulator = simulator_test(__name__)


# --- GPU (K2 shapes) ----------------------------------------------------------------------------------------------
K2_GEMMS = {"q_a": (1536, 7168), "q_b": (12288, 1536), "kv_a": (576, 7168), "q_kv_a": (2112, 7168),
            "kv_b": (32768, 512), "o": (7168, 8192), "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 33, 65])
@pytest.mark.parametrize("over", [dict(S=0, RB=0), dict(S=4, RB=0), dict(S=3, RB=1), dict(S=2, RB=1),
                                  dict(S=3, RB=1, WR=4)], ids=str)
def test_gpu_gemm_cuts(over, m):
    """The cuts tools/bench_kernels.py tries, on q_kv_a and shared_down (k split in and across blocks) and kv_b
    (hi + lo parts)."""
    from dataclasses import replace

    from numbaengine.kernels.gemm import SMEM_MAX, gemm_config, gemm_smem, token_tiles
    for name in ("q_kv_a", "shared_down", "kv_b"):
        n, k = K2_GEMMS[name]
        cfg = replace(gemm_config(m, n, k), WG=0, **over)      # the mma path's cuts (not kernels/gemm_wg.py)
        T = token_tiles(m, cfg)
        if cfg.WR * cfg.WK <= 8 and gemm_smem(T, cfg, 2 * T * cfg.RB) <= SMEM_MAX:
            C.check_gemm(Env(gpu=True), m, n, k, 2, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 9, 17, 33, 65])
@pytest.mark.parametrize("name", sorted(K2_GEMMS))
def test_gpu_gemm(name, m):
    """The default cut with the default activations (bf16) and with hi + lo parts (the router's)."""
    n, k = K2_GEMMS[name]
    for xs in (1, 2):
        C.check_gemm(Env(gpu=True), m, n, k, xs)


def test_gemm_config_b_ring_rule():
    """gemm_config's B-in-ring cut (measured, kernels/gemm.py): 5 token tiles always, 3-4 tiles from RB_MIN_BYTES of
    weights, never at 1-2 tiles or on small weights; and its choice of activations."""
    from numbaengine.kernels.gemm import (
        RB_MIN_BYTES,
        RB_STAGES,
        SMALL_XS,
        XS_DEFAULT,
        gemm_config,
    )
    o, q_b = (7168, 8192), (12288, 1536)
    assert 2 * o[0] * o[1] >= RB_MIN_BYTES > 2 * q_b[0] * q_b[1]
    for m, (n, k), rb in [(17, o, 1), (25, o, 1), (33, o, 1), (17, q_b, 0), (33, q_b, 1), (40, q_b, 1), (9, o, 0),
                          (1, o, 0), (41, o, 0), (17, (384, 384), 0), (33, (384, 384), 0)]:
        cfg = gemm_config(m, n, k)
        assert cfg.RB == rb and (cfg.S == RB_STAGES or not rb), f"m={m} n={n} k={k}: {cfg}"
    # activations: bf16 on large weights, hi + lo parts on small ones (launch-bound: exactness costs no time there)
    assert gemm_config(17, *o).XS == XS_DEFAULT == 1 and gemm_config(1, 384, 384).XS == SMALL_XS == 2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 9, 17, 33])
@pytest.mark.parametrize("name", ["q_a", "kv_a", "q_b", "kv_b", "o", "shared_down"])
def test_gpu_gemm_fused_reduce(name, m):
    """The last-block k-split reduce on K2 shapes (kv_b's default cut has no split across blocks: forced to 2)."""
    from dataclasses import replace

    from numbaengine.kernels.gemm import gemm_config
    n, k = K2_GEMMS[name]
    cfg = gemm_config(m, n, k)
    check_gemm_fused_reduce(Env(gpu=True), m, n, k, replace(cfg, FR=1, SB=max(cfg.SB, 2), WG=0), calls=3)


# the shipped pair's projections (target and drafter): small weights, where launches cost more than bytes
PAIR_GEMMS = {"q_kv_a": (352, 384), "q_b": (576, 192), "o": (384, 384), "gate_up": (2048, 384), "down": (384, 1024),
              "shared_gate_up": (512, 384), "shared_down": (384, 256), "lm_head": (4096, 384), "d_kv": (128, 384)}


def test_gemm_tall_x_needs_the_fused_cut():
    """x taller than one GEMM block (72 rows) is read by the GEMM itself: a cut that would prep it is a clear
    error."""
    from numbaengine.kernels.gemm import GemmWorkspace, gemm
    x, w = np.zeros((73, 64), np.float32), np.zeros((16, 64), np.uint16)
    ws = GemmWorkspace(np.zeros(1, np.uint32), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="73 rows .* needs contiguous f32 x, BF=1"):
        gemm(x, w, np.zeros((73, 16), np.float32), ws, cfg=GemmConfig(R=1, WR=1, WK=1, SB=1, BF=0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 9, 17, 33, 48])
@pytest.mark.parametrize("over", [dict(), dict(R=2), dict(BF=0), dict(WK=1, WR=8), dict(WK=1, SB=3, FR=1),
                                  dict(WK=2, SB=2)], ids=str)
def test_gpu_gemm_small_weights_cuts(over, m):
    """On the pair's shapes: the small-weights cut of gemm_config (one launch, k split inside a block) and its
    neighbours (two row tiles per warp, prep launch, one warp along k, k split across blocks with the last-block or
    the launched reduce)."""
    from dataclasses import replace

    from numbaengine.kernels.gemm import gemm_config
    for name, (n, k) in PAIR_GEMMS.items():
        cfg = replace(gemm_config(m, n, k), **over)
        cfg = replace(cfg, WR=min(cfg.WR, 8 // cfg.WK))
        if cfg.FR and cfg.SB > 1:
            check_gemm_fused_reduce(Env(gpu=True), m, n, k, cfg, calls=3)
        else:
            C.check_gemm(Env(gpu=True), m, n, k, 2, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17])
def test_gpu_gemm_bf16_activations(m):
    C.check_gemm(Env(gpu=True), m, 4096, 7168, 1)


@pytest.mark.gpu
def test_gpu_gemm_odd_n():
    C.check_gemm(Env(gpu=True), 5, 1000, 256, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("add", [False, True, "keep"])
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
@pytest.mark.parametrize("nq,nk", [(6, 2), (0, 2), (32, 4), (12, 20)])
def test_gpu_qk_norm_rope(nq, nk):
    """The drafter's fused head norms + rope: the pair's 6+2 heads, keys alone (context rows), more heads than
    warps (32+4), d = 128."""
    C.check_qk_norm_rope(Env(gpu=True), 17, nq, nk, 128 if nq > 6 else 64, False)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1, 8), (17, 16)])
def test_gpu_argmax_topk(n, k):
    C.check_argmax_topk(Env(gpu=True), n, 163840, k)
