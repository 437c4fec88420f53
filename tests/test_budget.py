"""Budget "auto" (numbaengine/budget.py): expected acceptance from the heap's prefix sums, calibration, cost
tables, the chooser and its batch allocation; auto output equals autoregressive output; CLI and bench flags."""
import json

import numpy as np
import pytest
from test_generate import Oracle, pair  # noqa: F401  (pair: the tiny K2-style target and random drafter)

from numbaengine import run
from numbaengine.budget import (
    COAST_MAX,
    LADDER,
    Calibration,
    Coast,
    CostTable,
    choose,
    choose_pops,
    choose_rect,
    expected_accepts,
    measure,
    reference_costs,
    root_choice,
    shares,
)
from numbaengine.ddtree import build_tree, draft_tree, first_nodes
from numbaengine.engine import Engine
from numbaengine.generate import check_args, generate_batch
from tools.bench import budget_list, verify_rows

PROMPTS = [[5, 6, 7], [200, 2, 9, 41, 17], [8], [1, 2], [100], [33, 34, 35, 36], [250, 3], [77, 78, 79]]
N_NEW = 16


def table(seconds, batches=(1, 3, 8), sizes=LADDER):
    """A cost table with the same seconds per size at every batch."""
    return CostTable(tuple(sizes), {b: tuple(seconds) for b in batches})


PICK = {"ar": table([1, 9, 9, 9, 9, 9, 9]), "small": table([9, 1, 9, 9, 9, 9, 9]),
        "large": table([9, 9, 9, 9, 9, 9, 1])}
PICKED = {"ar": 0, "small": 2, "large": 64}


# --- expected acceptance --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True])
def test_prefix_sums_are_every_size_of_build_tree(quantized):
    """One heap run to 64 nodes: its first n pops are build_tree's tree for budget n, and the prefix sum of their path
    probabilities is that tree's expected accepted drafts, for every n (quantized logits tie a lot)."""
    rng = np.random.default_rng(3 + quantized)
    logits = rng.normal(size=(5, 40)).astype(np.float32)
    if quantized:
        logits = np.round(logits).astype(np.float32)
    big = draft_tree("ddtree", 7, logits, 64)
    prefix = expected_accepts(big)
    assert len(prefix) == 65 and prefix[0] == 0 and np.all(np.diff(prefix) > 0)
    for n in range(65):
        tree, head = draft_tree("ddtree", 7, logits, n), first_nodes(big, n)
        for field in ("tokens", "parents", "depths", "scores", "vis"):
            assert np.array_equal(getattr(head, field), getattr(tree, field)), (n, field)
        np.testing.assert_allclose(prefix[n], np.exp(tree.scores[1:]).sum(), rtol=1e-12, atol=0)


def test_spec_worked_example_expectation():
    """spec/DDTREE.md section 4: the 5-node tree expects .55+.33+.30+.297+.18 = 1.657 accepted drafts."""
    q = np.array([[.55, .30, .08], [.60, .30, .05], [.90, .05, .01]])
    tree = build_tree(0, np.arange(9, dtype=np.int32).reshape(3, 3), np.log(q).astype(np.float32), 5)
    assert expected_accepts(tree)[5] == pytest.approx(1.657, abs=1e-6)
    assert expected_accepts(first_nodes(tree, 3))[-1] == pytest.approx(.55 + .33 + .30, abs=1e-6)


# --- calibration ----------------------------------------------------------------------------------------------------

def test_calibration_moves_toward_observed():
    cal = Calibration()
    assert cal.ratio(3.0) == 1.0 and cal.apply(3.0) == 3.0                 # the prior: trust the drafter
    ratios = []
    for _ in range(40):                                                    # the target accepts a third of it
        cal = cal.observe(3.0, 1.0)
        ratios.append(cal.ratio(3.0))
    assert all(b < a for a, b in zip(ratios, ratios[1:]))
    assert ratios[-1] == pytest.approx((1 + 10) / (1 + 30), rel=1e-3)     # sums decay to 10 x one observation
    assert cal.ratio(0.3) == 1.0 and cal.ratio(9.0) == 1.0                 # other bins untouched
    for _ in range(40):                                                    # then twice what it expects
        cal = cal.observe(3.0, 6.0)
    assert cal.ratio(3.0) > 1.8 and cal.apply(3.0) == pytest.approx(3.0 * cal.ratio(3.0))
    state = cal.state()
    assert len(state["ratio"]) == len(state["edges"]) + 1 and state["decay"] == 0.9


def test_observe_many_is_observe_in_order():
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    cal = Calibration().observe(1.5, 2.0)
    e, acc = rng.uniform(0, 10, 60), rng.integers(0, 6, 60)
    one = cal
    for x, a in zip(e, acc):
        one = one.observe(x, a)
    many = cal.observe_many(e, acc)
    np.testing.assert_allclose(many.observed, one.observed, rtol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(many.expected, one.expected, rtol=1e-12, err_msg=f"seed {seed}")
    assert cal.observe_many([], []) == cal


# --- hindsight: what every prefix of a probed tree would have accepted ----------------------------------------------

def brute_accepts(tree, committed, size):
    """The accepted drafts of the tree of the first `size` pops along the committed tokens (None: they run out
    before the walk stops)."""
    node, accepted = 0, 0
    for t in committed:
        kids = [c for c in range(1, size + 1) if tree.parents[c] == node and tree.tokens[c] == t]
        if not kids:
            return accepted
        node, accepted = kids[0], accepted + 1
    leaf = not any(tree.parents[c] == node for c in range(1, size + 1))
    return accepted if leaf else None


def test_hindsight_is_each_prefix_walked():
    """accepted_by_size == a walk of each prefix tree (first_nodes) along the tokens committed after its root: along
    one of the tree's paths, then a token it lacks; cut short (unsettled, unless the walk sits on a leaf); trees cut
    by their room; one probe of trees of different sizes. settle waits `due` rounds, then teaches the calibration."""
    from types import SimpleNamespace

    from numbaengine.budget import (
        HINDSIGHT_ROWS,
        Picks,
        accepted_by_size,
        hindsight,
        settle,
        tree_rows,
    )
    seed = int(np.random.default_rng().integers(2 ** 31))
    rng = np.random.default_rng(seed)
    trees = [random_trees(rng, 1, size=int(rng.integers(1, 65)), V=int(rng.integers(3, 30)))[0] for _ in range(32)]
    rooms = rng.integers(0, 70, len(trees))
    runs = [SimpleNamespace(tokens=[5, 6], picks=Picks()) for _ in trees]
    h = hindsight(runs, *tree_rows(trees), rooms, LADDER)
    committed = []
    for tree in trees:
        node, path = 0, []
        while True:                                          # a random walk down the whole tree
            kids = [c for c in range(1, len(tree)) if tree.parents[c] == node]
            if not kids or rng.random() < 0.2:
                break
            node = kids[rng.integers(len(kids))]
            path.append(int(tree.tokens[node]))
        tail = [int(rng.integers(100, 200))] * int(rng.integers(0, 3))     # tokens no node has
        committed.append((path + tail)[:int(rng.integers(0, len(path) + len(tail) + 1))])
    accepted, settled = accepted_by_size(h, committed)
    for i, (tree, room, c) in enumerate(zip(trees, rooms, committed)):
        n = min(room, len(tree) - 1)
        sizes = sorted({min(s, n) for s in LADDER} - {0})
        assert sorted(set(h.sizes[i].tolist()) - {0}) == sizes, f"seed {seed}: tree {i}"
        want = [brute_accepts(tree, c, k) for k in sizes]
        got = {k: int(a) for k, a in zip(h.sizes[i], accepted[i]) if k}
        assert settled[i] == (None not in want) or not sizes, f"seed {seed}: tree {i} committed {c}"
        if settled[i]:
            assert [got[k] for k in sizes] == want, f"seed {seed}: tree {i} committed {c}: {got} != {want}"
            np.testing.assert_allclose([e for k, e in zip(h.sizes[i], h.expected[i]) if k],
                                       expected_accepts(tree)[sizes], err_msg=f"seed {seed}: tree {i}")
    assert not settled.all() and (accepted.max(axis=1)[settled] > 0).any(), f"seed {seed}"
    for r, c in zip(runs, committed):                        # settle: due rounds after the probe, not before
        r.tokens += c
    cal, left = Calibration(), [h]
    for _ in range(h.due - 1):
        cal, left = settle(cal, left, {})
    assert left == [h] and cal == Calibration()
    cal, left = settle(cal, left, {})
    use = settled[:, None] & (h.sizes > 0)
    assert left == [] and cal == Calibration().observe_many(h.expected[use], accepted[use]), f"seed {seed}"
    assert sum(sum(row[0] for row in r.picks.seen.values()) for r in runs) == use.sum()
    many = hindsight(runs * 4, *(np.tile(x, (4, 1)) for x in tree_rows(trees)), np.tile(rooms, 4), LADDER)
    assert len(many.runs) == HINDSIGHT_ROWS == 32 and many.runs[1] is runs[4]         # every 4th of 128 runs


class Timid(Oracle):
    """The oracle with a low peak: its first guess is always right, but it says so with a probability of about 3%
    (a surrogate that under-states acceptance ten-fold)."""
    def draft(self, ctx, bonus, start):
        return super().draft(ctx, bonus, start) / 6


def test_a_probe_that_chose_the_root_alone_still_learns(pair):  # noqa: F811
    """With a table where a tree pays only if the drafter is right more often than it says, the first probe chooses
    the root alone, and the hindsight of its tree (every prefix would have accepted its first draft) teaches the
    calibration, so later probes choose trees; the output is ar's. (Learning only from the size that ran, the
    rounds never left the root alone.)"""
    want = gen(pair, PROMPTS[:1], None, n=48)[0].tokens
    timid = Timid([PROMPTS[0] + want], pair.target.cfg.vocab_size)
    t = table([1.0] + [1.4] * (len(LADDER) - 1), batches=(1,))
    got = gen(pair, PROMPTS[:1], "auto", timid, n=48, cost_table=t)[0]
    st = got.stats
    assert got.tokens == want
    h = st["hindsight"]
    assert h["trees"] and all(a > 2 * e for e, a in zip(h["expected"], h["accepted"])), h
    assert st["budget_hist"].get(0, 0) > 0 and max(st["budget_hist"]) > 0, st["budget_hist"]


# --- cost tables ----------------------------------------------------------------------------------------------------

def test_cost_table_lookup_json_and_errors(tmp_path):
    t = CostTable((0, 2, 4), {1: (1.0, 2.0, 3.0), 8: (4.0, 5.0, 6.0)}, "m", "gpu")
    assert t.round_s(1, 2) == 2.0 and t.round_s(5, 4) == 6.0               # batch 5 runs in the batch-8 bucket
    assert t.round_s(16, 0) == 8.0                                          # above the largest: linear
    t.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == t
    assert CostTable.from_dict(json.loads((tmp_path / "t.json").read_text())) == t
    for bad, match in [(dict(sizes=[2, 0], seconds={"1": [1, 1]}), "ascending"),
                       (dict(sizes=[0, 2], seconds={"1": [1]}), "batch 1 needs 2"),
                       (dict(sizes=[0, 2], seconds={"1": [1, 0]}), "positive"),
                       (dict(sizes=[0], seconds={}), "no batch rows"), ([1, 2], "expected an object")]:
        with pytest.raises(ValueError, match=match):
            CostTable.from_dict(bad)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        CostTable.load(tmp_path / "bad.json")


def test_measure_hook_and_reference_default(pair):  # noqa: F811
    """measure() builds a table from any round_s(batch, size) (the cuda warmup's hook); the numpy default times
    the reference round at batch 1: positive seconds at every ladder size."""
    t = measure(lambda b, s: b * (1 + s), (1, 4), (0, 2))
    assert t.seconds == {1: (1, 3), 4: (4, 12)}
    ref = reference_costs(pair.target, pair.drafter, pair.target.ops)
    assert ref.sizes == LADDER and list(ref.seconds) == [1] and all(s > 0 for s in ref.seconds[1])


# --- the chooser ----------------------------------------------------------------------------------------------------

def random_trees(rng, n, size=64, V=30, L=4):
    return [draft_tree("ddtree", 0, (rng.normal(size=(L, V)) * rng.uniform(0.5, 4)).astype(np.float32), size)
            for _ in range(n)]


def brute_choice(trees, t, cal):
    """(size, nodes) maximizing (batch + calibrated expected) / seconds, first best on ties, by plain sorting."""
    nodes_of = {}
    best = None
    cands = sorted((-t_.scores[j], i, j) for i, t_ in enumerate(trees) for j in range(1, len(t_)))
    for s in t.sizes:
        nodes = [0] * len(trees)
        for _, i, _ in cands[:len(trees) * s]:
            nodes[i] += 1
        gain = len(trees) + sum(cal.apply(np.exp(trees[i].scores[1:n + 1]).sum()) for i, n in enumerate(nodes))
        rate = gain / t.round_s(len(trees), s)
        nodes_of[s] = tuple(nodes)
        if best is None or rate > best[1] * (1 + 1e-12):
            best = (s, rate)
    return best[0], nodes_of[best[0]]


@pytest.mark.parametrize("case", range(12))
def test_chooser_is_the_argmax(case):
    rng = np.random.default_rng(case)
    trees = random_trees(rng, 1 + case % 4)
    t = table(np.sort(rng.uniform(1, 3, len(LADDER))), batches=(1, 2, 3, 4))
    cal = Calibration().observe(rng.uniform(0.2, 3), rng.uniform(0, 3))
    got = choose(trees, t, cal)
    assert (got.size, got.nodes) == brute_choice(trees, t, cal)
    assert got.rate == pytest.approx((len(trees) + sum(got.calibrated)) / t.round_s(len(trees), got.size))


def brute_rectangle(trees, t, cal, batch):
    """(size, nodes) of the rectangle rule by plain loops: every sequence takes min(size, its pops) nodes, the round
    costs the bucket's seconds."""
    best = None
    for s in t.sizes:
        nodes = tuple(min(s, len(tr) - 1) for tr in trees)
        gain = len(trees) + sum(cal.apply(np.exp(tr.scores[1:n + 1]).sum()) for tr, n in zip(trees, nodes))
        rate = gain / t.round_s(batch, s)
        if best is None or rate > best[2] * (1 + 1e-12):
            best = (s, nodes, rate)
    return best[:2]


@pytest.mark.parametrize("case", range(8))
def test_rectangle_chooser_is_the_argmax(case):
    """The device rule (ragged=False): every sequence gets the size (short trees all they have), the cost is the
    bucket's (batch above the number of sequences), same from trees and from raw pops."""
    rng = np.random.default_rng(100 + case)
    trees = random_trees(rng, 1 + case % 3, size=int(rng.choice([3, 20, 64])))
    t = table(np.sort(rng.uniform(1, 3, len(LADDER))), batches=(1, 2, 4))
    cal = Calibration().observe(rng.uniform(0.2, 3), rng.uniform(0, 3))
    bucket = 4 if case % 2 else len(trees)
    got = choose(trees, t, cal, ragged=False, batch=bucket)
    assert (got.size, got.nodes) == brute_rectangle(trees, t, cal, bucket), f"case {case}"
    pops = choose_pops([tr.scores[1:] for tr in trees], t, cal, ragged=False, batch=bucket)
    assert pops == got
    rooms = rng.integers(0, 70, len(trees))                  # the device's form: a padded score matrix, cache rooms
    scores = np.full((len(trees), 80), -np.inf)
    for i, tr in enumerate(trees):
        scores[i, :len(tr) - 1] = tr.scores[1:]
    cut = [first_nodes(tr, min(int(r), len(tr) - 1)) for tr, r in zip(trees, rooms)]
    got = choose_rect(scores, rooms, t, cal, bucket)
    assert (got.size, got.nodes) == brute_rectangle(cut, t, cal, bucket), f"case {case} rooms {rooms}"
    assert got.rate == pytest.approx((len(trees) + sum(got.calibrated)) / t.round_s(bucket, got.size), rel=1e-12)


@pytest.mark.parametrize("case", range(6))
def test_drain_rule_is_the_soonest_end(case):
    """Given the tokens each sequence has left (a fixed batch), the size is the one with the smallest round cost x
    max over sequences of left / (1 + calibrated expected accepted drafts), by brute force; ragged and rectangle."""
    rng = np.random.default_rng(300 + case)
    trees = random_trees(rng, 2 + case % 3, size=int(rng.choice([8, 30])))
    t = table(np.sort(rng.uniform(1, 3, len(LADDER))), batches=(1, 2, 4))
    cal = Calibration().observe(rng.uniform(0.2, 3), rng.uniform(0, 3))
    left = rng.integers(1, 60, len(trees))
    for ragged in (True, False):
        got = choose(trees, t, cal, ragged=ragged, left=left)
        ends = {}
        for s in t.sizes:
            c = choose(trees, CostTable((s,), {b: (t.round_s(b, s),) for b in (1, 2, 4)}), cal, ragged=ragged)
            ends[s] = t.round_s(len(trees), s) * max(n / (1 + x) for n, x in zip(left, c.calibrated))
        assert got.size == min(ends, key=lambda s: (ends[s], s)), f"case {case} ragged {ragged}: {ends}"


def test_drain_rule_waits_for_the_slowest_sequence():
    """Throughput picks the tree that pays on average; the drain rule sees that the sequence with the most left and
    the least confident drafts would gain too little from it to pay the round's cost."""
    t = CostTable((0, 4), {2: (1.0, 2.0)})
    sure, unsure = np.log([0.9, 0.8, 0.7, 0.6]), np.log([0.2, 0.1, 0.05, 0.05])
    cal = Calibration()
    assert choose_pops([sure, unsure], t, cal).size == 4                          # (2 + 3.0 + 0.4) / 2 > 2 / 1
    assert choose_pops([sure, unsure], t, cal, left=[10, 10]).size == 0           # 2 x 10 / 1.4 > 1 x 10 / 1
    assert choose_pops([sure, unsure], t, cal, left=[40, 1]).size == 4            # the sure one is the slowest


@pytest.mark.parametrize("batch", [1, 3])
def test_rectangle_rule_on_the_host_equals_ar(pair, batch):  # noqa: F811
    """HostRounds(ragged=False), the device's rule on the reference round: ar's tokens; every sequence verified the
    chosen size (the 'small' table picks 2: each tree holds 2 nodes while the drafter has them)."""
    from numbaengine.generate import generate_on
    from numbaengine.rounds import HostRounds
    want = [r.tokens for r in gen(pair, PROMPTS[:batch], None, temperature=1.0, seed=4)]
    for name in ("small", "large"):
        rounds = HostRounds(pair.target, pair.drafter, 4096, table=PICK[name], ragged=False)
        got = generate_on(rounds, None, PROMPTS[:batch], N_NEW, "ddtree", "auto", 1.0, 4, stop=[])
        assert [r.tokens for r in got] == want, name
        for r in got:
            assert r.stats["budget_hist"] == {PICKED[name]: r.stats["rounds"]}
            assert r.stats["nodes_mean"] == PICKED[name]


def test_chooser_hand_made():
    """One sequence, path probabilities .55 .33 .30 .297 .18 (spec section 4): rates by hand."""
    q = np.array([[.55, .30, .08], [.60, .30, .05], [.90, .05, .01]])
    tree = build_tree(0, np.arange(9, dtype=np.int32).reshape(3, 3), np.log(q).astype(np.float32), 4)
    t = CostTable((0, 2, 4), {1: (1.0, 1.5, 2.0)})
    got = choose([tree], t, Calibration())
    assert got.size == 2 and got.nodes == (2,) and got.rate == pytest.approx((1 + .55 + .33) / 1.5, rel=1e-6)
    t = CostTable((0, 2, 4), {1: (1.0, 1.5, 1.6)})                          # now 4 nodes pay: 2.477 / 1.6
    assert choose([tree], t, Calibration()).size == 4
    half = Calibration()
    for _ in range(30):
        half = half.observe(0.88, 0.0).observe(1.477, 0.0)                # the target never accepts
    assert choose([tree], t, half).size == 0


def test_chooser_ties_go_to_the_smaller_size():
    root = draft_tree("ar", 0, None, 0)                                    # nothing drafted: every size expects 1
    assert choose([root, root], table([2, 2, 2, 2, 2, 2, 2]), Calibration()).size == 0
    two = build_tree(0, np.array([[1]], np.int32), np.array([[-0.1]], np.float32), 2)   # a 1-node tree
    t = CostTable((0, 2, 4), {1: (5.0, 1.0, 1.0)})                           # 2 and 4 nodes: the same tree, cost
    assert choose([two], t, Calibration()).size == 2


def test_batch_allocation_gives_the_confident_sequence_more_nodes():
    L, V = 5, 50
    confident = np.zeros((L, V), np.float32)
    confident[:, :4] = [6.0, 4.0, 3.0, 2.0]                                # per depth q ~ .76 .10 .04 .01 ...
    flat = np.random.default_rng(0).normal(scale=0.1, size=(L, V)).astype(np.float32)
    trees = [draft_tree("ddtree", 0, flat, 64), draft_tree("ddtree", 0, confident, 64)]
    pops = [t.scores[1:] for t in trees]
    nodes = shares(pops, 16)
    assert nodes.sum() == 16 and nodes[1] >= 10 > nodes[0]
    c = choose(trees, table([1, 1.05, 1.1, 1.2, 1.4, 1.8, 2.6], batches=(2,)), Calibration())
    assert c.size > 0 and c.nodes[1] > c.nodes[0] and c.calibrated[1] > 4 * c.calibrated[0]
    for total in range(0, 130, 7):                                          # each share is a prefix, total kept
        got = shares(pops, total)
        assert got.sum() == min(total, 128) and np.all(got >= shares(pops, max(0, total - 7)))


# --- coasting: no probe while trees do not pay ------------------------------------------------------------------

def coasted_probes(rounds):
    """Probed rounds among the first `rounds` when every probe chooses size 0: probe, coast 1, probe, coast 2, ..."""
    probes, r, span = 0, 0, 0
    while r < rounds:
        probes, r = probes + 1, r + 1
        span = min(max(1, 2 * span), COAST_MAX)
        r += span
    return probes


def test_coast_doubles_up_to_the_cap_and_a_tree_ends_it():
    zero, tree = Choice_of(0), Choice_of(2)
    c, lefts = Coast(), []
    for _ in range(300):
        c = c.after(zero if c.left == 0 else root_choice(3))
        lefts.append(c.left)
    starts = [x for prev, x in zip([0] + lefts, lefts) if x > prev]
    assert starts[:8] == [1, 2, 4, 8, 16, 32, 64, 64] and max(lefts) == COAST_MAX, starts
    assert Coast(5, 8).after(tree) == Coast() and Coast(5, 8).after(root_choice(1)) == Coast(4, 8)
    assert [coasted_probes(r) for r in (1, 2, 3, 5, 6, 10, 11, 15)] == [1, 1, 2, 2, 3, 3, 4, 4]


def Choice_of(size):
    """A probed choice of `size` for one sequence."""
    return choose_pops([np.zeros(size)], CostTable((0, size) if size else (0,), {1: (1.0, 0.5) if size else (1.0,)}),
                       Calibration())


class CoastDev:
    """DeviceRounds stand-in for DeviceSlots: records probe(), step(size) and scored steps ("scored", size); every
    sequence commits one token."""
    def __init__(self, ladder, n):
        from numbaengine.device_round import Shape
        self.shape, self.n, self.calls, self.gpu_s = Shape(n, "ddtree", max(ladder), 64, ladder), n, [], 0.0
        self.parked, self.reads = set(), 0                            # reads: scores() calls

    def bucket(self):
        top = max(set(range(self.n)) - self.parked, default=0) + 1
        return min(self.n, 1 << (top - 1).bit_length())

    def probe(self):
        self.calls.append("probe")
        return np.zeros((self.n, max(self.shape.ladder) + 1))        # every pop certain (log-prob 0)

    def scores(self):
        self.reads += 1
        return np.zeros((self.n, max(self.shape.ladder) + 1))

    def probe_trees(self):
        """The probe's trees: a chain of 7s (what every round commits)."""
        N = max(self.shape.ladder) + 1
        return np.full((self.n, N), 7, np.int32), np.tile(np.arange(-1, N - 1, dtype=np.int32), (self.n, 1))

    def step(self, size, scored=False):
        self.calls.append(("scored", size) if scored else size)
        return np.array([[1, 7] + [0] * 3] * self.n, np.int32)

    def retire(self, slots):
        pass


@pytest.mark.parametrize("cheap", [0, 2])
def test_device_slots_coast_without_probes(cheap):
    """DeviceSlots with a table where size 0 pays: probe + step(0), then step(0) alone for 1, 2, 4, .. rounds (no
    probe); where size 2 pays, one probe, then every round a scored round of size 2 (chosen from the last round's
    drafts); a sequence leaving within the bucket keeps the coast, a change of bucket (the round pays another row
    of the table) ends it."""
    from numbaengine.budget import Picks
    from numbaengine.ddtree import Params, Seq
    from numbaengine.generate import Timer
    from numbaengine.rounds import DeviceSlots, Run
    ladder = (0, 2)
    row = (1.0, 9.0) if cheap == 0 else (9.0, 1.0)
    slots = DeviceSlots(None, None, 64, 2, table=CostTable(ladder, {1: row, 2: row}), ladder=ladder, overlap=False)
    slots.dev = dev = CoastDev(ladder, 2)
    runs = [Run([1], 200, set(), Params(mode="ddtree"), "auto", i, 200, i, 1, Seq(i, None, None, 1, 0), picks=Picks())
            for i in range(2)]
    for _ in range(15):
        slots.step(runs, Timer(DeviceSlots.PHASES))
    probes = dev.calls.count("probe")
    if cheap == 0:
        assert probes == coasted_probes(15) == 4 and dev.calls[:5] == ["probe", 0, 0, "probe", 0], dev.calls
        assert runs[0].picks.stats()["probes"] == 4 and runs[0].picks.stats()["budget_hist"] == {0: 15}
        slots.step(runs[:1], Timer(DeviceSlots.PHASES))          # a sequence left, slot 1 not yet parked
        assert dev.calls[-1:] == [0], dev.calls
        dev.parked = {1}                                         # parked: the rounds cover bucket 1, probe now
        slots.step(runs[:1], Timer(DeviceSlots.PHASES))
        assert dev.calls[-2:] == ["probe", 0]
        slots.step(runs[:1], Timer(DeviceSlots.PHASES))
        assert dev.calls[-1:] == [0]
        dev.parked = set()                                       # it is back (bucket 2): probe now
        slots.step(runs, Timer(DeviceSlots.PHASES))
        assert dev.calls[-2:] == ["probe", 0]
    else:
        assert probes == 1 and dev.calls == ["probe", 2] + [("scored", 2)] * 14, dev.calls
        assert dev.reads == 14                                   # the probe's scores are not read twice
        assert runs[0].picks.stats()["budget_hist"] == {2: 15}
        slots.step(runs[:1], Timer(DeviceSlots.PHASES))          # other runs than it was chosen for: probe
        assert dev.calls[-2:] == ["probe", 2], dev.calls


def pushed(slots, runs):
    """slots.step(runs), each run's tokens pushed (what numbaengine/generate.py does after a round)."""
    from numbaengine.generate import Timer
    outs = slots.step(runs, Timer(type(slots).PHASES))
    for r in runs:
        r.tokens += outs[id(r)].tokens
    return outs


def test_device_slots_go_on_from_what_earlier_runs_learned():
    """Every generate_batch makes new DeviceSlots over the engine's cached rounds: they start from the calibrations
    the last run left on those rounds (dev.learned: the probes' trees in hindsight, and the lagged sizes), not from
    its coast (each run probes first); new rounds start afresh. The probes' calibration learns whichever size they
    chose, the root alone included (their chains of 7s would have accepted every 7 committed)."""
    from numbaengine.budget import Picks
    from numbaengine.ddtree import Params, Seq
    from numbaengine.rounds import DeviceSlots, Run
    ladder = (0, 2)

    def runs():
        return [Run([1], 200, set(), Params(mode="ddtree"), "auto", i, 200, i, 1, Seq(i, None, None, 1, 0),
                    picks=Picks()) for i in range(2)]
    for row, calls in (((1.0, 9.0), ["probe", 0, 0, "probe", 0, 0, 0, "probe", 0, 0]),
                       ((9.0, 1.0), ["probe", 2] + [("scored", 2)] * 8)):
        dev, learned = CoastDev(ladder, 2), []
        for _ in range(2):
            slots = DeviceSlots(None, None, 64, 2, cache={dev.shape: dev}, table=CostTable(ladder, {2: row}),
                                ladder=ladder, overlap=False)
            slots.build(dev.shape)
            learned.append((slots.cal, slots.cal_lagged))
            n0, rs = len(dev.calls), runs()
            for _ in range(len(calls) - calls.count("probe")):
                pushed(slots, rs)
            assert dev.calls[n0:] == calls, (row, dev.calls[n0:])
            learned.append((slots.cal, slots.cal_lagged))
        fresh = (Calibration(), Calibration())
        assert learned[0] == fresh and learned[2] == learned[1], learned        # the second starts from the first
        trees = row[0] > row[1]                                                 # one probe-chosen tree, then lagged
        assert (learned[1][0] != Calibration(), learned[1][1] != Calibration()) == (True, trees), learned
        assert learned[1][0].observed == learned[1][0].expected != fresh[0].expected    # 2 accepted, 2 expected
        assert learned[3][0] != learned[1][0]
        assert learned[3][1] != learned[1][1] or not trees                      # and goes on learning
    slots = DeviceSlots(None, None, 64, 2, cache={}, table=CostTable(ladder, {2: (1.0, 9.0)}), ladder=ladder)
    assert slots.coast == Coast() and slots.cal == slots.cal_lagged == Calibration()    # nothing learned yet


def test_bench_context_step_runs_auto_as_the_slots_do():
    """tools.bench's context rounds run auto as DeviceSlots: a probe first, then rounds chosen from the last one's
    trees as scored graphs; where size 0 pays, coasts without probes."""
    from tools.bench import context_step
    for row, want in (((9.0, 1.0), ["probe", 2] + [("scored", 2)] * 5),
                      ((1.0, 9.0), ["probe", 0, 0, "probe", 0, 0, 0, "probe", 0])):      # coasts of 1, then 2
        dev = CoastDev((0, 2), 2)
        dev.table = CostTable((0, 2), {1: row, 2: row})
        sizes, state = [], (Coast(), None)
        for _ in range(6):
            _, state = context_step(dev, sizes, *state)
        assert dev.calls == want and sizes == [want[1]] * 6, (row, dev.calls, sizes)
        assert dev.reads == want.count(("scored", 2)), dev.reads      # the probe's scores are not read twice


def test_device_slots_fits_settings():
    """Which runs join busy device rounds: in ddtree rounds of 16, ar runs and budgets up to 16 (not 17, dflash or
    auto); in auto rounds (ladder up to 64), auto runs, ar runs and fixed budgets up to 64; in ar rounds ar only;
    with nothing busy anything (the rounds are remade for it)."""
    from numbaengine.ddtree import Params
    from numbaengine.device_round import Shape
    from numbaengine.rounds import DeviceSlots, Run

    class Drafter:
        block_size = 16
    slots = DeviceSlots(None, Drafter(), 64, 2)

    def run(mode, budget=16):
        return Run([1], 8, set(), Params(mode=mode), budget)
    busy = [run("ddtree")]
    cases = {Shape(2, "ddtree", 16, 64): {("ar", 16): True, ("ddtree", 16): True, ("ddtree", 4): True,
                                          ("ddtree", 17): False, ("ddtree", "auto"): False, ("dflash", 16): False},
             Shape(2, "ddtree", 64, 64, (0, 2, 64)): {("ar", 16): True, ("ddtree", "auto"): True,
                                                       ("ddtree", 64): True, ("ddtree", 2): True,
                                                       ("ddtree", 65): False, ("dflash", 16): False},
             Shape(2, "ar", 0, 64): {("ar", 16): True, ("ddtree", 16): False, ("ddtree", "auto"): False}}
    for shape, want in cases.items():
        slots.dev = type("Dev", (), {"shape": shape})()
        got = {k: slots.fits(run(*k), busy) for k in want}
        assert got == want, f"{shape}: {got}"
        assert all(slots.fits(run(*k), []) for k in want), shape


# --- exactness: auto output == autoregressive output -----------------------------------------------------------------

def gen(pair_, prompts, budget, drafter=None, n=N_NEW, **kw):  # noqa: F811
    return generate_batch(pair_.target, drafter, None, prompts, n, mode="ar" if budget is None else "ddtree",
                          budget=budget or 16, stop=[], **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_auto_equals_ar(pair, batch, temperature):  # noqa: F811
    """Random drafter and an oracle, with tables that make the chooser pick AR, 2 and 64 nodes per sequence."""
    prompts, kw = PROMPTS[:batch], dict(temperature=temperature, seed=3)
    want = [r.tokens for r in gen(pair, prompts, None, **kw)]
    vocab = pair.target.cfg.vocab_size
    for name, cost in PICK.items():
        for drafter in (pair.drafter, Oracle([p + w for p, w in zip(prompts, want)], vocab)):
            results = gen(pair, prompts, "auto", drafter, cost_table=cost, **kw)
            assert [r.tokens for r in results] == want, (name, type(drafter).__name__)
            for r in results:
                assert r.stats["budget_hist"] == {PICKED[name]: r.stats["rounds"]} and r.stats["budget"] == "auto"
                want_probes = coasted_probes(r.stats["rounds"]) if name == "ar" else r.stats["rounds"]
                assert r.stats["probes"] == want_probes, (name, r.stats["rounds"], r.stats["probes"])
                if isinstance(drafter, Oracle) and name == "large":
                    assert r.stats["tau_mean"] > 3                         # the trees were walked deep


def test_auto_tracks_the_drafter(pair):  # noqa: F811
    """A table with a fixed cost and a cost per verify row: the oracle earns trees, the random drafter does not, and
    in one batch the sequence the oracle knows gets the nodes (tokens per second: rounds that others may join);
    for a fixed batch (generate_batch: the soonest end) the two the oracle does not know hold the batch back, so
    no round drafts."""
    from numbaengine.generate import generate_on
    from numbaengine.rounds import HostRounds
    rows = CostTable(LADDER, {b: tuple(1 + 0.05 * b * (s + 1) for s in LADDER) for b in (1, 3)})
    want = [r.tokens for r in gen(pair, PROMPTS[:3], None)]
    rand = gen(pair, PROMPTS[:3], "auto", pair.drafter, cost_table=rows)
    assert [r.tokens for r in rand] == want and all(set(r.stats["budget_hist"]) == {0} for r in rand)
    knows_first = Oracle([PROMPTS[0] + want[0]] + PROMPTS[1:3], pair.target.cfg.vocab_size)
    drained = gen(pair, PROMPTS[:3], "auto", knows_first, cost_table=rows)
    assert [r.tokens for r in drained] == want and all(set(r.stats["budget_hist"]) == {0} for r in drained)
    knows_first = Oracle([PROMPTS[0] + want[0]] + PROMPTS[1:3], pair.target.cfg.vocab_size)   # contexts anew
    mixed = generate_on(HostRounds(pair.target, knows_first, 4096, table=rows), None, PROMPTS[:3], N_NEW,
                        "ddtree", "auto", stop=[], drain=False)
    assert [r.tokens for r in mixed] == want
    s = [r.stats for r in mixed]
    assert max(s[0]["budget_hist"]) > 0 and s[0]["nodes_mean"] > 2 * max(s[1]["nodes_mean"], s[2]["nodes_mean"])
    assert s[0]["tau_mean"] > 3 and s[0]["expected_tau"] > 3 and 0 < s[0]["calibrated_tau"]
    assert s[1]["calibration"] == s[2]["calibration"]                       # one calibration for the batch (the
    #                                                                         oracle's run ended rounds earlier)
    for st, r in ((s[0], "oracle"), (rand[0].stats, "random")):              # what the choices weighed, per size
        by = st["expected_by_size"]
        assert st["choices_weighed"] == st["probes"] > 0 and len(by) == len(st["calibrated_by_size"]) == len(LADDER)
        assert by[0] == 0 and all(a <= b + 1e-12 for a, b in zip(by, by[1:])), (r, by)
    assert s[0]["expected_by_size"][-1] > 1 > rand[0].stats["expected_by_size"][-1]


def test_bench_auto_columns(pair, capsys):  # noqa: F811
    """tools.bench's auto columns over a case's prompts: choices weighed and the hindsight of every prompt's probes
    added up (trees-weighted means), printed under the row."""
    from tools.bench import print_auto, weighed
    want = gen(pair, PROMPTS[:2], None, n=24)
    oracle = Oracle([p + w.tokens for p, w in zip(PROMPTS, want)], pair.target.cfg.vocab_size)
    res = gen(pair, PROMPTS[:2], "auto", oracle, n=24, cost_table=PICK["small"])
    row = weighed(res)
    h, parts = row["hindsight"], [r.stats["hindsight"] for r in res]
    assert h["sizes"] == sorted(set().union(*(p["sizes"] for p in parts))) and h["sizes"], h
    for i, k in enumerate(h["sizes"]):
        rows = [(p["trees"][p["sizes"].index(k)], p["accepted"][p["sizes"].index(k)]) for p in parts
                if k in p["sizes"]]
        assert h["trees"][i] == sum(n for n, _ in rows)
        assert h["accepted"][i] == pytest.approx(sum(n * a for n, a in rows) / h["trees"][i], abs=1e-3)
    assert h["accepted"][-1] >= 1                                   # the oracle's trees: the first draft is right
    print_auto(dict(row, budget_hist=res[0].stats["budget_hist"], probes=res[0].stats["probes"]))
    assert "hindsight sizes" in capsys.readouterr().out


def test_auto_near_a_full_context(pair):  # noqa: F811
    """Trees shrink to the cache rows left; the output still equals ar's up to the full context."""
    want = gen(pair, PROMPTS[:2], None, n=40)
    got = gen(pair, PROMPTS[:2], "auto", pair.drafter, n=40, cost_table=PICK["large"], max_context=12)
    assert [r.tokens for r in got] == [r.tokens[:13 - len(p)] for r, p in zip(want, PROMPTS)]
    assert all(r.stats["stop_reason"] == "context" for r in got)


@pytest.fixture(scope="module")
def shipped():
    return Engine.load(backend="numpy")


SHIPPED_PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(", "x = [", "# sort the list",
                   "with open(path) as f:", "return"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_auto_equals_ar_shipped_pair(shipped, batch, temperature):
    """The shipped pair's trained drafter with the AR, small and large tables, and the measured default."""
    prompts, kw = SHIPPED_PROMPTS[:batch], dict(temperature=temperature, seed=2, stop=[])
    want = [r.tokens for r in shipped.generate_batch(prompts, 10, mode="ar", **kw)]
    for name, cost in PICK.items():
        results = shipped.generate_batch(prompts, 10, budget="auto", cost_table=cost, **kw)
        assert [r.tokens for r in results] == want, name
        assert all(r.stats["budget_hist"] == {PICKED[name]: r.stats["rounds"]} for r in results)
    if batch == 3:
        assert [r.tokens for r in shipped.generate_batch(prompts, 10, budget="auto", **kw)] == want
        assert shipped.costs is not None and shipped.costs.sizes == LADDER


# --- API, CLI, bench --------------------------------------------------------------------------------------------------

def test_budget_argument_checked(pair):  # noqa: F811
    check_args("ddtree", "auto", 4, 0.0, pair.drafter)
    for bad in ("many", -1, 10 ** 6, 2.5):
        with pytest.raises(ValueError, match="budget: .* or 'auto'"):
            check_args("ddtree", bad, 4, 0.0, pair.drafter)


def cli_args(pair_):  # noqa: F811
    return ["--prompt", "5 6 7", "--model", str(pair_.root / "target"), "--draft", str(pair_.root / "draft"),
            "--max-new-tokens", "9", "--stop", ""]


def test_cli_budget_auto(pair, tmp_path, capsys):  # noqa: F811
    want = gen(pair, [[5, 6, 7]], None, n=9)[0].tokens
    PICK["small"].save(tmp_path / "costs.json")
    argv = cli_args(pair) + ["--backend", "numpy", "--budget", "auto", "--json"]
    assert run.main(argv + ["--cost-table", str(tmp_path / "costs.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["stats"]["budget"] == "auto"
    assert out["stats"]["budget_hist"] == {"2": out["stats"]["rounds"]} and "calibration" in out["stats"]
    assert run.main(argv[:-1]) == 0                                             # the measured default, stats line
    line = capsys.readouterr().err.splitlines()[-2]
    assert line.startswith("ddtree (budget auto: sizes [") and "expected tau" in line


def test_cli_budget_auto_errors(pair, tmp_path, monkeypatch, capsys):  # noqa: F811
    cases = [(["--backend", "numpy", "--cost-table", "x.json"], "error: --cost-table is read by --budget auto only"),
             (["--backend", "numpy", "--budget", "auto", "--cost-table", str(tmp_path / "none.json")], "error: "),
             (["--backend", "numpy", "--budget", "many"], "error: argument --budget: 'many' is not an integer")]
    for extra, head in cases:
        assert run.main(cli_args(pair) + extra) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith(head) and not any("Traceback" in e for e in err), err


def test_bench_parses_auto():
    assert budget_list("auto,16") == ["auto", 16] and budget_list("4") == [4]
    assert verify_rows(8, "auto") == 8 * 65 and verify_rows(8, 16) == 8 * 17
