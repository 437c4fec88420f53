"""GPU tree build, walk and commit (kernels/tree.py) against numbaengine.ddtree: identical trees from the same
candidate lists (ties included), top-K lists equal to top_logprobs, the walk's path and bonus, the cache row moves
and the drafter-feature gather. Simulator cases run in a child process; K2-sized cases on a GPU (marked gpu)."""
import numpy as np
import pytest
from cudasim import Env, f64_lines, ptx_or_skip, simulator_test
from test_ptx import cpu_compute_capability  # noqa: F401  (autouse: sm_90 for device functions without a GPU)

from numbaengine.ddtree import build_tree, draft_tree, top_logprobs, walk
from numbaengine.reference import mask_bits


def random_lists(rng, L, K, quantized, peaked=False):
    """Per-depth candidates as in tests/test_tree.py: distinct ids, log-probs sorted descending (quantized tie;
    peaked: a confident drafter, top candidates near probability 1, long chains)."""
    ids = np.stack([rng.choice(max(50, 4 * K), K, replace=False) for _ in range(L)]).astype(np.int32)
    if quantized:
        lp = -rng.integers(0, 4, size=(L, K)) * 0.5 - 0.25
    elif peaked:
        lp = np.log(rng.dirichlet(np.r_[60.0, np.ones(K + 2)], size=L)[:, :K])
    else:
        lp = np.log(rng.dirichlet(np.ones(K + 3), size=L)[:, :K])
    return ids, (-np.sort(-lp, axis=1)).astype(np.float32)


def host_buffers(env, tb):
    from numbaengine.kernels.tree import TreeBuffers
    return TreeBuffers(*(env.host(getattr(tb, f)) for f in TreeBuffers.__dataclass_fields__))


def assert_tree(got, b, ref, start, seq_id, score_tol=0.0):
    n, N = len(ref), got.tokens.shape[1]
    assert got.ntok[b] == n, f"seq {b}: {got.ntok[b]} nodes, reference {n}"
    assert got.tokens[b, :n].tolist() == ref.tokens.tolist(), f"seq {b} tokens"
    assert got.parents[b, :n].tolist() == ref.parents.tolist(), f"seq {b} parents"
    assert got.depths[b, :n].tolist() == ref.depths.tolist(), f"seq {b} depths"
    assert (got.positions[b, :n] == start + ref.depths).all(), f"seq {b} positions"
    assert (mask_bits(got.vis[b], n) == ref.vis).all(), f"seq {b} visibility"
    assert np.abs(got.scores[b, :n] - ref.scores).max() <= score_tol, f"seq {b} path scores"  # both sum in f64
    assert (got.scores[b, n:] == -np.inf).all(), f"seq {b} padding scores"
    assert (got.sample_pos[b * N:b * N + n] == start + ref.depths + 1).all() and \
        (got.sample_seq[b * N:b * N + n] == seq_id).all(), f"seq {b} sampling keys"


def check_build(env, L=3, K=3, budgets=(9, 5, 0, 1), quantized=True, seed=0, peaked=False):
    """Trees from given candidate lists, several sequences with different budgets, vs build_tree."""
    from numbaengine.kernels.tree import tree_buffers, tree_build
    rng = np.random.default_rng(seed)
    B, N = len(budgets), max(budgets) + 1
    lists = [random_lists(rng, L, K, quantized and b % 2 == 0, peaked) for b in range(B)]
    tb = tree_buffers(env.zeros, B, L, K, N, 4 * K)
    tb.ids, tb.lp = env.dev(np.stack([i for i, _ in lists])), env.dev(np.stack([p for _, p in lists]))
    budgets, lengths = np.array(budgets, np.int32), rng.integers(0, 100, B).astype(np.int32)
    bonus, seq_ids = rng.integers(0, 50, B).astype(np.int32), np.arange(10, 10 + B, dtype=np.int32)
    for f in ("tokens", "parents", "depths", "positions", "ntok", "sample_pos"):
        setattr(tb, f, env.dev(np.full(getattr(tb, f).shape, -7, np.int32)))          # poison
    tb.scores = env.dev(np.full(tb.scores.shape, np.nan))
    tree_build(tb, env.dev(budgets), env.dev(lengths), env.dev(bonus), env.dev(seq_ids))
    got = host_buffers(env, tb)
    for b in range(B):
        assert_tree(got, b, build_tree(bonus[b], *lists[b], budgets[b]), lengths[b], seq_ids[b])


def check_topk(env, B=2, L=3, V=40, K=6, seed=1, calls=2):
    """tree_topk == top_logprobs: exact ties, a rounded row (many ties), a row whose first half is one value above
    all others (the best K are the lowest ids of a huge tie: chunk lists overflow, the exact slow path); called
    twice on fresh logits (the row histogram must be left zeroed)."""
    from numbaengine.kernels.tree import tree_buffers, tree_topk
    rng = np.random.default_rng(seed)
    tb = tree_buffers(env.zeros, B, L, K, 1, V)
    for _ in range(calls):
        logits = rng.normal(size=(B, L, V)).astype(np.float32)
        logits[0, 1, [5, 9, 11]] = 3.0                                             # exact ties: lower id first
        logits[-1, 0, :V // 2] = 7.0                                               # a huge tie on top
        logits[-1, -1, :] = np.round(logits[-1, -1, :])                            # many ties
        tb.ids, tb.lp = env.dev(np.full((B, L, K), -1, np.int32)), env.dev(np.full((B, L, K), np.nan, np.float32))
        tree_topk(env.dev(logits), tb)
        ids, lp = env.host(tb.ids), env.host(tb.lp)
        for b in range(B):
            want_ids, want_lp = top_logprobs(logits[b], K)
            assert (ids[b] == want_ids).all(), f"seq {b} ids"
            np.testing.assert_allclose(lp[b], want_lp, atol=2e-5, rtol=0)


def check_draft_pipeline(env, B=2, L=3, V=30, budgets=(7, 4), seed=2):
    """topk + build from drafter logits == draft_tree('ddtree') (continuous logits: no near-ties)."""
    from numbaengine.kernels.tree import tree_buffers, tree_build, tree_topk
    rng = np.random.default_rng(seed)
    logits = (3 * rng.normal(size=(B, L, V))).astype(np.float32)
    K, N = min(max(budgets), V), max(budgets) + 1
    tb = tree_buffers(env.zeros, B, L, K, N, V)
    tree_topk(env.dev(logits), tb)
    lengths, bonus = np.array([5, 9][:B], np.int32), np.array([1, 2][:B], np.int32)
    tree_build(tb, env.dev(np.array(budgets, np.int32)), env.dev(lengths), env.dev(bonus),
               env.dev(np.arange(B, dtype=np.int32)))
    got = host_buffers(env, tb)
    for b in range(B):
        assert_tree(got, b, draft_tree("ddtree", bonus[b], logits[b], budgets[b]), lengths[b], b,
                    score_tol=1e-4)                        # the kernel's log-softmax rounds unlike the reference's


def check_walk_commit(env, L=3, K=3, budgets=(9, 5, 0), D=16, layers=2, F=2, H=4, seed=3):
    """Build, then walk against target samples that follow random paths, then commit and gather."""
    from numbaengine.kernels.tree import (
        tree_buffers,
        tree_build,
        tree_commit,
        tree_walk,
    )
    rng = np.random.default_rng(seed)
    B, N = len(budgets), max(budgets) + 1
    lists = [random_lists(rng, L, K, False) for _ in range(B)]
    tb = tree_buffers(env.zeros, B, L, K, N, 4 * K)
    tb.ids, tb.lp = env.dev(np.stack([i for i, _ in lists])), env.dev(np.stack([p for _, p in lists]))
    lengths, bonus = np.array([7, 3, 11][:B], np.int32), np.array([40, 41, 42][:B], np.int32)
    d_len, d_bonus = env.dev(lengths), env.dev(bonus)
    tree_build(tb, env.dev(np.array(budgets, np.int32)), d_len, d_bonus, env.dev(np.arange(B, dtype=np.int32)))
    trees = [build_tree(bonus[b], *lists[b], budgets[b]) for b in range(B)]
    post = rng.integers(10**6, 10**6 + 9, B * N).astype(np.int32)                 # no child matches ...
    for b, t in enumerate(trees):                                                 # ... except along a path
        node = 0
        for _ in range(rng.integers(0, L + 1)):
            kids = [c for c in range(1, len(t)) if t.parents[c] == node]
            if not kids:
                break
            nxt = kids[rng.integers(0, len(kids))]
            post[b * N + node] = t.tokens[nxt]
            node = nxt
    tb.post = env.dev(post)
    tree_walk(tb, d_len, d_bonus)
    cap = int(lengths.max()) + N + 2
    cache = rng.integers(0, 65535, size=(layers, B, cap, D)).astype(np.uint16)
    hidden = rng.normal(size=(F, B, N, H)).astype(np.float32)
    d_cache, feats = env.dev(cache), env.dev(np.full((B, L + 1, F * H), np.nan, np.float32))
    feat_pos = env.dev(np.full((B, L + 1), -1, np.int32))
    tree_commit(tb, d_cache, env.dev(hidden), feats, feat_pos)
    got, new_cache = host_buffers(env, tb), env.host(d_cache)
    new_len, new_bonus, feats, feat_pos = env.host(d_len), env.host(d_bonus), env.host(feats), env.host(feat_pos)
    for b, t in enumerate(trees):
        path, nb = walk(t, post[b * N:b * N + len(t)])
        m, s0 = len(path), lengths[b]
        assert got.path[b, :m].tolist() == path.tolist() and got.nacc[b] == m, f"seq {b} path"
        assert got.out_tokens[b, :m + 1].tolist() == [m] + t.tokens[path[1:]].tolist() + [nb], f"seq {b} tokens"
        assert new_len[b] == s0 + m and new_bonus[b] == nb, f"seq {b} length / bonus"
        want = cache[:, b].copy()
        want[:, s0:s0 + m] = cache[:, b, s0 + path]                                 # LatentCache.commit
        assert (new_cache[:, b] == want).all(), f"seq {b} cache rows"
        assert np.array_equal(feats[b, :m], hidden[:, b, path].transpose(1, 0, 2).reshape(m, F * H))
        assert feat_pos[b, :m].tolist() == list(range(s0, s0 + m))
    # budget auto: an appending round sets ctx_from past its rows; a coasting round's rows go to their places in
    # the backlog of rows from ctx_from on (rows past its end are dropped), ctx_from kept
    R, nacc = 4, env.host(tb.nacc)
    ctx_from = env.dev(np.full(B, -1, np.int32))
    tree_commit(tb, d_cache, env.dev(hidden), env.dev(np.zeros_like(feats)), env.dev(np.zeros_like(feat_pos)),
                ctx_from)
    assert env.host(ctx_from).tolist() == (lengths + nacc).tolist()
    waiting = rng.integers(0, R, B).astype(np.int32)                               # rows already in the backlog
    backlog, bpos = env.dev(np.full((B, R, F * H), np.nan, np.float32)), env.dev(np.full((B, R), -1, np.int32))
    tree_commit(tb, d_cache, env.dev(hidden), backlog, bpos, env.dev(lengths - waiting), backlog=True)
    backlog, bpos = env.host(backlog), env.host(bpos)
    for b, t in enumerate(trees):
        path, _ = walk(t, post[b * N:b * N + len(t)])
        rows = [(waiting[b] + i, i) for i in range(len(path)) if waiting[b] + i < R]
        for r, i in rows:
            assert np.array_equal(backlog[b, r], hidden[:, b, path[i]].reshape(F * H)), f"seq {b} backlog row {r}"
            assert bpos[b, r] == lengths[b] + i, f"seq {b} backlog position {r}"
        untouched = [r for r in range(R) if r not in {r for r, _ in rows}]
        assert np.isnan(backlog[b, untouched]).all() and (bpos[b, untouched] == -1).all(), f"seq {b} backlog"


def check_sample_split(env, n=5, V=700, temperatures=(0, 0.7, 1.0), seed=6, unaligned=True):
    """kernels.sample.sample with a workspace (rows split over vocabulary chunks) == sample_ref: exact ties, a
    peaked row (most ids skip the noise's logs), -inf logits; the workspace starts as garbage. V % 4 == 0: the rows
    take 16-byte loads; with `unaligned`, then V - 2 ids at one temperature (4-byte loads, 2 ids per unit)."""
    from numbaengine.kernels.sample import sample, sample_work
    from numbaengine.reference import sample_ref
    rng = np.random.default_rng(seed)
    logits = (3 * rng.normal(size=(n, V))).astype(np.float32)
    logits[1 % n, [5, 9, V - 1]] = 50.0                                            # exact tie: lowest index wins
    logits[2 % n] *= 20                                                            # peaked
    logits[3 % n, ::3] = -np.inf
    seq = np.arange(n, dtype=np.int32) + 3
    pos = rng.integers(0, 100000, size=n).astype(np.int32)
    work = env.dev(np.full_like(sample_work(np.zeros, n + 2), 2 ** 63 + 7))
    for t in temperatures:
        want = sample_ref(logits, t, 99, seq, pos, np.empty(n, np.int32))
        out = env.dev(np.full(n, -1, np.int32))
        sample(env.dev(logits), t, 99, env.dev(seq), env.dev(pos), out, work=work)
        assert env.host(out).tolist() == want.tolist(), f"temperature {t}"
    if unaligned:
        check_sample_split(env, 4, V - 2, temperatures[1:2], seed + 1, unaligned=False)


SIM_CASES = {
    "build_ties_batch": lambda env: check_build(env),
    "build_deeper_wider": lambda env: check_build(env, L=4, K=3, budgets=(16, 20), quantized=True, seed=4),
    "build_chain_dflash": lambda env: check_build(env, L=4, K=1, budgets=(4, 2), seed=5),
    "topk_ties": lambda env: check_topk(env),
    "topk_chunks": lambda env: check_topk(env, B=1, L=2, V=1100, K=3, seed=8),
    # K = 150: more candidates than one warp sorts; continuous rows (sequence 0): ~40 past K in the threshold bin,
    # the sub-bin cut (_refine) leaves ~K, ranked by counting; the rounded row keeps ~650 (the block's bitonic
    # network); the slow path's K by counting. V % 4 != 0: no 16-byte loads
    "topk_chunks_ties": lambda env: check_topk(env, B=2, L=2, V=2101, K=150, seed=10),
    "build_exhausted": lambda env: check_build(env, L=2, K=2, budgets=(9, 3, 6), quantized=True, seed=12),
    "build_runs": lambda env: check_build(env, L=5, K=12, budgets=(40, 33, 7), quantized=True, seed=21),
    "build_runs_peaked": lambda env: check_build(env, L=7, K=6, budgets=(45, 20), quantized=False, seed=22,
                                                 peaked=True),
    "sample_split": lambda env: check_sample_split(env),
    "draft_pipeline": lambda env: check_draft_pipeline(env),
    "walk_commit_gather": lambda env: check_walk_commit(env),
}


test_simulator = simulator_test(__name__)


# --- GPU (K2 / DFlash shapes: L = 15 depths, budgets 0 / 1 / 16 / 255) ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [False, True])
def test_gpu_build(quantized):
    check_build(Env(gpu=True), L=15, K=255, budgets=(255, 16, 1, 0), quantized=quantized, seed=11)
    check_build(Env(gpu=True), L=15, K=255, budgets=(255, 64, 200), quantized=False, seed=15, peaked=True)
    check_build(Env(gpu=True), L=15, K=1024, budgets=(1024, 300), quantized=quantized, seed=16)


@pytest.mark.gpu
def test_gpu_topk_k2_vocab():
    check_topk(Env(gpu=True), B=2, L=15, V=163840, K=255)


@pytest.mark.gpu
def test_gpu_topk_wide():
    check_topk(Env(gpu=True), B=1, L=3, V=163840, K=1024, seed=13)
    check_topk(Env(gpu=True), B=3, L=2, V=163840, K=16, seed=14)


@pytest.mark.gpu
def test_gpu_sample_split():
    check_sample_split(Env(gpu=True), n=257, V=163840, temperatures=(0, 1.0, 0.6))
    check_sample_split(Env(gpu=True), n=17, V=163840, temperatures=(1.0,), seed=7)
    check_sample_split(Env(gpu=True), n=33, V=163838, temperatures=(0, 1.0), seed=8)          # no 16-byte loads


@pytest.mark.gpu
def test_gpu_draft_pipeline():
    check_draft_pipeline(Env(gpu=True), B=2, L=15, V=4096, budgets=(255, 16))


@pytest.mark.gpu
def test_gpu_walk_commit():
    check_walk_commit(Env(gpu=True), L=15, K=64, budgets=(255, 16, 1), D=576, layers=3, F=3, H=256)


# --- PTX for sm_90 (the build kernel sums scores in float64 on purpose, as the reference does) ---------------------

SIGS = {
    "topk_part_kernel": "void(float32[:,:,::1], int32, uint64[:,:,:,::1], float32[:,:,::1])",
    "topk_merge_kernel": "void(float32[:,:,::1], uint64[:,:,:,::1], float32[:,:,::1], int32[:,:,::1], "
                         "float32[:,:,::1])",
    "build_kernel": "void(int32[:,:,::1], float32[:,:,::1], int32[::1], int32[::1], int32[::1], int32[::1], "
                    "int32[:,::1], int32[:,::1], int32[:,::1], int32[:,::1], uint32[:,:,::1], int32[::1], "
                    "int32[::1], int32[::1], float64[:,::1])",
    "walk_kernel": "void(int32[:,::1], int32[:,::1], int32[::1], int32[::1], int32[::1], int32[::1], int32[:,::1], "
                   "int32[::1], int32[::1], int32[:,::1])",
    "commit_kernel": "void(uint32[:,:,:,::1], int32[:,::1], int32[::1], int32[::1])",
    "gather_kernel": "void(float32[:,:,:,::1], int32[:,::1], int32[::1], int32[::1], float32[:,:,::1], int32[:,::1], "
                     "int32[::1], int32[::1], boolean)",
}


SAMPLE_SIGS = {
    "sample_part_kernel": "void(float32[:,::1], float32, boolean, uint64, int32[::1], int32[::1], boolean, "
                          "uint64[:,::1])",
    "sample_merge_kernel": "void(uint64[:,::1], int32, int32, int32[::1])",
}


@pytest.mark.parametrize("name", sorted(SAMPLE_SIGS))
def test_ptx_sample_split(name):
    import numbaengine.kernels.sample as S
    ptx = ptx_or_skip(getattr(S, name).py_func, SAMPLE_SIGS[name])
    assert not f64_lines(ptx), f64_lines(ptx)[:5]
    assert ".local" not in ptx, "registers spilled to local memory"
    if name == "sample_part_kernel":
        assert "ld.global.nc.v4" in ptx, "no 16-byte loads"


@pytest.mark.parametrize("name", sorted(SIGS))
def test_ptx_tree(name):
    import numbaengine.kernels.topk as topk
    import numbaengine.kernels.tree as tree
    ptx = ptx_or_skip(getattr(topk if name.startswith("topk") else tree, name).py_func, SIGS[name])
    if name != "build_kernel":
        assert not f64_lines(ptx), f64_lines(ptx)[:5]


def test_ptx_commit_slot_prefix():
    """The commit kernel over a slot prefix of the rounds' cache (cache32[:, :n], batch buckets: not contiguous)
    compiles for sm_90 like the contiguous one: no float64, no spills."""
    import numbaengine.kernels.tree as tree
    sig = SIGS["commit_kernel"].replace("uint32[:,:,:,::1]", "uint32[:,:,:,:]")
    ptx = ptx_or_skip(tree.commit_kernel.py_func, sig)
    assert not f64_lines(ptx) and ".local" not in ptx
