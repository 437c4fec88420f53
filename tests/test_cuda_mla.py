"""The absorbed MLA kernel (kernels/mla.py) beyond tests/test_cuda_attention.py: the cp.async ring over many steps,
sharp scores (the lazy softmax rescale taken and skipped),
every row-tile geometry (1..4 m16 tiles, two m16 tiles per P V warp), many splits through the merge kernel, dead
query rows and empty sequences, the default model's shapes, split sizing; on the simulator, on a GPU (K2 shapes,
marked gpu) and as sm_90 PTX (no float64, no local memory)."""
import numpy as np
import pytest
from cudasim import Env, f64_lines, ptx_or_skip, ptxas_check, simulator_test, worst
from test_cuda_attention import BF16_NAN, pack_vis, random_tree_vis
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

from numbaengine.kernels.attention import MergeConfig
from numbaengine.kernels.mla import MLA_PTX_SIG as SIG
from numbaengine.kernels.mla import MlaConfig
from numbaengine.kernels.mla_wg import MlaWgConfig
from numbaengine.weights.dtypes import bf16_to_f32, f32_to_bf16


def check(env, B=2, T=1, h=4, D=96, r=64, lengths=(150, 90), ntok=(1, 1), work="none", causal=False, sms=132,
          scale=None, seed=0, calls=1, margin=7, partials=None, cfg=None):
    """mla_attention against mla_attention_ref. work: "none" (one normalized split), an int (keys per split)
    or "auto" (mla_work's sizing for `sms` SMs); with splits the work's count (the kernels' unread argument) must
    still be zero after each call; calls > 1: again on the same work, output re-poisoned. margin: cache rows past the longest sequence (0: the cache ends at its last row, as the engine's
    verify of a short prompt has it). partials: the split partials' type ("f32", "bf16", "auto"; None: mla_work's
    default), poisoned before the first call."""
    from numbaengine.kernels.mla import (
        MLA_DEFAULT,
        PARTIAL_DTYPES,
        mla_attention,
        mla_work,
    )
    from numbaengine.kernels.mla_wg import mla_wg_applies
    cfg = cfg or MLA_DEFAULT
    from numbaengine.reference import mla_attention_ref
    rng = np.random.default_rng(seed)
    lengths, ntok = np.array(lengths, np.int32), np.array(ntok, np.int32)
    cap = int((lengths + ntok).max()) + margin
    q = bf16_to_f32(f32_to_bf16(rng.normal(size=(B, T, h, D)).astype(np.float32)))   # the kernel's bf16 q
    cache = f32_to_bf16(rng.normal(size=(B, cap, D)).astype(np.float32))
    for b in range(B):
        cache[b, lengths[b] + ntok[b]:] = BF16_NAN                                    # never read
    mask = None if causal else np.stack([pack_vis(random_tree_vis(rng, max(n, 1)), T) for n in ntok])
    scale = float(D) ** -0.5 if scale is None else scale
    want = mla_attention_ref(q, cache, lengths, ntok, mask, scale, np.empty((B, T, h, r), np.float32))
    out = env.dev(np.full((B, T, h, r), np.nan, np.float32))
    wk = None if work == "none" else mla_work(env.zeros, B, T, h, r, cap, None if work == "auto" else work,
                                               D=D, sms=sms, partials=partials, cfg=cfg)
    if wk is not None:
        auto = "bf16" if mla_wg_applies(h, D, r, cfg.wg) else "f32"
        assert wk.o.dtype == PARTIAL_DTYPES[{"auto": auto, None: auto}.get(partials, partials)], wk.o.dtype
        wk.o = env.dev(np.full(wk.o.shape, 0x7FC0 if wk.o.dtype == np.uint16 else np.nan, wk.o.dtype))  # NaN
    args = (env.dev(q), env.dev(cache), env.dev(lengths), env.dev(ntok), None if causal else env.dev(mask), scale)
    for call in range(calls):
        if call:
            out = env.dev(np.full((B, T, h, r), np.nan, np.float32))
        mla_attention(*args, out, wk, cfg=cfg)
        got = env.host(out)
        assert np.isfinite(got).all(), f"call {call}: non-finite output"
        assert np.abs(got - want).max() <= 8e-3 * max(1.0, np.abs(want).max()), worst(got, want)
        if wk is not None:
            assert not env.host(wk.count).any(), f"call {call}: the work's count written"
    return wk


def check_split_sizing(env):
    from numbaengine.kernels.mla import MLA_DEFAULT, mla_work
    one = mla_work(np.zeros, 1, 1, 64, 512, 4097)                    # batch 1: every SM gets a split
    assert one.o.shape[1] == -(-4097 // MLA_DEFAULT.min_split), one.o.shape
    many = mla_work(np.zeros, 64, 1, 64, 512, 4097)                  # batch 64: about one wave
    assert 64 * many.o.shape[1] <= 132 and many.o.shape[1] >= 2, many.o.shape
    for B, T, keys in ((4, 17, 65553), (8, 17, 65553), (16, 17, 16401)):  # 68 / 136 / 272 tiles of 64 rows
        ns = mla_work(np.zeros, B, T, 64, 512, keys).o.shape[1]          # fill the waves with many splits
        waves = -(-B * T * ns // 132)
        assert ns > 1 and B * T * ns >= 0.85 * 132 * waves and waves <= 8, (B, T, ns)
    for B in (1, 9, 64, 1000):                                           # splits always >= min_split keys
        w = mla_work(np.zeros, B, 1, 64, 512, 3000)
        assert 1 <= w.o.shape[1] <= -(-3000 // MLA_DEFAULT.min_split) and w.split * (w.o.shape[1] - 1) < 3000, w.split


SIM_CASES = {
    "ring_one_split": lambda env: check(env, seed=1),                                      # 5 steps > 4 stages
    "ring_splits_merge": lambda env: check(env, work=32, seed=2),                  # 5 splits of 64: 5 split groups
    # bf16 split partials (the 64-head kernel's default: MlaConfig.partials) through the 8-head kernel
    "ring_splits_merge_bf16": lambda env: check(env, work=32, seed=16, partials="bf16"),
    "merge_ten_groups_bf16": lambda env: check(env, lengths=(600, 90), work=32, seed=18, partials="bf16"),
    "dead_rows_empty_seq_bf16": lambda env: check(env, B=3, T=3, h=4, lengths=(45, 0, 64), ntok=(2, 0, 3), work=32,
                                                  seed=19, partials="bf16"),
    # 10 splits of 64 keys: 8 split groups per merge block (a tree of 3 rounds), 2 splits per load round (groups
    # 2..7's second is past the last split: loaded, not folded); 5 splits (ring_splits_merge): a tree of 5 groups
    "merge_ten_groups": lambda env: check(env, lengths=(600, 90), work=32, seed=5),
    # the same with 2 split groups and 2 splits per load round (3 rounds, the last one's second split past the end:
    # loaded, not folded) and each row's 16 column quads over 2 blocks of 8
    "merge_split_rounds_column_blocks": lambda env: check(env, lengths=(600, 90), work=32, seed=14,
                                                          cfg=MlaConfig(merge=MergeConfig(groups=2, splits=2, cols=8))),
    # many rows for their splits (merge_shape's wave rule): one split group, 4 splits per round (3 rounds of 10)
    "merge_one_group_rounds": lambda env: check(env, lengths=(600, 90), work=32, seed=15,
                                                cfg=MlaConfig(merge=MergeConfig(wave_threads=1))),
    "many_splits_auto": lambda env: check(env, B=1, lengths=(300,), ntok=(1,), work="auto", sms=12, seed=3),
    "pv_two_tiles_per_warp": lambda env: check(env, B=1, T=16, h=4, D=160, r=128, lengths=(70,),
                                                       ntok=(13,), work=64, seed=4),
    "three_row_groups": lambda env: check(env, B=1, T=12, h=4, lengths=(40,), ntok=(12,), work="none", seed=5),
    "five_row_tiles_causal": lambda env: check(env, B=1, T=20, h=4, lengths=(33,), ntok=(20,), causal=True,
                                               work=32, seed=6),
    "dead_rows_empty_seq": lambda env: check(env, B=3, T=3, h=4, lengths=(45, 0, 64), ntok=(2, 0, 3), work=32,
                                             seed=7),
    "default_model_decode": lambda env: check(env, B=2, T=1, h=6, D=160, r=128, lengths=(100, 7), work="auto",
                                              sms=4, seed=8),
    "sharp_scores_rescale": lambda env: check(env, B=1, lengths=(200,), ntok=(1,), scale=1.5, work=96, seed=9),
    "split_sizing": check_split_sizing,
    "nk32_splits_tree": lambda env: check(env, B=1, T=3, h=4, lengths=(150,), ntok=(3,), work=96, seed=10,
                                          cfg=MlaConfig(nk=32)),
    "merge_four_rows_past_m": lambda env: check(env, B=2, T=3, h=3, lengths=(50, 20), ntok=(3, 2), work=32,
                                                seed=12),       # 2 splits: 4-row merge blocks, M = 9 rows
    "two_s_tiles_kg2": lambda env: check(env, B=1, T=13, h=4, lengths=(70,), ntok=(13,), work=64, seed=11,
                                         cfg=MlaConfig(s_tiles=2, wide_kg=2)),
}


test_simulator = simulator_test(__name__)


# --- GPU (K2 shapes) ----------------------------------------------------------------------------------------------

K2 = dict(D=576, r=512)
GPU_CASES = {
    "decode_h64_b1_auto": dict(B=1, h=64, lengths=(5000,), ntok=(1,), work="auto"),
    "decode_h64_b9_auto": dict(B=9, h=64, lengths=(3000, 17, 900, 4000, 1, 2500, 64, 65, 3333), ntok=(1,) * 9,
                               work="auto"),
    "decode_h8_b5_auto": dict(B=5, h=8, lengths=(4100, 33, 0, 2000, 777), ntok=(1, 1, 1, 0, 1), work="auto"),
    "tree17_h64": dict(B=2, T=17, h=64, lengths=(1200, 300), ntok=(17, 5), work="auto"),
    "tree65_h8": dict(B=2, T=65, h=8, lengths=(2000, 100), ntok=(65, 40), work="auto"),
    "tree17_h8_one_split": dict(B=2, T=17, h=8, lengths=(700, 1), ntok=(17, 17), work="none"),
    "decode_h64_split512": dict(B=2, T=1, h=64, lengths=(1000, 4000), ntok=(1, 1), work=512),
    "tree16_h64_split256": dict(B=2, T=17, h=64, lengths=(700, 1500), ntok=(17, 9), work=256),
    "tree255_h8": dict(B=2, T=256, h=8, lengths=(300, 900), ntok=(256, 100), work=256),
    "prefill_causal_h8": dict(B=1, T=64, h=8, lengths=(100,), ntok=(64,), causal=True),
    "prefill_causal_h64": dict(B=1, T=9, h=64, lengths=(77,), ntok=(9,), causal=True),
    "tree17_h64_dead_queries": dict(B=3, T=17, h=64, lengths=(0, 2000, 64), ntok=(3, 17, 0), work="auto"),
    "tree9_h64_one_split": dict(B=2, T=9, h=64, lengths=(333, 31), ntok=(9, 4), work="none"),
    "decode_h128_split96": dict(B=2, T=1, h=128, lengths=(1000, 95), ntok=(1, 1), work=96),
    # the engine's verify of a 2-token prompt: 4 tree rows, a cache of exactly 6 rows (less than one 64-key tile)
    "tree4_h64_cap6": dict(B=1, T=4, h=64, lengths=(2,), ntok=(4,), work="none", margin=0),
    "tree4_h8_cap6": dict(B=1, T=4, h=8, lengths=(2,), ntok=(4,), work="none", margin=0),
    "tree5_h64_b2_cap_exact": dict(B=2, T=5, h=64, lengths=(60, 3), ntok=(5, 4), work="none", margin=0),
    # the other partials' type (MlaConfig.partials "auto": bf16 for the 64-head kernel, f32 for the 8-head)
    "decode_h64_b9_auto_f32": dict(B=9, h=64, lengths=(3000, 17, 900, 4000, 1, 2500, 64, 65, 3333), ntok=(1,) * 9,
                                   work="auto", partials="f32"),
    "decode_h8_b5_auto_bf16": dict(B=5, h=8, lengths=(4100, 33, 0, 2000, 777), ntok=(1, 1, 1, 0, 1), work="auto",
                                   partials="bf16"),
}
WG_CASES = sorted(c for c in GPU_CASES if GPU_CASES[c]["h"] % 64 == 0)     # kernels/mla_wg.py's on sm_90


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu(case):
    check(Env(gpu=True), **K2, **GPU_CASES[case])


@pytest.mark.gpu
@pytest.mark.parametrize("case", WG_CASES)
def test_gpu_mma_sync_path(case):
    """The 64-head cases on mla.py's mma.sync kernel too (MlaWgConfig.on off)."""
    check(Env(gpu=True), **K2, **GPU_CASES[case], cfg=MlaConfig(wg=MlaWgConfig(on=False)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", WG_CASES)
def test_gpu_wgmma_loads(case):
    """The 64-head cases twice on the same work, the cache tiles loaded by TMA tensor copies: rows past each
    sequence's end are NaN in the cache (check), so a tile's rows past the split's end must land as zeros."""
    check(Env(gpu=True), **K2, **GPU_CASES[case], calls=2)


# splits of a row tile merged in thread-block clusters (MlaWgConfig.cluster): (splits, cluster size) =
# (2, 2), (3, 3) (rows 22 / 22 / 20) with dead queries, (4, 4) (two row tiles per query), (8, 8) (splits past the
# sequence's end: blocks with no partial); 12 and 9 splits: more than a cluster holds, merge_splits. Values: shape,
# cluster size (grids this small always fit as clusters).
CLUSTER_CASES = {
    "decode_h64_b3_split2": (dict(B=3, h=64, lengths=(4000, 1500, 30), ntok=(1, 1, 1), work=2016), 2),
    "tree17_h64_split3_dead": (dict(B=2, T=17, h=64, lengths=(2900, 40), ntok=(17, 6), work=1024), 3),
    "decode_h128_split4": (dict(B=2, h=128, lengths=(3000, 500), ntok=(1, 1), work=800), 4),
    "decode_h64_split8": (dict(B=2, h=64, lengths=(1000, 4000), ntok=(1, 1), work=512), 8),
    "decode_h64_split12": (dict(B=2, h=64, lengths=(3000, 700), ntok=(1, 1), work=256), 0),
    "tree17_h64_split9": (dict(B=2, T=17, h=64, lengths=(2200, 1000), ntok=(17, 3), work=256), 0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["direct", "staged", "cluster"])
@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_gpu_wgmma_epilogue(case, epilogue):
    """The 64-head kernel's ways out: O stored from the accumulators (direct, f32 partials only) or through shared
    memory (staged), both with the partials merged by merge_splits, or merged in the kernel across a cluster of the
    split blocks (cluster), the cluster sizes of CLUSTER_CASES checked to be what ran."""
    cfg = MlaConfig(wg=MlaWgConfig(staged=epilogue != "direct", cluster=8 if epilogue == "cluster" else 0))
    shape, plain = CLUSTER_CASES[case]
    if epilogue == "direct":                  # (its register stores write f32 only: bf16 partials are refused)
        with pytest.raises(ValueError, match="bf16 partials need MlaWgConfig.staged"):
            check(Env(gpu=True), **K2, **shape, partials="bf16", cfg=cfg)
    wk = check(Env(gpu=True), **K2, **shape, calls=2, partials="f32" if epilogue == "direct" else None, cfg=cfg)
    assert wk.cluster == (plain if epilogue == "cluster" else 0)


def test_wg_clusters():
    """kernels.mla_wg.wg_clusters: all the splits as one cluster (2..8); none for one split or past 8."""
    import numbaengine.kernels.mla_wg as kw
    got = {n: kw.wg_clusters(n) for n in (1, 2, 7, 8, 9, 12, 13, 33, 65)}
    want = {1: [], 2: [2], 7: [7], 8: [8], 9: [], 12: [], 13: [], 33: [], 65: []}
    assert got == want


def test_stamp_phases():
    """tools/mla_stamps.py phases: per-phase times from (cycles, ns) stamps at a block's own clock, across the 32-bit
    wrap of both counters; blocks missing a point (an empty split) are left out; none at all: a clear error."""
    from tools.mla_stamps import PHASES, phases
    rng = np.random.default_rng()
    ghz = rng.uniform(1.2, 2.0, size=3)
    dur_us = rng.uniform(0.5, 20.0, size=(3, 6))               # the six phases of three blocks
    start_ns = np.array([(1 << 32) - 700, 100, 2500])           # the first block's counters wrap inside it
    st = np.zeros((4, 16), np.int64)
    for i in range(3):
        t = np.concatenate([[0.0], np.cumsum(dur_us[i])]) * 1e3            # ns since entry
        st[i, 1:14:2] = (start_ns[i] + np.round(t)) % (1 << 32)
        st[i, 0:14:2] = ((1 << 32) - 5000 + np.round(t * ghz[i])) % (1 << 32)
        st[i, 14], st[i, 15] = i, 10 * (i + 1)
    st[3, :2] = 7                                                # stamped its entry only
    got = phases(st.astype(np.uint32).view(np.int32))
    for k, name in enumerate(PHASES):
        assert abs(got[name]["med"] - np.median(dur_us[:, k])) < 2e-3, (name, got[name], dur_us[:, k])
        assert abs(got[name]["max"] - dur_us[:, k].max()) < 2e-3
    assert got["blocks"] == 3 and got["sms"] == 3 and got["steps"] == 20
    assert abs(got["ghz"] - np.median(ghz)) < 1e-3
    assert abs(got["start spread us"] - 3.2) < 1e-9             # 2500 - (2^32 - 700) mod 2^32 ns
    ends = [((start_ns[i] - start_ns[0]) % (1 << 32) + 1e3 * dur_us[i].sum()) / 1e3 for i in range(3)]
    assert abs(got["span us"] - max(ends)) < 2e-3, (got["span us"], ends)
    with pytest.raises(ValueError, match="no block stamped"):
        phases(np.zeros((2, 16), np.int32))


def test_ptx_stamps():
    """MlaWgConfig.stamps compiles thread 0's seven (clock, global timer, SM) reads into the split kernel; the default
    kernel has none; the cluster kernels are not stamped (the same compiled objects)."""
    import numbaengine.kernels.mla_wg as kw
    plain = ptx_or_skip(kw.mla_wg_kernel(192, 128, False).py_func, kw.MLA_WG_PTX_SIG, cc=(9, 0, "a"))
    unstamped = [kw.mla_wg_kernel(192, 128, False, cluster=2)]
    on = kw.MlaWgConfig(stamps=True)
    stamped = ptx_or_skip(kw.mla_wg_kernel(192, 128, False, cfg=on).py_func, kw.MLA_WG_PTX_SIG, cc=(9, 0, "a"))
    assert unstamped == [kw.mla_wg_kernel(192, 128, False, cluster=2, cfg=on)]   # the cluster kernels stay as they are
    assert "%globaltimer" not in plain and stamped.count("%globaltimer") == 7 and stamped.count("%clock64") == 7


@pytest.mark.gpu
def test_gpu_stamps():
    """tools/mla_stamps.py on the GPU: every split block of a 2-sequence 8K decode stamps all its points, in order
    (phases >= 0), a block inside the kernel's span, and its main-loop steps (4 per block, 65 splits) no faster
    than all blocks' 36 KB tiles at 5 TB/s (above the H200's 4.8 TB/s peak); mla_attention refuses stamps without
    a [blocks, 16] work.count (this test has not been run on a GPU)."""
    import numbaengine.kernels.mla_wg as kw
    from tools.mla_stamps import PHASES, run_case
    if not kw.mla_wg_applies(64, 576, 512):
        pytest.skip("the 64-head wgmma kernel runs on sm_90 only")
    row = run_case(8192, 2, {"wg": {"cluster": 0}})
    assert row["blocks"] == 2 * row["splits"], row
    assert all(row[p]["min"] >= 0 for p in PHASES), row
    assert row["block"] <= row["span us"] + 1.0 and row["main loop per step"] > 36864 * row["blocks"] / 5e6, row
    # stamps into an ordinary work's [B, M] counters (or none) would write past them: refused
    from numba import cuda

    from numbaengine.kernels.mla import mla_attention, mla_work

    def dz(shape, dtype):
        return cuda.to_device(np.zeros(shape, dtype))
    q, cache, out = dz((2, 1, 64, 576), np.float32), dz((2, 4100, 576), np.uint16), dz((2, 1, 64, 512), np.float32)
    lengths, ntok = cuda.to_device(np.full(2, 4096, np.int32)), cuda.to_device(np.ones(2, np.int32))
    work = mla_work(dz, 2, 1, 64, 512, 4100)
    cfg = MlaConfig(wg=MlaWgConfig(stamps=True, cluster=0))
    for w in (work, None):
        with pytest.raises(ValueError, match="MlaWgConfig.stamps"):
            mla_attention(q, cache, lengths, ntok, None, 0.04, out, w, cfg=cfg)


@pytest.mark.parametrize("blocks,size,fits,slots,pays", [(128, 2, 66, 132, True), (128, 8, 16, 132, True),
                                                         (128, 8, 15, 132, False), (132, 3, 43, 132, False),
                                                         (200, 2, 66, 132, True), (64, 2, 0, 132, False)])
def test_cluster_pays(blocks, size, fits, slots, pays):
    """kernels.mla.cluster_pays: clusters only where they take no more waves than plain blocks (e.g. 33 splits of 4
    sequences as 44 clusters of 3 where 43 fit: two waves instead of one); a size the driver fits 0 of: never."""
    from numbaengine.kernels.mla import cluster_pays
    assert cluster_pays(blocks, size, fits, slots) == pays


@pytest.mark.gpu
@pytest.mark.parametrize("D,r", [(192, 128), (576, 512)])
def test_gpu_wgmma_path_taken(D, r):
    """On an sm_90 GPU, 64-head tiles run kernels/mla_wg.py (and match the reference at a narrow width too)."""
    from numba import cuda

    from numbaengine.kernels.mla_wg import mla_wg_applies
    assert mla_wg_applies(64, D, r) == (cuda.get_current_device().compute_capability == (9, 0))
    check(Env(gpu=True), B=2, T=3, h=64, D=D, r=r, lengths=(300, 40), ntok=(3, 2), work=64)


@pytest.mark.parametrize("args", [(0x1000, 100, 576, 32, 32), (0x1008, 100, 576, 32, 64), (0x1000, 100, 572, 32, 64),
                                  (0x1000, 100, 576, 257, 64)])
def test_tensor_map_rejects(args):
    """kernels/bulk.py tensor_map_2d: a box that is not 64 columns (one 128-byte swizzle span of bf16) or more than
    256 rows, an unaligned address or row pitch: a one-line ValueError before the driver is asked."""
    from numbaengine.kernels.bulk import tensor_map_2d
    with pytest.raises(ValueError, match=r"^tensor_map_2d: boxes of .*\(must be 16-byte aligned\)$"):
        tensor_map_2d(*args)


# --- PTX for sm_90 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("D,r,cl", [(192, 128, 0), (192, 128, 3)])
def test_ptx_wgmma_kernel(D, r, cl):   # K2's (576, 512): 4x the time
    """kernels/mla_wg.py compiles for sm_90a: D/16 wgmma for S(0) and as many for S(i + 1), NK/16 (MN-major B)
    for P V in each warpgroup's loop, the cache tiles by TMA, no float64, no local memory; ptxas (where installed)
    keeps the wgmmas asynchronous (no serialization notice) in 255 registers without spills; at K2's widths 254
    registers. cl: the cluster merge of 3 splits."""
    import re

    import numbaengine.kernels.mla_wg as kw
    kern = kw.mla_wg_kernel(D, r, False, cluster=cl)
    ptx = ptx_or_skip(kern.py_func, kw.MLA_WG_PTX_SIG, cc=(9, 0, "a"))
    # the epilogue: O staged in shared memory, 16-byte global stores; (cluster) two cluster barriers on each path
    # (an empty split's block and a working one) and the partials read through DSMEM
    assert "st.shared.v2.f32" in ptx and "st.global.v4.u32" in ptx
    assert ptx.count("barrier.cluster.wait") == (4 if cl else 0) and ("mapa.shared::cluster" in ptx) == bool(cl)
    MLA_WG_NK = kw.WG_DEFAULT.nk
    tensor = re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)
    assert len(tensor) % (D // 64) == 0 and tensor, len(tensor)   # a copy per 64-column box
    assert "cp.async.cg" not in ptx
    assert "fence.proxy.tensormap" in ptx
    ops = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16[^;]*,\s*(\d);", ptx)
    want = [(str(MLA_WG_NK), "0")] * (2 * D // 16) + [(str(r // 2), "1")] * (2 * MLA_WG_NK // 16)
    assert sorted(ops) == sorted(want), ops
    assert not f64_lines(ptx) and not re.search(r"\b(ld|st)\.local", ptx)
    ptxas_check(ptx)


def bf16_partials(sig):
    """A kernel signature (MLA_PTX_SIG, MLA_WG_PTX_SIG) with bf16 (uint16) split partials o_part."""
    f32_parts = "float32[:,:,:,::1], float32[:,:,:,::1], float32[:,:,::1]"       # o_part, ml_part, out
    assert sig.count(f32_parts) == 1, sig
    return sig.replace(f32_parts, "uint16" + f32_parts[7:])


@pytest.mark.parametrize("M,D,r,partials", [(8, 576, 512, "f32"), (32, 576, 512, "f32"), (48, 576, 512, "f32"),
                                            (6, 160, 128, "f32"), (64, 160, 128, "f32"), (8, 576, 512, "bf16")])
def test_ptx_geometries(M, D, r, partials):
    """The mma.sync kernel at each row-tile geometry: no float64, no local memory; O leaves in 16-byte stores, or
    (bf16 partials) rounded pairwise to bf16 in 8-byte ones."""
    import re

    from numbaengine.kernels.mla import mla_geometry, mla_kernel
    rg, kg, stages, _, _ = mla_geometry(M, D, r)
    ptx = ptx_or_skip(mla_kernel(rg, kg, stages, False, D, r).py_func, bf16_partials(SIG) if partials == "bf16"
                      else SIG)
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ptx.count("mma.sync") and ptx.count("ldmatrix") and ptx.count("cp.async.cg")
    assert not re.search(r"(ld|st)\.local", ptx), "local memory"
    assert ("st.global.v2.u32" in ptx and "cvt.rn.bf16x2.f32" in ptx) == (partials == "bf16")
    assert ("st.global.v4.u32" in ptx) == (partials == "f32")


def test_ptx_wgmma_bf16_partials():
    """kernels/mla_wg.py with bf16 split partials: the staged O leaves as bf16 pairs in 8-byte stores; no float64,
    no local memory."""
    import re

    import numbaengine.kernels.mla_wg as kw
    ptx = ptx_or_skip(kw.mla_wg_kernel(192, 128, False).py_func, bf16_partials(kw.MLA_WG_PTX_SIG), cc=(9, 0, "a"))
    assert "cvt.rn.bf16x2.f32" in ptx and "st.global.v2.u32" in ptx
    assert not f64_lines(ptx) and not re.search(r"\b(ld|st)\.local", ptx)


def test_partials_type(monkeypatch):
    """mla_work's split partials: f32 or bf16 bits (uint16) as asked; "auto" (the default) is bf16 exactly where the
    64-head wgmma kernel runs; any other name is refused in one line."""
    import numbaengine.kernels.mla as km
    from numbaengine.kernels.mla import mla_work
    for name, dtype in (("f32", np.float32), ("bf16", np.uint16)):
        assert mla_work(np.zeros, 2, 1, 64, 512, 4097, partials=name).o.dtype == dtype
    for wg in (False, True):
        monkeypatch.setattr(km, "mla_wg_applies", lambda h, D, r, cfg=None: wg and h % 64 == 0)
        assert mla_work(np.zeros, 2, 1, 64, 512, 4097).o.dtype == (np.uint16 if wg else np.float32)
        assert mla_work(np.zeros, 2, 1, 8, 512, 4097, partials="auto").o.dtype == np.float32
    with pytest.raises(ValueError, match=r"^mla_work: partials 'fp8' is not one of \['auto', 'bf16', 'f32'\]$"):
        mla_work(np.zeros, 2, 1, 64, 512, 4097, partials="fp8")


def test_strided_out_refused():
    """A strided out would be reshaped into a copy and the attention written there, lost: refused in one line
    before any launch, the caller's out untouched."""
    from numbaengine.kernels.mla import mla_attention
    q, cache = np.zeros((1, 1, 4, 64), np.float32), np.zeros((1, 8, 64), np.uint16)
    full = np.full((1, 1, 4, 128), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"out \(1, 1, 4, 64\) must be C-contiguous"):
        mla_attention(q, cache, np.array([7], np.int32), np.array([1], np.int32), None, 0.1, full[..., ::2])
    assert np.isnan(full).all()
