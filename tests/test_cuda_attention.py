"""numba.cuda attention kernels (generic GQA attention, the drafter's kv_attention, sampling; MLA has its own
module, test_cuda_mla.py) against their reference ops: on the simulator (a child process, tiny shapes) and on a GPU
(K2 shapes, marked gpu); plus a PTX compile check for sm_90 with no float64 instructions in the hot kernels."""
import numpy as np
import pytest
from cudasim import Env, f64_lines, ptx_or_skip, simulator_test, worst
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

BF16_NAN = np.uint16(0x7FC0)


def random_tree_vis(rng, n):
    """Ancestor-or-self matrix of a random topologically numbered tree of n nodes."""
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        vis[i] |= vis[rng.integers(0, i)]
    return vis


def pack_vis(vis, T):
    """bool[n, n] -> u32[T, ceil(T/32)] packed rows (bit j of word w = column 32w + j)."""
    W = -(-T // 32)
    bits = np.zeros((T, 32 * W), np.uint8)
    bits[:len(vis), :len(vis)] = vis
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def check_attention(env, n=5, h=4, hk=2, d=24, dv=16, S=37, masked=True, split=True, seed=1):
    from numbaengine.kernels.attention import attention, attention_work
    from numbaengine.reference import attention_ref
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, h, d)).astype(np.float32)
    k = rng.normal(size=(S, hk, d)).astype(np.float32)
    v = rng.normal(size=(S, hk, dv)).astype(np.float32)
    vis = None
    if masked:
        vis = rng.random((n, S)) < 0.6
        vis[:, 0] = True
    want = attention_ref(q, k, v, vis, 0.3, np.empty((n, h, dv), np.float32))
    out = env.dev(np.full((n, h, dv), np.nan, np.float32))
    work = attention_work(env.zeros, n, h, dv, S, target_blocks=6) if split else None
    attention(env.dev(q), env.dev(k), env.dev(v), None if vis is None else env.dev(vis), 0.3, out, work)
    got = env.host(out)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), worst(got, want)


def check_kv_attention(env, n=5, h=4, hk=2, d=24, dv=16, lens=(5, 37, 20), cap=48, target_blocks=None, tc=False,
                       seed=10):
    """The drafter's batched attention: q/out are views with a leading batch stride, k/v context caches of
    capacity `cap` whose rows past kv_len[b] are NaN (never read), out poisoned (every row written, the padding
    row after each sequence's rows untouched). target_blocks: splits + merge (None: one split). tc: the
    tensor-core kernel (bf16 operands: a looser tolerance); else the f32 kernel."""
    from numbaengine.kernels.attention import kv_attention, kv_attention_work
    from numbaengine.reference import kv_attention_ref
    rng = np.random.default_rng(seed)
    B, lens = len(lens), np.array(lens, np.int32)
    q = rng.normal(size=(B, n + 1, h, d)).astype(np.float32)
    k = rng.normal(size=(B, cap, hk, d)).astype(np.float32)
    v = rng.normal(size=(B, cap, hk, dv)).astype(np.float32)
    for b, L in enumerate(lens):
        k[b, L:], v[b, L:] = np.nan, np.nan
    scale = float(d) ** -0.5
    want = kv_attention_ref(q[:, :n], k, v, lens, scale, np.empty((B, n, h, dv), np.float32))
    out = env.dev(np.full((B, n + 1, h, dv), np.nan, np.float32))
    work = None if target_blocks is None else kv_attention_work(env.zeros, B, n, h, dv, cap, target_blocks, tc)
    kv_attention(env.dev(q)[:, :n], env.dev(k), env.dev(v), env.dev(lens), scale, out[:, :n], work, tc)
    got = env.host(out)
    assert np.isnan(got[:, n]).all(), "wrote past the out view"
    got = got[:, :n]
    assert np.isfinite(got).all(), "non-finite output (a NaN key was read or a row was not written)"
    tol = 1.5e-2 if tc else 1e-4
    assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), worst(got, want)
    return work


def check_kv_attention_splits(env, split=16, nsplit=3, **kw):
    """Splits that cross kv_len: with 16 keys each, a sequence in one split, one in two, one in three."""
    work = check_kv_attention(env, target_blocks=30, **kw)
    assert work.split == split and work.o.shape[1] == nsplit, (work.split, work.o.shape)


def check_sample(env, n=3, V=700, temperatures=(0, 0.7, 1.0), seed=2):
    from numbaengine.kernels.sample import sample
    from numbaengine.reference import sample_ref
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, V)).astype(np.float32)
    logits[min(1, n - 1), [5, 9]] = 50.0                                 # exact tie: lowest index wins
    seq = np.arange(n, dtype=np.int32)
    pos = rng.integers(0, 100000, size=n).astype(np.int32)
    for t in temperatures:
        want = sample_ref(logits, t, 1234, seq, pos, np.empty(n, np.int32))
        out = env.dev(np.full(n, -1, np.int32))
        sample(env.dev(logits), t, 1234, env.dev(seq), env.dev(pos), out)
        assert env.host(out).tolist() == want.tolist(), f"temperature {t}"


SIM_CASES = {
    "attention_masked_splits": lambda env: check_attention(env),
    "attention_gqa_nomask": lambda env: check_attention(env, masked=False, split=False, seed=7),
    "sample": lambda env: check_sample(env),
    "kv_attention_one_split": lambda env: check_kv_attention(env),
    "kv_attention_splits": lambda env: check_kv_attention_splits(env),
    "kv_attention_tc_one_split": lambda env: check_kv_attention(env, d=32, tc=True, seed=12),
    "kv_attention_tc_splits": lambda env: check_kv_attention_splits(env, d=32, tc=True, split=32, nsplit=2, seed=13),
    "kv_attention_tc_2x2_warps": lambda env: check_kv_attention(env, n=9, d=32, dv=32, lens=(40, 9), tc=True,
                                                                target_blocks=4, seed=14),
}


test_simulator = simulator_test(__name__)


# --- GPU (K2 shapes) ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_gpu_attention_drafter(split):
    check_attention(Env(gpu=True), n=16, h=32, hk=8, d=128, dv=128, S=1016, masked=False, split=split)


GPU_KV = {        # DFlash drafters: the shipped pair (h 6, hk 2, d 64) and a K2-size one (h 32, hk 8, d 128)
    "pair_b5": dict(n=16, h=6, hk=2, d=64, dv=64, lens=(16, 4000, 1000, 2500, 4096), cap=4096 + 16),
    "pair_b128": dict(n=16, h=6, hk=2, d=64, dv=64, lens=tuple(range(16, 4096, 32)), cap=4096),
    "k2_b3": dict(n=16, h=32, hk=8, d=128, dv=128, lens=(16, 16000, 1030), cap=16384),
    "k2_hk4_b2": dict(n=16, h=32, hk=4, d=128, dv=128, lens=(3000, 700), cap=4096),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("case", sorted(GPU_KV))
def test_gpu_kv_attention(case, split, tc):
    check_kv_attention(Env(gpu=True), target_blocks=264 if split else None, tc=tc, seed=11, **GPU_KV[case])


@pytest.mark.gpu
def test_gpu_attention_naive_prefill():
    check_attention(Env(gpu=True), n=64, h=8, hk=8, d=192, dv=128, S=64, masked=True, split=False)


@pytest.mark.gpu
def test_gpu_sample():
    check_sample(Env(gpu=True), n=17, V=163840, temperatures=(0, 0.8))


# --- PTX for sm_90 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("M,causal", [(8, False), (64, False), (1088, False), (8, True), (64, True), (1088, True)])
def test_ptx_mla(M, causal):
    """The mma.sync MLA kernel at K2's widths."""
    import re

    from numbaengine.kernels.mla import MLA_PTX_SIG, mla_geometry, mla_kernel
    wm, wn, pf, _, _ = mla_geometry(M, 576, 512)
    ptx = ptx_or_skip(mla_kernel(wm, wn, pf, causal, 576, 512).py_func, MLA_PTX_SIG)
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ptx.count("mma.sync") and ptx.count("ldmatrix")
    assert not re.search(r"(ld|st)\.local", ptx), "accumulators spilled to local memory"


@pytest.mark.parametrize("name,sig", [
    ("attention_split_kernel", "void(float32[:,:,:,:], float32[:,:,:,::1], float32[:,:,:,::1], int32[::1], boolean, "
                               "boolean[:,::1], boolean, float32, int32, int32, float32[:,:,:,:], "
                               "float32[:,:,:,::1])"),
])
def test_ptx_attention(name, sig):
    import numbaengine.kernels.attention as A
    ptx = ptx_or_skip(getattr(A, name).py_func, sig)
    assert not f64_lines(ptx), f64_lines(ptx)[:5]


@pytest.mark.parametrize("rows,per_round,partials", [(1, 1, "float32"), (4, 1, "float32"), (1, 3, "float32"),
                                                     (1, 4, "float32"), (1, 4, "uint16"), (4, 1, "uint16")])
def test_ptx_merge(rows, per_round, partials):
    """The flash-decoding merge of all three attention kernels (one row or four rows per block, one, three (65
    splits over 32 groups) or four splits per load round), over f32 or bf16 (uint16) partials: f32 math only (the
    tree's unsigned group tests included), no local memory (the accumulators and a round's loads stay in
    registers); a partial's 4 values are one 16-byte load, or one 8-byte load of bf16."""
    import re

    from numbaengine.kernels.attention import merge_kernel
    ptx = ptx_or_skip(merge_kernel(rows, per_round).py_func,
                      f"void({partials}[:,:,:,::1], float32[:,:,:,::1], float32[:,:,:])")
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert not re.search(r"(ld|st)\.local", ptx), "local memory"
    assert ("ld.global.nc.v2.u32" in ptx) == (partials == "uint16")
    assert ("ld.global.nc.v4.u32" in ptx) == (partials == "float32")


@pytest.mark.parametrize("B,nsplit,M,want", [
    (16, 8, 64, (1, 2, 4, 32)),       # 16K x 16, 64 heads: 131072 quads -> 2 groups of 4 splits (one wave of threads)
    (1, 129, 64, (1, 8, 4, 32)),      # batch 1: 8 groups (the cap), 4 splits per round (of 17 each)
    (4, 33, 64, (1, 8, 4, 32)),       # 64K x 4: 32768 quads, 8 groups
    (1, 8, 1088, (1, 1, 4, 32)),      # a 17-query tree at batch 1: 139264 quads, one group, two rounds of 4
    (64, 3, 64, (4, 3, 1, 128)),      # few splits: 4 rows per block, a group per split
    (1000, 40, 64, (1, 1, 4, 32)),    # more quads than a wave: still one group
])
def test_merge_shape(B, nsplit, M, want):
    """merge_splits' launch shape: a thread takes more splits where the rows alone fill a wave of threads."""
    from numbaengine.kernels.attention import merge_shape
    assert merge_shape(B, nsplit, M, 512) == want
    with pytest.raises(ValueError, match="multiple of 4"):
        merge_shape(B, nsplit, M, 510)


@pytest.mark.parametrize("M,d,dv", [(48, 64, 64), (64, 128, 128), (16, 128, 128)])
def test_ptx_kv_attention(M, d, dv):
    """The tensor-core drafter kernel at the pair (48 rows per kv head) and K2 drafter shapes."""
    import re

    import numbaengine.kernels.attention as A
    wm, wn, pf, _, _ = A.kv_geometry(M, d, dv)
    sig = ("void(float32[:,:,:,:], float32[:,:,:,::1], float32[:,:,:,::1], int32[::1], float32, int32, int32, "
           "float32[:,:,:,:], float32[:,:,:,::1])")
    ptx = ptx_or_skip(A.kv_kernel(wm, wn, pf, d, dv).py_func, sig)
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ptx.count("mma.sync") and ptx.count("ldmatrix")
    assert not re.search(r"(ld|st)\.local", ptx), "accumulators spilled to local memory"


def test_ptx_sample():
    import numbaengine.kernels.sample as S
    ptx = ptx_or_skip(S.sample_kernel.py_func,
                      "void(float32[:,::1], float32, boolean, uint64, int32[::1], int32[::1], boolean, int32[::1])")
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ".local" not in ptx, "registers spilled to local memory"
