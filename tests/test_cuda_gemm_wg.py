"""kernels/gemm_wg.py (TMA ring + wgmma dense GEMM, sm_90): its cut rules and x's box layout on the CPU, the kernel
against gemm_ref on the GPU (K2 shapes and odd ones, every cut field, token blocks), batch invariance bit for bit."""
import cuda_cases as C
import numpy as np
import pytest
from cudasim import Env
from test_ptx import cpu_compute_capability  # noqa: F401  (sm_90 for device functions without a GPU)

K2 = {"q_kv_a": (2112, 7168), "q_b": (12288, 1536), "kv_b": (16384, 512), "o": (7168, 8192),
      "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}


def test_wg_cut_from_n_k_only():
    """MT and CL (the k pieces: the order of every sum) do not depend on m; clusters of <= cl_max, pieces of >= 2
    boxes, blocks within the aimed-at count, XIN where the rule says, and the ring fits its shared memory."""
    from numbaengine.kernels.gemm_wg import WG_GEMM_DEFAULT as wg
    from numbaengine.kernels.gemm_wg import wg_cut, wg_smem
    from numbaengine.kernels.prep import token_blocks
    for n, k in list(K2.values()) + [(163840, 7168), (200, 192), (64, 64), (1000, 640)]:
        cuts = [wg_cut(m, n, k) for m in (1, 7, 8, 9, 33, 64, 65, 130, 1000)]
        assert len({(c.MT, c.CL) for c in cuts}) == 1, (n, k, cuts)
        c = cuts[0]
        strips = -(-n // (64 * c.MT))
        assert 1 <= c.CL <= wg.cl_max and (c.CL == 1 or k // 64 // c.CL >= 2), c
        assert strips * c.CL <= max(wg.target * 132, strips), c
        for cut in cuts:
            assert cut.XIN == (cut.NB <= wg.xin_rows and cut.MT == 2 and cut.S >= 3), cut
            assert cut.S >= 2 and wg_smem(cut) <= max(wg.smem_block, 2 * (cut.MT * 8192 + cut.NB * 128)) + 128
    assert [token_blocks(m) for m in (1, 8, 9, 33, 64, 65, 130)] == [(8, 1), (8, 1), (16, 1), (40, 1), (64, 1),
                                                                       (40, 2), (48, 3)]


def test_wg_path_only_where_it_applies():
    """gemm_config picks the wgmma path exactly where it applies: never without an sm_90 GPU (CPU CI, the simulator:
    no TMA / wgmma twin), never for small weights or hi + lo activations, the same for every m."""
    from numbaengine.kernels.gemm import gemm_config, with_xs
    from numbaengine.kernels.gemm_wg import _sm90
    for m in (1, 33, 100):
        assert gemm_config(m, 7168, 8192).WG == int(_sm90())
        assert gemm_config(m, 384, 384).WG == 0                      # small weights: the launch-bound mma cut
        assert with_xs(gemm_config(m, 7168, 8192), 2).WG == 0


# --- GPU ---------------------------------------------------------------------------------------------------------
def check(m, n, k, cut=None, seed=None, strided=False, wg=None):
    """gemm_wg against gemm_ref, output and x's boxes poisoned first (strided: out is the middle columns of a wider
    array, whose other columns must keep their poison; wg: a WgConfig, None the default); returns the output."""
    from numba import cuda

    from numbaengine.kernels.gemm_wg import WG_GEMM_DEFAULT, gemm_wg
    from numbaengine.kernels.prep import xb_words
    from numbaengine.reference import gemm_ref
    env = Env(gpu=True)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = C.rand_bf16(rng, n, k)
    wide = C.poisoned(env, (m, n + 24 * strided), np.float32)
    out = wide[:, 8:8 + n] if strided else wide
    gemm_wg(cuda.to_device(x), cuda.to_device(w), out, C.poisoned(env, (xb_words(m, k),), np.uint32), cut,
            cfg=wg or WG_GEMM_DEFAULT)
    ref = gemm_ref(x, w, np.empty((m, n), np.float32))
    scale = (np.abs(x) @ np.abs(C.bf16_to_f32(w)).T).max()
    got = env.host(wide)
    if strided:
        assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + n:]).all(), "wrote outside the strided out"
        got = got[:, 8:8 + n]
    C.assert_close(f"gemm_wg m={m} n={n} k={k} {cut}", got, ref, 4e-3, scale)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 17, 33, 64, 65, 130])
@pytest.mark.parametrize("name", sorted(K2))
def test_gpu_gemm_wg_k2(name, m):
    """The default cut on K2's projections, one token block (m <= 64) and two or three (65, 130)."""
    check(m, *K2[name])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 9, 40, 70])
@pytest.mark.parametrize("xin", [0, 1])
@pytest.mark.parametrize("mt,cl,stages", [(1, 1, 2), (2, 1, 3), (1, 3, 2), (2, 2, 5), (2, 8, 4), (1, 5, 8)])
def test_gpu_gemm_wg_cuts(mt, cl, stages, xin, m):
    """Every cut field on odd shapes: rows past n inside a box and a whole box past n (n = 200: MT = 2 strips of 128),
    k pieces of unequal boxes (k = 704: 11 boxes), fewer boxes than stages, clusters of 1 .. 8, x converted by the
    blocks (XIN 1, any height here: 70 rows are two blocks of 40; none with 2 stages) or prepared and bulk-copied
    (XIN 0)."""
    from numbaengine.kernels.gemm_wg import wg_cut
    for n, k in ((200, 704), (1000, 640), (64, 128)):
        if cl > k // 64:
            continue
        check(m, n, k, wg_cut(m, n, k, mt=mt, cl=cl, stages=stages, xin=xin))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17])
def test_gpu_gemm_wg_no_fence(m):
    """WgConfig.tmap_fence off (no fence.proxy.tensormap before the first TMA): the same results, on weights whose
    tensor maps are made in this test (fresh maps, first use right after their host write)."""
    from numbaengine.kernels.gemm_wg import WgConfig
    for n, k in ((1000, 640), (200, 704), K2["q_kv_a"]):
        check(m, n, k, wg=WgConfig(tmap_fence=False))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 33])
def test_gpu_gemm_wg_strided_out(m):
    """out as a column slice of a wider array (the vocabulary-parallel lm_head's shard): right, nothing outside."""
    check(m, 1000, 640, strided=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q_kv_a", "o", "kv_b"])
def test_gpu_gemm_wg_batch_invariant(name):
    """A token's output is bit for bit the same alone, among 9, 33, 64 or 130 tokens (the k pieces and the order of
    every sum come from n, k: only the token block's width changes)."""
    from numba import cuda

    from numbaengine.kernels.gemm_wg import gemm_wg
    from numbaengine.kernels.prep import xb_words
    n, k = K2[name]
    rng = np.random.default_rng()
    x = rng.standard_normal((130, k)).astype(np.float32)
    dw = cuda.to_device(C.rand_bf16(rng, n, k))
    outs = {}
    for m in (1, 9, 33, 64, 130):
        out = cuda.to_device(np.full((m, n), np.nan, np.float32))
        gemm_wg(cuda.to_device(x[:m]), dw, out, cuda.to_device(np.zeros(xb_words(m, k), np.uint32)))
        outs[m] = out.copy_to_host()
    for m in (9, 33, 64, 130):
        np.testing.assert_array_equal(outs[m][0], outs[1][0], err_msg=f"{name}: token 0 alone vs among {m}")
        r = min(m, 9) - 1
        np.testing.assert_array_equal(outs[m][r], outs[9][r], err_msg=f"{name}: token {r} among 9 vs {m}")


@pytest.mark.parametrize("mt,cl,nb,xin", [(2, 4, 8, 1), (1, 3, 40, 0), (2, 2, 128, 0)])
def test_wg_kernel_ptx(mt, cl, nb, xin):
    """The kernel compiles for sm_90a on the CPU (NVVM): 4 MT wgmma per stage, no local memory, no float64; with
    WgConfig.stamps one timer read per STAMP_POINTS (tools/gemm_wg_stamps.py), without them none; the PDL wait first
    of all; the tensor map fence (none with FENCE off); the k-split fold (cl > 1) loads all cl partial quads of an
    item before its adds; ptxas (where installed) keeps the wgmmas asynchronous without spills."""
    from cudasim import f64_lines, ptx_or_skip, ptxas_check

    from numbaengine.kernels.gemm_wg import STAMP_POINTS, gemm_wg_kernel
    sig = "void(uint64[::1], uint32[::1], float32[::1], float32[:,::1], int32, int32, int32{})"
    ptx = ptx_or_skip(gemm_wg_kernel(mt, cl, 5, nb, xin).py_func, sig.format(""), cc=(9, 0, "a"))
    assert ptx.count("wgmma.mma_async") == 4 * mt and ".local" not in ptx and not f64_lines(ptx)
    assert "globaltimer" not in ptx
    stamped = ptx_or_skip(gemm_wg_kernel(mt, cl, 5, nb, xin, True).py_func, sig.format(", int32[:,::1]"),
                          cc=(9, 0, "a"))
    assert stamped.count("globaltimer") == len(STAMP_POINTS)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.index("griddepcontrol.wait") < ptx.index("mbarrier.init")
    assert ptx.count("fence.proxy.tensormap") == 1
    nofence = ptx_or_skip(gemm_wg_kernel(mt, cl, 5, nb, xin, False, False).py_func, sig.format(""), cc=(9, 0, "a"))
    assert "fence.proxy.tensormap" not in nofence and nofence.count("wgmma.mma_async") == 4 * mt
    lines = [ln for ln in ptx.splitlines() if "ld.shared::cluster.v4" in ln or "add.f32" in ln or "add.rn.f32" in ln]
    kinds = "".join("L" if "ld.shared" in ln else "A" for ln in lines)
    assert kinds.count("L") == cl and kinds.startswith("L" * cl), kinds
    ptxas_check(ptx)


def test_gemm_wg_stamps_cases_parse():
    """tools/gemm_wg_stamps.py: a malformed --cases is a clear usage error, before any GPU work."""
    from tools.gemm_wg_stamps import main
    with pytest.raises(SystemExit):
        main(["--cases", "q_kv_a"])
    for bad in ("on=0", "nope=1", "stages_max=", "stamps=1"):
        with pytest.raises(SystemExit):
            main(["--set", bad])


def test_gemm_wg_stamps_phases_and_sharing():
    """tools/gemm_wg_stamps.py's summary of synthetic stamps (2 GHz clock, point k at 1000 k + 100 k^2 ns + the
    block's offset): each phase's length, blocks alone on an SM vs sharing one, and when the last of each ended."""
    from tools.gemm_wg_stamps import PHASES, sm_sharing
    from tools.mla_stamps import phases
    P = len(PHASES) + 1
    sms = [0, 0, 1, 2]                               # blocks 0 and 1 share SM 0
    st = np.zeros((4, 2 * P + 2), np.int64)
    for b in range(4):
        ns = np.array([1000 * k + 100 * k * k for k in range(P)]) + 50 * b + (2000 if b == 1 else 0) + 10 ** 6
        st[b, 0:2 * P:2], st[b, 1:2 * P:2] = 2 * (ns - ns[0]) + 12345, ns
        st[b, 2 * P], st[b, 2 * P + 1] = sms[b], 4
    got = phases(st.astype(np.int32), PHASES)
    loop = PHASES.index("main loop")
    for k, name in enumerate(PHASES):
        assert got[name]["med"] == pytest.approx((1000 + 100 * (2 * k + 1)) / 1e3)
    assert got["main loop per step"] == pytest.approx((1000 + 100 * (2 * loop + 1)) / 1e3 / 4)
    assert got["ghz"] == pytest.approx(2.0) and got["sms"] == 3
    share = sm_sharing(st.astype(np.int32), P)
    assert (share["blocks alone"], share["blocks shared"]) == (2, 2)
    end = (1000 * (P - 1) + 100 * (P - 1) ** 2) / 1e3
    assert share["last end shared us"] == pytest.approx(end + 2.05)      # block 1: 2000 + 50 ns after block 0
    assert share["last end alone us"] == pytest.approx(end + 0.15)       # block 3
    assert share["main loop alone us"] == pytest.approx((1000 + 100 * (2 * loop + 1)) / 1e3)


def test_stamps_emit(tmp_path, capsys):
    """The stamps tools' output: each row printed as it comes, all of them written as JSON at the end."""
    import json

    from tools.mla_stamps import emit
    rows = emit(iter([{"a": 1}, {"b": 2}]), str(tmp_path / "s.json"))
    assert rows == [{"a": 1}, {"b": 2}] == json.loads((tmp_path / "s.json").read_text())
    assert capsys.readouterr().out.splitlines() == ['stamps {"a": 1}', 'stamps {"b": 2}']
