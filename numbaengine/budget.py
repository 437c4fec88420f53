"""Budget "auto": each round, the tree size that maximizes expected committed tokens per second of round cost (for
a fixed batch: the soonest expected end of its slowest sequence).

Expected acceptance. The best-first heap pops nodes in decreasing path probability, and the surrogate's expected
number of accepted drafts of the tree made of the first n pops is the sum of their path probabilities; so one heap
run up to the largest ladder size gives every size at once (prefix sums). A Calibration scales that expectation by
what the target actually accepted in past rounds. A probed tree is also kept until its sequence has committed the
tokens after it (Hindsight): the target's samples do not depend on the tree (Exactness, below), so they tell what
every prefix size of the tree would have accepted, whichever size ran. The probes' calibration learns from that, a
choice of the root alone included: learning only from the size that ran, rounds that chose the root alone never saw
that trees would pay, and kept choosing it (the shipped pair on the H100: 11 probes in 504 batch-1 rounds, every one
chose the root alone, where fixed DDTree-16 made 1.59x AR's tokens per second).

Cost. A CostTable maps (batch, ladder size = drafted nodes per sequence) to the seconds of one round; a round's
verify has batch x (size + 1) rows. Size 0 is a round without drafting (what choosing 0 leads to: coasting, below),
so at a probe the choice weighs drafting at all against plain rounds.

Choice. For each ladder size s, one best-first selection over all sequences' nodes takes the batch x s most
probable (so confident sequences get deep trees and uncertain ones few nodes); the size with the most
(batch + calibrated expected accepted drafts) per second of round cost wins, ties to the smaller size. That is the
ragged rule of the host rounds. The device verifies a rectangle of n x (s + 1) rows (numbaengine/device_round.py),
so there every sequence gets s nodes (the rectangle rule, ragged=False); ragged trees on the device need verify
kernels over packed rows with a row -> sequence map (MLA, the tree kernels, the sampler).

A fixed batch (generate_batch: nothing joins when a sequence ends) instead takes the size with the soonest
expected end of its slowest sequence, round cost x max_i left_i / (1 + calibrated_i) with left_i the tokens it has
still to make (pick): the round's cost is paid until the last one is done, so a tree that pays on average but not
for the sequence the batch waits for loses. On the H100 with the shipped pair, 64 new tokens a prompt, it took
batch 8 from 0.47x to 0.80x of AR (the tokens-per-second rule ran trees there that paid per round while one slow
sequence decoded on alone).

Coasting. Where trees do not pay (large batches: the drafter costs more than it saves) the probe itself is the
waste: after a probe that chose the root alone the next rounds verify the root alone without drafting, 1, 2, 4, ..
COAST_MAX of them as size-0 choices repeat, until a probe chooses a tree or the round's cost row changes (the
table's batch that the round pays: on the device its bucket of slots; sequences joining and leaving within it keep
the coast, as trees pay no better for them: at batch 128 probing at every join or leave ran 2,000 probes in 6,384
rounds on the H200). There an auto round costs an ar round plus one probe per COAST_MAX rounds. The device rounds
keep the calibration between runs (DeviceSlots: dev.learned); every run starts its own coast with a probe.

Exactness. The choice reads only the drafter's probabilities, the cost table and the calibration of past rounds,
never the current round's target samples; and any tree gives the autoregressive output for the same seed (the
target's sampling noise is keyed by seed, sequence, position and token id, not by the tree), so auto's output
equals ar's, greedy and sampled.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from time import perf_counter

import numpy as np

from numbaengine.ddtree import (
    MAX_BUDGET,
    draft_tree,
    draft_trees,
    first_nodes,
    sample,
    verify_inputs,
    verify_trees,
)
from numbaengine.phases import span

AUTO = "auto"
LADDER = (0, 2, 4, 8, 16, 32, 64)         # drafted nodes per sequence; 0 = the root alone (autoregressive)
EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)   # calibration bins of the surrogate's expected accepted drafts
PRIOR = 1.0                               # accepted drafts' worth of observed = expected in every bin
DECAY = 0.9                               # a bin's sums are scaled by this at each new observation in it
HINDSIGHT_ROWS = 32                       # probed trees a probe keeps for hindsight at most (evenly spaced over its
                                          # runs): up to 32 x 6 observations a probe, at a host cost per probe
                                          # (record and settle, 2-core x86) of 0.1 ms at batch 1, 0.25 at 32 rows
COAST_MAX = 64                            # most rounds without a probe after a probe chose size 0 (a probe there
                                          # costs a draft and a heap: 1/64 of it is the most a coast adds)


# --- expected acceptance ------------------------------------------------------------------------------------------

def expected_accepts(tree):
    """f64[n+1]: [k] = the surrogate's expected accepted drafts of the tree of the tree's first k pops."""
    return prefix_accepts(tree.scores[1:])


def prefix_accepts(pops):
    """f64[n+1] from the path log-probs f64[n] of a tree's pops in order: [k] = the sum of the first k's
    probabilities."""
    return np.concatenate([[0.0], np.cumsum(np.exp(np.asarray(pops, np.float64)))])


@dataclass(frozen=True)
class Calibration:
    """Observed over expected accepted drafts per bin of expected (EDGES), from committed rounds:
    ratio = (PRIOR + observed) / (PRIOR + expected), both sums decayed by DECAY at each observation in the bin."""
    observed: tuple = (0.0,) * (len(EDGES) + 1)
    expected: tuple = (0.0,) * (len(EDGES) + 1)

    def ratio(self, e) -> float:
        b = bisect_right(EDGES, e)
        return (PRIOR + self.observed[b]) / (PRIOR + self.expected[b])

    def apply(self, e) -> float:
        """Calibrated expected accepted drafts for a surrogate expectation e."""
        return e * self.ratio(e)

    def apply_all(self, e):
        """apply over an array of expectations f64[...] (one pass: the device round's host share)."""
        b = np.searchsorted(EDGES, e, side="right")
        return e * ((PRIOR + np.asarray(self.observed))[b] / (PRIOR + np.asarray(self.expected))[b])

    def observe(self, e, accepted) -> "Calibration":
        """After a round: a tree with surrogate expectation e had `accepted` drafts accepted."""
        b = bisect_right(EDGES, e)
        return Calibration(decayed(self.observed, b, float(accepted)), decayed(self.expected, b, float(e)))

    def observe_many(self, e, accepted) -> "Calibration":
        """observe over arrays f64[m] of expectations and accepted drafts, in order (array operations)."""
        e, accepted = np.asarray(e, np.float64).ravel(), np.asarray(accepted, np.float64).ravel()
        k = len(self.observed)
        bins = np.searchsorted(EDGES, e, side="right")
        onehot = bins[:, None] == np.arange(k)
        later = np.cumsum(onehot[::-1], axis=0)[::-1][np.arange(len(e)), bins] - 1     # later ones in its bin
        w, scale = DECAY ** later, DECAY ** onehot.sum(axis=0)                        # the last weighs 1
        return Calibration(tuple((scale * self.observed + np.bincount(bins, w * accepted, k)).tolist()),
                           tuple((scale * self.expected + np.bincount(bins, w * e, k)).tolist()))

    def state(self) -> dict:
        return dict(edges=list(EDGES), ratio=[round((PRIOR + o) / (PRIOR + x), 4)
                                              for o, x in zip(self.observed, self.expected)],
                    observed=[round(o, 4) for o in self.observed], expected=[round(x, 4) for x in self.expected],
                    prior=PRIOR, decay=DECAY)


def decayed(sums, b, x):
    """sums with bin b scaled by DECAY and x added."""
    return sums[:b] + (DECAY * sums[b] + x,) + sums[b + 1:]


# --- cost ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostTable:
    """Seconds of one round per batch and ladder size (per model and GPU). A batch between listed ones takes the
    next listed batch (graphs are bucketed that way); above the largest, that one's seconds scale linearly."""
    sizes: tuple                               # the ladder, ascending: drafted nodes per sequence
    seconds: dict                              # batch -> tuple of seconds, one per size
    model: str = ""
    device: str = ""

    def __post_init__(self):
        sizes = list(self.sizes)
        if not sizes or sizes != sorted(set(sizes)) or not all(0 <= s <= MAX_BUDGET for s in sizes):
            raise ValueError(f"cost table: sizes {sizes} must be distinct ascending integers in 0..{MAX_BUDGET}")
        for b, row in self.seconds.items():
            if b < 1 or len(row) != len(sizes) or not all(0 < s < float("inf") for s in row):
                raise ValueError(f"cost table: batch {b} needs {len(sizes)} positive finite seconds, got {row}")
        if not self.seconds:
            raise ValueError("cost table: no batch rows")

    def round_s(self, batch, size) -> float:
        return float(self.row(batch)[self.sizes.index(size)])

    def row(self, batch):
        """f64[sizes]: the seconds of a round of `batch` sequences at each size."""
        b = self.listed(batch)
        return np.asarray(self.seconds[b], np.float64) * max(1.0, batch / b)

    def listed(self, batch) -> int:
        """The listed batch whose seconds a round of `batch` sequences pays (the next one up, else the largest)."""
        listed = sorted(self.seconds)
        return next((x for x in listed if x >= batch), listed[-1])

    @classmethod
    def from_dict(cls, d) -> "CostTable":
        """{"sizes": [...], "seconds": {"batch": [seconds per size]}, "model": ..., "device": ...}."""
        if not isinstance(d, dict) or "sizes" not in d or "seconds" not in d:
            raise ValueError("cost table: expected an object with 'sizes' and 'seconds' (batch -> seconds per size)")
        return cls(tuple(int(s) for s in d["sizes"]),
                   {int(b): tuple(float(x) for x in row) for b, row in d["seconds"].items()},
                   str(d.get("model", "")), str(d.get("device", "")))

    def to_dict(self) -> dict:
        return dict(model=self.model, device=self.device, sizes=list(self.sizes),
                    seconds={str(b): list(row) for b, row in sorted(self.seconds.items())})

    @classmethod
    def load(cls, path) -> "CostTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (ValueError, TypeError, AttributeError) as e:          # bad JSON, bad fields: one line naming the file
            raise ValueError(f"{path}: {e}") from None

    def save(self, path):
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def measure(round_s, batches=(1,), sizes=LADDER, model="", device="") -> CostTable:
    """The table from a timing function round_s(batch, size) -> seconds: on numpy `reference_round_s` (the kernel
    backends time their rounds' graphs: device_round.DeviceRounds.costs)."""
    return CostTable(tuple(sizes), {b: tuple(round_s(b, s) for s in sizes) for b in batches}, model, device)


def reference_round_s(target, drafter, ops, reps=3, prompt_len=8):
    """round_s for the numpy reference: the best of `reps` timings of `batch` rounds of one sequence (the reference
    runs a batch's sequences one after another) as an auto round runs them: the draft and the heap to the largest
    ladder size (the choice reads them), then verify of size + 1 rows after an 8-token prompt and the samples; size
    0 without the draft (a coasting round)."""
    width = max(LADDER) + 1
    cache, ctx = target.new_cache(prompt_len + width), drafter.new_context(prompt_len + width)
    positions = np.arange(prompt_len, dtype=np.int32)
    _, hidden = target.forward(positions % target.cfg.vocab_size, positions, cache, None,
                               hidden_layers=drafter.layer_ids, form=ops.prefill_form)
    cache.commit(positions)
    drafter.append(ctx, hidden, positions)

    def one(size):
        tree = first_nodes(draft_tree("ddtree", 0, drafter.draft(ctx, 0, prompt_len), max(LADDER)), size) if size \
            else draft_tree("ar", 0, None, 0)
        tokens, positions, mask = verify_inputs(tree, prompt_len)
        logits, _ = target.forward(tokens, positions, cache, mask, hidden_layers=drafter.layer_ids)
        sample(ops, logits, 0.0, 0, 0, positions)

    def round_s(batch, size):
        best = float("inf")
        for _ in range(reps):
            t0 = perf_counter()
            for _ in range(batch):
                one(size)
            best = min(best, perf_counter() - t0)
        return best
    return round_s


def reference_costs(target, drafter, ops) -> CostTable:
    """The numpy default: the reference round timed on this CPU at batch 1 (larger batches scale linearly), under
    the phase "costs" (about half a second on the shipped pair)."""
    with span("costs"):
        return measure(reference_round_s(target, drafter, ops), (1,), LADDER, model=f"{target.cfg.num_hidden_layers}"
                       f" layers, hidden {target.cfg.hidden_size}", device="cpu (numpy reference)")


# --- the choice ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """One round's sizes: the ladder size (batch total = batch x size) and each sequence's share of it."""
    size: int
    nodes: tuple             # drafted nodes per sequence
    expected: tuple          # surrogate expected accepted drafts of each sequence's tree
    calibrated: tuple        # the same, calibrated
    rate: float              # expected committed tokens per second of round cost
    probed: bool = True      # False: a coasting round, the root alone without a draft (root_choice)
    lagged: bool = False     # chosen from the drafts of the round before (the device's scored rounds)
    by_size: tuple = ()      # what the choice weighed, per ladder size: the sequences' mean expected accepted drafts
    cal_by_size: tuple = ()  # (by_size: the surrogate's; cal_by_size: calibrated)


def shares(pops, total):
    """Nodes per sequence of one best-first selection of `total` nodes over all the sequences' pops (path log-probs
    f64[n_i] in pop order, so every share is a prefix): larger path probability first, then lower sequence, then
    earlier pop."""
    scores = np.concatenate([np.asarray(p, np.float64) for p in pops] + [np.zeros(0)])
    seq = np.concatenate([np.full(len(p), i) for i, p in enumerate(pops)] + [np.zeros(0)]).astype(np.int64)
    pop = np.concatenate([np.arange(len(p)) for p in pops] + [np.zeros(0)]).astype(np.int64)
    order = np.lexsort((pop, seq, -scores))
    return np.bincount(seq[order[:total]], minlength=len(pops))


def choose(trees, table: CostTable, cal: Calibration, ragged=True, batch=None, left=None) -> Choice:
    """The ladder size with the most expected committed tokens per second (or, given `left`, the soonest expected
    end of the batch); trees are each sequence's heap run up to the largest size it may get (see choose_pops)."""
    return choose_pops([t.scores[1:] for t in trees], table, cal, ragged, batch, left)


def pick(calibrated, seconds, left=None) -> int:
    """Index of the best size: calibrated f64[sizes, n] expected accepted drafts per sequence, seconds f64[sizes]
    of a round. Without `left`: the most expected committed tokens per second. With left i64[n] (tokens each
    sequence has still to make, the batch fixed: nothing joins when one ends): the soonest expected end of the
    last sequence, cost x max_i left_i / (1 + calibrated_i), since the round's cost is paid until the slowest is
    done. Ties: the smaller size."""
    if left is None:
        return int(np.argmax((calibrated.shape[1] + calibrated.sum(axis=1)) / seconds))
    return int(np.argmin(seconds * np.max(np.asarray(left, np.float64) / (1.0 + calibrated), axis=1)))


def choose_pops(pops, table: CostTable, cal: Calibration, ragged=True, batch=None, left=None) -> Choice:
    """choose from each sequence's pops (path log-probs in pop order, as many as its tree may have). ragged: the
    size's batch total shared by path probability (host rounds); else every sequence gets the size (device rounds:
    the rectangle). batch: the round's batch for the cost (default the number of sequences; the device's bucket).
    left: see pick."""
    B = len(pops)
    cost_batch = B if batch is None else batch
    if not ragged:
        width = max([len(p) for p in pops] + [0])
        scores = np.full((B, width), -np.inf)
        for i, p in enumerate(pops):
            scores[i, :len(p)] = p
        return choose_rect(scores, np.full(B, width), table, cal, cost_batch, left)
    prefix = [prefix_accepts(p) for p in pops]
    nodes = np.array([shares(pops, B * size) for size in table.sizes]).reshape(len(table.sizes), B)
    raw = np.array([[float(p[n]) for p, n in zip(prefix, row)] for row in nodes]).reshape(nodes.shape)
    calibrated = np.array([[cal.apply(e) for e in row] for row in raw]).reshape(nodes.shape)
    return _choice(table, cost_batch, nodes, raw, calibrated, left)


def choose_rect(scores, rooms, table: CostTable, cal: Calibration, batch, left=None) -> Choice:
    """The rectangle rule in array operations (the device rounds' choice; on a 2-core x86 machine 33-39 us at
    batch 32 and 74-79 us at 128, against 180 us and 0.67 ms for a loop over sequences and sizes): scores
    f64[n, N], each row its pops' path log-probs in pop order, -inf past its tree; rooms i64[n], the nodes each
    sequence may get (cache rows left); batch: the bucket whose cost the round pays; left: see pick. Every
    sequence gets min(size, its pops, its room) nodes."""
    scores = np.asarray(scores, np.float64)
    n, N = scores.shape
    avail = np.minimum(np.isfinite(scores).sum(axis=1), np.asarray(rooms))
    prefix = np.zeros((n, N + 1))
    np.cumsum(np.exp(scores), axis=1, out=prefix[:, 1:])
    nodes = np.minimum(np.asarray(table.sizes)[:, None], avail[None, :])                # [sizes, n]
    raw = prefix[np.arange(n), nodes]
    return _choice(table, batch, nodes, raw, cal.apply_all(raw), left)


def _choice(table, batch, nodes, raw, calibrated, left) -> Choice:
    """The Choice of the best size (pick) from nodes, raw and calibrated f[sizes, n]."""
    seconds = np.asarray(table.row(batch), np.float64)
    k = pick(calibrated, seconds, left)
    rate = (nodes.shape[1] + calibrated[k].sum()) / seconds[k]
    return Choice(table.sizes[k], tuple(int(x) for x in nodes[k]), tuple(float(x) for x in raw[k]),
                  tuple(float(x) for x in calibrated[k]), float(rate),
                  by_size=tuple(float(x) for x in raw.mean(axis=1)),
                  cal_by_size=tuple(float(x) for x in calibrated.mean(axis=1)))


@lru_cache(maxsize=64)
def root_choice(n) -> Choice:
    """A coasting round's choice: the root alone for each of n sequences, not probed (one object per n: every
    sequence's Picks refers to it)."""
    return Choice(0, (0,) * n, (0.0,) * n, (0.0,) * n, 0.0, probed=False)


@dataclass(frozen=True)
class Coast:
    """Rounds left without a probe (left) and the length of the current coast (span): see "Coasting" above."""
    left: int = 0
    span: int = 0

    def after(self, choice: Choice) -> "Coast":
        """The coast after a round: a probed size 0 starts one twice the last (1 first, COAST_MAX at most), a
        coasting round counts down, a tree ends it."""
        if not choice.probed:
            return Coast(max(0, self.left - 1), self.span)
        if choice.size:
            return Coast()
        span = min(max(1, 2 * self.span), COAST_MAX)
        return Coast(span, span)


def auto_round(seqs, caps, target, drafter, ops, p, timer, table: CostTable, cal: Calibration, ragged=True,
               coast=Coast(), left=None):
    """One ddtree round with the sizes chosen from its drafts: one heap run per sequence up to caps[i] nodes, the
    choice (ragged or the rectangle rule; left: tokens each sequence has still to make, for a fixed batch, see
    pick), then verify of each tree's chosen prefix; while coasting, the root alone without drafting. Returns
    (choice, round outs, the probed trees (None while coasting: for Hindsight), coast after the round)."""
    probed = None
    if coast.left:
        choice = root_choice(len(seqs))
        trees = draft_trees(seqs, [0] * len(seqs), drafter, p, timer)
    else:
        trees = probed = draft_trees(seqs, caps, drafter, p, timer)
        with timer("build"):
            choice = choose(trees, table, cal, ragged, left=left)
            trees = [first_nodes(t, n) for t, n in zip(trees, choice.nodes)]
    outs = verify_trees(seqs, trees, target, drafter, ops, p, timer)
    return choice, outs, probed, coast.after(choice)


def observe(cal: Calibration, choice: Choice, taus) -> Calibration:
    """The calibration after a round: each sequence that verified drafts had tau - 1 of them accepted."""
    for e, n, tau in zip(choice.expected, choice.nodes, taus):
        cal = cal.observe(e, tau - 1) if n > 0 else cal
    return cal


# --- hindsight: what every prefix of a probed tree would have accepted ----------------------------------------------

@dataclass
class Hindsight:
    """One probe's trees, kept until their runs have committed the tokens after them (see the module docstring)."""
    runs: list               # the runs probed (rounds.Run: their output tokens and Picks)
    at: list                 # each run's output length at the probe: its root's children guess token `at` on
    tokens: np.ndarray       # i32[R, N] the trees' tokens in pop order, the root first
    parents: np.ndarray      # i32[R, N] each node's parent: the root -1, -2 past the nodes a run could get
    sizes: np.ndarray        # i64[R, S] the ladder's sizes > 0 cut to each tree; 0 where a cut repeats a size
    expected: np.ndarray     # f64[R, S] the surrogate's expected accepted drafts of those prefixes
    due: int                 # rounds after the probe's when every run still decoding has settled: the deepest
    rounds: int = 0          # node's depth + 1 (a walk stops at a leaf); rounds since, the probe's counted


def hindsight(runs, tokens, parents, scores, rooms, ladder) -> Hindsight | None:
    """The probe's record from its trees: tokens, parents i32[R, N] and scores f64[R, N] (pop order, the root
    first, -inf past a tree), rooms: the nodes each run could get; at most HINDSIGHT_ROWS of the runs, evenly
    spaced. None when no kept run's tree drafts."""
    keep = np.arange(0, len(runs), -(-len(runs) // HINDSIGHT_ROWS))
    runs, rooms = [runs[i] for i in keep], np.asarray(rooms)[keep]
    tokens, parents, scores = np.asarray(tokens)[keep], np.asarray(parents)[keep], np.asarray(scores, np.float64)[keep]
    R, N = scores.shape
    n = np.minimum(np.isfinite(scores[:, 1:]).sum(axis=1), np.asarray(rooms))           # nodes each run's tree has
    if not R or not n.any():
        return None
    cut = np.minimum(np.array([s for s in ladder if s > 0])[None, :], n[:, None])       # [R, S]
    sizes = np.where(np.diff(cut, axis=1, prepend=0) > 0, cut, 0)
    prefix = np.zeros((R, N))
    np.cumsum(np.where(np.arange(1, N) <= n[:, None], np.exp(scores[:, 1:]), 0.0), axis=1, out=prefix[:, 1:])
    parents = np.where(np.arange(N) <= n[:, None], np.asarray(parents, np.int64), -2)
    deepest, up = 0, parents                           # the deepest node: climb every node's ancestors at once
    while (up >= 0).any():
        deepest += 1
        up = np.where(up >= 0, np.take_along_axis(parents, np.maximum(up, 0), axis=1), -1)
    return Hindsight(list(runs), [len(r.tokens) for r in runs], np.asarray(tokens, np.int64), parents, sizes,
                     np.take_along_axis(prefix, sizes, axis=1), deepest + 1)


def tree_rows(trees) -> tuple:
    """Host trees as the device's probe returns them: tokens, parents i64[R, N] and scores f64[R, N], each row
    padded past its tree (parents -2, scores -inf)."""
    N = max(len(t) for t in trees)
    return tuple(np.stack([np.pad(np.asarray(getattr(t, f), dtype), (0, N - len(t)), constant_values=fill)
                           for t in trees])
                 for f, dtype, fill in (("tokens", np.int64, 0), ("parents", np.int64, -2),
                                        ("scores", np.float64, -np.inf)))


def accepted_by_size(h: Hindsight, committed) -> tuple:
    """What each prefix size of each tree would have accepted, from the tokens committed after its root (committed:
    a list per run) -> (accepted i64[R, S], settled bool[R]). The walk goes from the root along those tokens and stops
    at one that no child has, or at a leaf (settled; not when the tokens run out first); a prefix of s pops accepts
    the walk's nodes among its first s (a node pops after its parent, so they are a prefix of the walk). All runs in
    one pass per depth."""
    R, N = h.tokens.shape
    D = min(h.due, max([len(c) for c in committed] + [0]))
    seen, known = np.full((R, max(D, 1)), -1, np.int64), np.array([min(len(c), D) for c in committed])
    for i, c in enumerate(committed):
        seen[i, :known[i]] = c[:known[i]]
    node, path = np.zeros(R, np.int64), np.full((R, max(D, 1)), N, np.int64)
    live, settled = np.ones(R, bool), np.zeros(R, bool)
    for d in range(D):
        kids = h.parents == node[:, None]
        match = kids & (h.tokens == seen[:, d:d + 1])
        hit, has = match.any(axis=1), live & (d < known)
        settled |= (live & ~kids.any(axis=1)) | (has & ~hit)     # a leaf, or a token no child has
        live = has & hit
        node = np.where(live, match.argmax(axis=1), node)
        path[live, d] = node[live]
    settled |= live & ~(h.parents == node[:, None]).any(axis=1)
    return (path[:, None, :] <= h.sizes[:, :, None]).sum(axis=2), settled


def settle(cal: Calibration, pending: list, outs: dict) -> tuple:
    """After a round (outs: id(run) -> its RoundOut, tokens not yet pushed): every pending probe one round older;
    those due settle and teach the calibration (their runs' Picks record what they learned) -> (calibration, still
    pending)."""
    left = []
    for h in pending:
        h.rounds += 1
        if h.rounds < h.due:
            left.append(h)
            continue
        accepted, settled = accepted_by_size(h, [r.tokens[at:] + list(getattr(outs.get(id(r)), "tokens", ()))
                                                 for r, at in zip(h.runs, h.at)])
        use = settled[:, None] & (h.sizes > 0)
        for i in np.flatnonzero(settled):
            if h.runs[i].picks is not None:
                h.runs[i].picks.learn(h.sizes[i], h.expected[i], accepted[i])
        cal = cal.observe_many(h.expected[use], accepted[use]) if use.any() else cal
    return cal, left


@dataclass
class Picks:
    """One sequence's auto record: per round the batch's Choice and the sequence's index in it (two appends a round,
    no new objects: DeviceSlots adds every sequence's each round); cal: the batch's calibration after its latest
    round."""
    choices: list = field(default_factory=list)     # per round: the batch's Choice
    index: list = field(default_factory=list)       # per round: this sequence's index in it
    cal: Calibration = field(default_factory=Calibration)
    table_from: str = ""                # where the cost table came from: "given", "measured" or its saved file
    seen: dict = field(default_factory=dict)        # its probed trees in hindsight, settled: prefix size ->
    #                                                 [trees, sum of expected, sum of accepted drafts]

    def add(self, choice: Choice, i):
        self.choices.append(choice)
        self.index.append(i)

    @property
    def rounds(self):
        return zip(self.choices, self.index)

    @property
    def sizes(self) -> list:
        return [c.size for c in self.choices]

    @property
    def expected(self) -> list:
        return [c.expected[i] for c, i in self.rounds]

    @property
    def calibrated(self) -> list:
        return [c.calibrated[i] for c, i in self.rounds]

    def since(self, k) -> tuple:
        """Rounds k.. of the record: (the latest round's size, their expected and calibrated drafts summed)."""
        new = list(zip(self.choices[k:], self.index[k:]))
        return (new[-1][0].size, sum(c.expected[i] for c, i in new), sum(c.calibrated[i] for c, i in new))

    def learn(self, sizes, expected, accepted):
        """One settled tree: per prefix size (0: none), its expected and accepted drafts."""
        for k, e, a in zip(sizes.tolist(), expected.tolist(), accepted.tolist()):
            if k:
                row = self.seen.setdefault(k, [0, 0.0, 0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + e, row[2] + a

    def stats(self) -> dict:
        """budget_hist {size: rounds}, probes (rounds that drafted), mean nodes verified, expected tau (surrogate
        and calibrated; the observed one is tau_mean), what the choices weighed (expected_by_size and
        calibrated_by_size: per ladder size, the mean over the choices of expected accepted drafts; why a size
        won), what the probed trees' prefixes expected and would have accepted (hindsight: per prefix size, the mean
        over the settled trees), the calibration at the end and the cost table's origin."""
        weighed = [(c.by_size, c.cal_by_size) for c in self.choices if c.by_size]
        by = np.array([w[0] for w in weighed]) if weighed else np.zeros((0, 0))
        cal_by = np.array([w[1] for w in weighed]) if weighed else np.zeros((0, 0))
        sizes, nodes = self.sizes, [c.nodes[i] for c, i in self.rounds]
        return dict(budget_hist={s: sizes.count(s) for s in sorted(set(sizes))},
                    probes=sum(c.probed for c in self.choices), nodes_mean=mean(nodes),
                    expected_tau=1 + mean(self.expected), calibrated_tau=1 + mean(self.calibrated),
                    choices_weighed=len(weighed),
                    expected_by_size=[round(float(x), 4) for x in by.mean(axis=0)] if len(by) else [],
                    calibrated_by_size=[round(float(x), 4) for x in cal_by.mean(axis=0)] if len(by) else [],
                    hindsight=hindsight_stats(self.seen), calibration=self.cal.state(),
                    cost_table_from=self.table_from)


def hindsight_stats(seen) -> dict:
    """{sizes, trees, expected, accepted}: per prefix size, the settled trees and their mean expected and accepted
    drafts, from {size: [trees, sum expected, sum accepted]} (Picks.seen, or several added up)."""
    sizes = sorted(seen)
    return dict(sizes=sizes, trees=[seen[k][0] for k in sizes],
                expected=[round(seen[k][1] / seen[k][0], 4) for k in sizes],
                accepted=[round(seen[k][2] / seen[k][0], 4) for k in sizes])


def mean(xs) -> float:
    return float(np.mean(xs)) if xs else 0.0
