"""The DDTree builder and walk against brute force and the worked example of spec/DDTREE.md section 4."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from numbaengine.ddtree import (
    Seq,
    build_tree,
    commit,
    draft_tree,
    top_logprobs,
    verify_inputs,
    visibility,
    walk,
)


def brute_force(ids, lp, budget):
    """All prefixes of length <= L over the top-K lists, best `budget` by (-score, rank tuple).
    Scores are summed root to leaf in float64, the builder's order, so ties are exact."""
    L, K = ids.shape
    paths = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            score = 0.0
            for depth, r in enumerate(ranks):
                score += float(lp[depth, r])
            paths.append((-score, ranks))
    return sorted(paths)[:budget]


def random_lists(rng, L, K, quantized):
    """Per-depth candidate lists: distinct ids, log-probs sorted descending (quantized ones tie a lot)."""
    ids = np.stack([rng.choice(50, K, replace=False) for _ in range(L)]).astype(np.int32)
    if quantized:
        lp = -rng.integers(0, 4, size=(L, K)) * 0.5 - 0.25
    else:
        lp = np.log(rng.dirichlet(np.ones(K + 3), size=L)[:, :K])
    lp = -np.sort(-lp, axis=1)
    return ids, lp.astype(np.float32)


def ranks_of(tree, node):
    """Rank tuple of a node, recovered from its path of tokens."""
    path = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


CASES = [(L, K, B) for L in (1, 2, 3, 4) for K in (1, 2, 3) for B in (1, 2, 5, 9, 20)]


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("L,K,B", CASES)
def test_builder_equals_brute_force(L, K, B, quantized):
    rng = np.random.default_rng(1000 * L + 100 * K + B + quantized)
    ids, lp = random_lists(rng, L, K, quantized)
    tree = build_tree(7, ids, lp, B)
    want = brute_force(ids, lp, B)
    assert len(tree) == 1 + len(want)
    got = []
    for node in range(1, len(tree)):
        path = ranks_of(tree, node)
        ranks = tuple(int(np.flatnonzero(ids[d] == tree.tokens[n])[0]) for d, n in enumerate(path))
        got.append((-tree.scores[node], ranks))
    assert got == want                       # same set, same (pop) order, same scores
    for node in range(1, len(tree)):         # topological, depths consistent
        p = tree.parents[node]
        assert 0 <= p < node and tree.depths[node] == tree.depths[p] + 1
    assert tree.parents[0] == -1 and tree.depths[0] == 0 and tree.tokens[0] == 7
    for i in range(len(tree)):               # visibility = ancestor-or-self
        anc = {i}
        j = i
        while tree.parents[j] >= 0:
            j = tree.parents[j]
            anc.add(j)
        assert set(np.flatnonzero(tree.vis[i])) == anc


def test_siblings_differ():
    rng = np.random.default_rng(3)
    ids, lp = random_lists(rng, 4, 3, True)
    tree = build_tree(0, ids, lp, 30)
    pairs = [(p, t) for p, t in zip(tree.parents[1:], tree.tokens[1:])]
    assert len(pairs) == len(set(pairs))


# spec/DDTREE.md section 4: Lb = 4, B = 5; tokens as small ids A=1, B=2, ...
A, B, C, D, E, F, G, H, I, J, K, Lt, M, N, O, X = range(1, 17)
BONUS = 99


def worked_lists():
    ids = np.array([[A, B, C, D, E], [F, G, H, I, J], [K, Lt, M, N, O]], np.int32)
    probs = np.array([[.55, .30, .08, .04, .03], [.60, .30, .05, .03, .02], [.90, .05, .03, .01, .01]])
    return ids, np.log(probs).astype(np.float32)


def test_worked_example():
    ids, lp = worked_lists()
    tree = build_tree(BONUS, ids, lp, 5)
    assert tree.tokens.tolist() == [BONUS, A, F, B, K, F]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 2, 3]
    assert tree.depths.tolist() == [0, 1, 2, 1, 3, 2]
    rows = [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 1, 2, 4}, {0, 3, 5}]
    assert [set(np.flatnonzero(r)) for r in tree.vis] == rows
    assert np.exp(tree.scores[1:]).sum() == pytest.approx(1.657, abs=1e-6)
    tokens, positions, mask = verify_inputs(tree, 7)
    assert positions.tolist() == [7, 8, 9, 8, 10, 9] and mask is tree.vis
    post = np.array([B, 0, 0, F, 0, X], np.int32)         # target argmaxes at nodes 0, 3, 5
    path, bonus = walk(tree, post)
    assert path.tolist() == [0, 3, 5] and bonus == X
    assert tree.tokens[path].tolist() == [BONUS, B, F]


def test_walk_stops_at_root_and_runs_to_leaf():
    ids, lp = worked_lists()
    tree = build_tree(BONUS, ids, lp, 5)
    path, bonus = walk(tree, np.full(6, X, np.int32))
    assert path.tolist() == [0] and bonus == X
    path, bonus = walk(tree, np.array([A, F, K, 0, O, 0], np.int32))
    assert path.tolist() == [0, 1, 2, 4] and bonus == O


def test_top_logprobs():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 40)).astype(np.float32)
    logits[1, [5, 9]] = 10.0                               # exact tie: lower id first
    ids, lp = top_logprobs(logits, 4)
    assert ids[1, :2].tolist() == [5, 9]
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    for d in range(3):
        assert ids[d].tolist() == np.argsort(-p[d], kind="stable")[:4].tolist()
        np.testing.assert_allclose(lp[d], np.log(p[d, ids[d]]), atol=1e-5)


def test_modes():
    ids, lp = worked_lists()
    logits = np.full((3, 20), -5.0, np.float32)
    for d in range(3):
        logits[d, ids[d]] = lp[d] + 5               # same ranking as the worked lists
    chain = draft_tree("dflash", BONUS, logits, 3)
    assert chain.tokens.tolist() == [BONUS, A, F, K] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert (chain.vis == np.tril(np.ones((4, 4), bool))).all()
    assert draft_tree("dflash", BONUS, logits, 2).tokens.tolist() == [BONUS, A, F]
    root = draft_tree("ar", BONUS, None, 16)
    assert root.tokens.tolist() == [BONUS] and root.vis.tolist() == [[True]]
    assert draft_tree("ddtree", BONUS, logits, 0).tokens.tolist() == [BONUS]
    assert draft_tree("ddtree", BONUS, logits, 5).tokens.tolist() == [BONUS, A, F, B, K, F]
    assert len(draft_tree("ddtree", BONUS, logits, 50)) == 51


def test_visibility_chain():
    assert (visibility([-1, 0, 1]) == np.tril(np.ones((3, 3), bool))).all()


def test_worked_example_commit():
    """Section 4: accepted [0, 3, 5] at start 7 -> cache rows 7, 10, 12 move to 8.., features of rows 0, 3, 5."""
    calls = {}
    cache = SimpleNamespace(commit=lambda rows: calls.setdefault("rows", rows.tolist()))
    drafter = SimpleNamespace(append=lambda ctx, hidden, pos: calls.update(hidden=hidden.tolist(), pos=pos.tolist()))
    ids, lp = worked_lists()
    tree = build_tree(BONUS, ids, lp, 5)
    seq = Seq(0, cache, None, 7, BONUS)
    hidden = np.arange(6, dtype=np.float32).reshape(1, 6, 1)                # feature of node i = i
    new = commit(seq, tree, np.array([0, 3, 5], np.int32), X, hidden, drafter)
    assert new == [B, F, X] and (seq.start, seq.bonus) == (10, X)
    assert calls == dict(rows=[7, 10, 12], hidden=[[[0.0], [3.0], [5.0]]], pos=[7, 8, 9])
