"""numba.cuda router and MoE kernels (INT4 W4A16 and bf16 experts) against router_ref / moe_ref: on the simulator
(a child process, tiny shapes) and on a GPU (K2 shapes, marked gpu). Routing cases: random, an expert with no tokens,
all tokens on one expert (several work items for it), a shared-expert add."""
import cuda_cases as C
import numpy as np
import pytest
from cudasim import Env, simulator_test

from numbaengine.kernels.moe import ExpertConfig

SMALL = (ExpertConfig(R=1, WR=2, WK=2, T=1, blocks_per_sm=2), ExpertConfig(R=2, WR=1, WK=1, T=1, blocks_per_sm=2))
# gate_up through bulk rings (int4_bulk_tiles layout, R=2 tiles per chunk): 3 k-steps as 2 stages of U=2 (the
# second half full) through 2 slots, the ring running on across each block's units; down on the register path.
# Against moe_ref only (the register path twice as long under the simulator); the GPU cases also check its bits.
BULK = (ExpertConfig(R=2, WR=1, WK=1, T=1, U=2, S=2, blocks_per_sm=2), SMALL[1])
# gate_up through bulk rings with more warps along k than k-steps (H = 128: one step for WK = 2, the engine's cut on
# the tiny test models): the warp with no step must issue no (zero-byte) copy
BULK_WK2 = (ExpertConfig(R=2, WR=1, WK=2, T=1, U=2, S=2, blocks_per_sm=2), SMALL[1])
# token tiles (T = 2: items of up to 16 slots, each dequantized weight fragment applied to two 8-slot tiles): gate_up
# through the bulk rings, checked against moe_ref and bit for bit against the register path at the same T (one
# expert holds all 20 tokens: an item of 16 slots and one of 4)
TILES2 = (ExpertConfig(R=2, WR=1, WK=1, T=2, U=2, S=2, blocks_per_sm=2),
          ExpertConfig(R=2, WR=1, WK=1, T=2, blocks_per_sm=2))
STAMPED = (ExpertConfig(R=1, WR=1, WK=1, T=1, blocks_per_sm=2), ExpertConfig(R=1, WR=2, WK=1, T=1, blocks_per_sm=1))
SIM_CASES = {
    "moe_int4_bulk_warp_without_k_steps": lambda env: C.check_moe(env, 3, 128, 64, 4, 2, "random", cfgs=BULK_WK2,
                                                                  tiled=2, exact=False),
    "moe_int4_bulk_rings": lambda env: C.check_moe(env, 1, 384, 64, 2, 1, "random", cfgs=BULK, tiled=2,
                                                   exact=False),
    "moe_int4_random": lambda env: C.check_moe(env, 5, 128, 64, 4, 2, "random", cfgs=SMALL),
    "moe_int4_one_expert_two_items_shared": lambda env: C.check_moe(env, 9, 128, 64, 4, 2, "one_hot", cfgs=SMALL,
                                                                     shared=True),
    "moe_int4_unused_expert": lambda env: C.check_moe(env, 3, 128, 64, 4, 2, "skip", cfgs=SMALL),
    "moe_bf16_experts": lambda env: C.check_moe(env, 4, 128, 64, 4, 2, "random", int4=False, cfgs=SMALL),
    "moe_int4_expert_parallel_shard": lambda env: C.check_moe(env, 6, 128, 64, 8, 3, "random", cfgs=SMALL,
                                                              held=(4, 2), shared=True),
    "moe_int4_prep_2_blocks_per_row": lambda env: C.check_moe(env, 2, 512, 64, 4, 1, "random", cfgs=SMALL,
                                                              seed=3),
    "moe_int4_70_experts_plan_scans_3_warps": lambda env: C.check_moe(env, 3, 128, 64, 70, 2, "random",
                                                                      cfgs=SMALL, seed=5, warp_slots=0),
    "moe_int4_token_tiles_2": lambda env: C.check_moe(env, 20, 128, 64, 4, 2, "one_hot", cfgs=TILES2, tiled=2,
                                                      seed=13),
    # more units than blocks (4 per block at gate_up: 8 past STAMP_UNITS are counted only), both stages
    "moe_stamps": lambda env: C.check_moe_stamps(env, 3, 128, 64, 4, 2, STAMPED),
    "plan_warp_32_slots": lambda env: C.check_plan(env, 16, 40, 2, "one_hot", held=(0, 24), seed=6),  # 2 items
    "plan_warp_one_token_held": lambda env: C.check_plan(env, 1, 384, 8, "random", held=(100, 200), seed=7),
    "plan_block_33_slots": lambda env: C.check_plan(env, 11, 40, 3, "one_hot", held=(0, 32), seed=8),
    # 600 slots over two warps' segments of 320 and 280 (10 and 9 rounds of 32): counts, places, items
    "plan_block_segments": lambda env: C.check_plan(env, 150, 70, 4, "one_hot", held=(0, 70), warp_slots=0,
                                                    seed=11),
    "plan_block_forced_held": lambda env: C.check_plan(env, 5, 70, 4, "random", held=(8, 40), warp_slots=0, seed=9),
    "router_one_group_ragged_block": lambda env: C.check_router(env, 3, 64, 18, 4, 1, 1),   # 8 experts per block
    "router_grouped": lambda env: C.check_router(env, 3, 64, 16, 4, 4, 2),
    "router_passes_over_2_block_rows": lambda env: C.check_router(env, 5, 64, 16, 2, 1, 1, tokens_per_pass=2,
                                                                  token_blocks=2),
    "router_k_slices_uneven": lambda env: C.check_router(env, 2, 1096, 8, 2, 2, 1),       # 137 chunks in 5 slices
    "router_twin_experts_exact_ties": lambda env: C.check_router(env, 2, 64, 256, 8, 1, 1, twins=True),  # 8 warps
    "router_mma_logits": lambda env: C.check_router(env, 3, 64, 16, 4, 4, 2, mma="gemm"),
    "router_mma_through_the_op_table": lambda env: C.check_router(env, 5, 64, 16, 4, 1, 1, mma="ops"),
    "router_gemv_through_the_op_table": lambda env: C.check_router(env, 2, 64, 16, 4, 1, 1, mma="ops"),
    "router_two_chunks_per_lane": lambda env: C.check_router(env, 2, 512, 8, 2, 1, 1, k_slices=1),
    # more picks than the kept groups hold: the rest are dropped experts (-inf choices), lower index first
    "router_picks_past_the_kept_groups": lambda env: C.check_router(env, 2, 64, 16, 6, 4, 1, seed=2),
    # groups of one expert: a group scores its one choice
    "router_groups_of_one": lambda env: C.check_router(env, 1, 64, 16, 4, 16, 6, seed=3),
    "router_nan_row_picks_experts": lambda env: C.check_router(env, 2, 64, 16, 4, 1, 1, seed=4, nan_row=True),
}

SIM_COST = {"moe_int4_bulk_rings": 25, "moe_int4_token_tiles_2": 9, "moe_int4_prep_2_blocks_per_row": 30, "moe_stamps": 15,
            "moe_int4_70_experts_plan_scans_3_warps": 45,
            "router_twin_experts_exact_ties": 10, "router_mma_logits": 8,
            "router_mma_through_the_op_table": 11, "router_picks_past_the_kept_groups": 6}


test_simulator = simulator_test(__name__)


# --- GPU (K2 widths: H 7168, I 2048, top-8; 8-16 experts keep the NumPy reference quick) -----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n,n_exp,mode", [(1, 16, "random"), (17, 16, "skip"), (65, 8, "random")])
def test_gpu_moe_int4(n, n_exp, mode):
    C.check_moe(Env(gpu=True), n, 7168, 2048, n_exp, 8, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("n,mode,cfgs", [(1, "random", None), (17, "skip", None), (9, "one_hot", BULK)])
def test_gpu_moe_int4_bulk(n, mode, cfgs):
    """Bulk layout + rings at K2 widths: against moe_ref and bit for bit the register path."""
    C.check_moe(Env(gpu=True), n, 7168, 2048, 16, 8, mode, cfgs=cfgs, tiled=2)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 256])
def test_gpu_moe_int4_bulk_few_k_steps(hidden):
    """The engine's default cuts (bulk gate_up, WK = 2) where H has 1 or 2 k-steps: a warp with no step issues no
    copy (H = 128 faulted the tiny engine's prefill: CUDA_ERROR_LAUNCH_FAILED)."""
    C.check_moe(Env(gpu=True), 9, hidden, 64, 4, 2, "random", tiled=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 8])
def test_gpu_moe_int4_token_tiles(T):
    """Prompt-sized MoE at K2 widths (288 tokens, 16 experts: about 144 slots each) with T token tiles per item on
    the engine's layout, cut as kernels.moe.stage_cuts cuts T > 1: against moe_ref and bit for bit the register path
    at the same T (T = 8 spills registers: correct, not fast)."""
    from dataclasses import replace

    from numbaengine.kernels.moe import MOE_DEFAULT, default_cuts
    cuts = tuple(replace(c, T=T, min_blocks=2, blocks_per_sm=4) for c in default_cuts(MOE_DEFAULT.tiled))
    C.check_moe(Env(gpu=True), 288, 7168, 2048, 16, 8, "random", cfgs=cuts, tiled=MOE_DEFAULT.tiled, seed=T)


@pytest.mark.gpu
def test_gpu_plan_4096_tokens():
    """The routing plan of a 4,096-token K2 prompt (32,768 slots over 384 experts: every warp segment full)."""
    C.check_plan(Env(gpu=True), 4096, 384, 8, "random", seed=14)


def test_token_tiles_rule():
    """T is the fewest power-of-two tiles holding an expert's mean share of the slots, capped; both cuts take it."""
    from numbaengine.kernels.moe import (
        DeviceExperts,
        MoeConfig,
        stage_cuts,
        token_tiles,
    )
    assert [token_tiles(n, 8, 384, 8) for n in (1, 17, 384, 385, 512, 1536, 4096)] == [1, 1, 1, 2, 2, 4, 8]
    assert token_tiles(4096, 8, 384, 1) == 1 and token_tiles(4096, 8, 384, 4) == 4
    ex = DeviceExperts(np.zeros((384, 2 * 64, 128 // 8), np.uint32), None, np.zeros(1), tiled=0)
    gate_up, down = stage_cuts(ex, 1536, 8, MoeConfig(token_tiles=8))
    assert gate_up.T == down.T == 4 and stage_cuts(ex, 1536, 8)[0].T == 1


@pytest.mark.gpu
def test_gpu_moe_stamps():
    """ExpertConfig.stamps on the engine's default cuts (gate_up through the bulk rings, down on registers) at K2 widths."""
    from numbaengine.kernels.moe import MOE_DEFAULT, default_cuts
    tiled = MOE_DEFAULT.tiled
    C.check_moe_stamps(Env(gpu=True), 4, 7168, 2048, 16, 8, default_cuts(tiled), tiled=tiled)


@pytest.mark.gpu
def test_gpu_moe_int4_one_expert_shared():
    C.check_moe(Env(gpu=True), 33, 1024, 512, 16, 8, "one_hot", shared=True)


@pytest.mark.gpu
def test_gpu_moe_int4_bf16_activations():
    C.check_moe(Env(gpu=True), 9, 1024, 512, 16, 8, "random")


@pytest.mark.gpu
def test_gpu_moe_bf16_experts():
    C.check_moe(Env(gpu=True), 5, 1024, 256, 8, 4, "random", int4=False)


@pytest.mark.gpu
@pytest.mark.parametrize("n,n_group,topk_group", [(1, 1, 1), (65, 1, 1), (17, 8, 4)])
def test_gpu_router(n, n_group, topk_group):
    C.check_router(Env(gpu=True), n, 7168, 384, 8, n_group, topk_group)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 17, 65])
def test_gpu_router_mma_logits(n):
    C.check_router(Env(gpu=True), n, 7168, 384, 8, 1, 1, mma="gemm")


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [None, "gemm"])
def test_gpu_router_nan_row_picks_experts(mma):
    C.check_router(Env(gpu=True), 5, 7168, 384, 8, 1, 1, nan_row=True, mma=mma)


@pytest.mark.gpu
def test_gpu_router_twin_experts_exact_ties():
    C.check_router(Env(gpu=True), 17, 7168, 384, 8, 8, 4, twins=True)


@pytest.mark.gpu
def test_gpu_router_pair_tree_rows():
    """The shipped pair's router on a budget-16 tree: 17 rows over 16 experts (passes spread over block rows)."""
    C.check_router(Env(gpu=True), 17, 384, 16, 2, 1, 1)


# --- the bulk layout itself (NumPy, no kernel) --------------------------------------------------------------------
@pytest.mark.parametrize("R", [2, 1])
def test_int4_bulk_tiles_layout(R):
    """Every word of int4_bulk_tiles against its definition, element by element, on fresh random words and scales;
    shapes it cannot tile are refused with a one-line error."""
    import numpy as np

    from numbaengine.kernels.moe import BULK_WORDS, int4_bulk_tiles
    rng = np.random.default_rng()
    E, N, K = 2, 64, 256
    words = rng.integers(0, 2 ** 32, (E, N, K // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.integers(0, 2 ** 16, (E, N, K // 32), dtype=np.uint64).astype(np.uint16)
    t = int4_bulk_tiles(words, scales, R)
    assert t.shape == (E, N // 16 // R, K // 128, R * BULK_WORDS) and t.dtype == np.uint32
    sc16 = t.view(np.uint16)                              # the scales: u16 [512, 576) of each chunk
    for e in range(E):
        for p in range(N // 16):
            for s in range(K // 128):
                for h in range(2):
                    for g in range(8):
                        row = h * (N // 2) + 8 * p + g          # gate rows, then the matching up rows
                        c = (p % R) * BULK_WORDS
                        got = t[e, p // R, s, c + 128 * h + 16 * g:c + 128 * h + 16 * g + 16]
                        assert np.array_equal(got, words[e, row, 16 * s:16 * s + 16]), (e, p, s, h, g)
                        u = 2 * (c + 256) + 8 * g + 4 * h
                        assert np.array_equal(sc16[e, p // R, s, u:u + 4], scales[e, row, 4 * s:4 * s + 4])
    with pytest.raises(ValueError, match="int4_bulk_tiles"):
        int4_bulk_tiles(words[:, :, :24], scales[:, :, :6], R)          # K = 192: not a multiple of 128


def test_moe_stamp_timeline():
    """tools/moe_stamps.timeline on synthetic stamps at 2 GHz, counters wrapping past 2^32: the phases' times, the
    start spread and block ends, the blocks that ran nothing left out, the cut-off flag."""
    import numpy as np

    from numbaengine.kernels.moe import STAMP_UNITS, STAMP_WORDS
    from tools.moe_stamps import timeline
    st = np.zeros((3, STAMP_WORDS), np.int64)
    base = (1 << 32) - 3000                                     # both counters wrap inside block 0's first unit
    for b, (t0, ran) in enumerate([(0, 2), (500, 1)]):          # ns offsets of the entries, units run
        c, ns = base + 2 * t0, base + t0
        st[b, :4] = c, ns, 7 + b, ran
        marks = [1000, 4000, 500, 200, 3000, 600][:3 * ran]     # ns: setup, loop, epilogue, between, loop, epilogue
        for p, d in enumerate(marks):
            c, ns = c + 2 * d, ns + d
            st[b, 4 + 2 * p:6 + 2 * p] = c, ns
    st[2, 3] = 0                                                # a block with no unit
    st = (st & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    out = timeline(st, 8000, STAMP_UNITS)
    assert out["blocks"] == 2 and out["units"] == 3 and out["sms"] == 2 and out["ghz"] == 2.0
    assert out["setup"]["med"] == 1.0 and out["main loop"] == dict(med=4.0, min=3.0, max=4.0)
    assert out["epilogue"]["max"] == 0.6 and out["between units"]["med"] == 0.2
    assert out["unit loop GB/s"] == 2.0 and out["start spread us"]["max"] == 0.5
    assert out["block end us"] == dict(med=7.65, max=9.3, all_units=True)       # ends 9.3 and 0.5 + 5.5
    assert not timeline(st, 8000, 1)["block end us"]["all_units"]
