"""DDTree, one decoding round read top to bottom (spec/DDTREE.md sections 2-4).

The drafter proposes per-depth marginals q_1..q_L for the L = Lb-1 tokens after the bonus token. The B most
probable prefixes under q(path) = prod q_d form the draft tree (best-first heap). The target scores every node in
one forward pass with an ancestor-only mask, draws one sample per node, and the walk follows the children that
match. Accepted rows are compacted in the target cache and their features extend the drafter context.

DFlash (the single chain of per-depth argmaxes) is the same tree with one candidate per depth; autoregressive
decoding is the tree with the root only. All three share `decode_round`, after one `prefill` of the prompt.
numbaengine/generate.py `decode` runs prefills and rounds until the outputs are complete (numbaengine/rounds.py:
this round on the host, or the same round batched on the device, numbaengine/device_round.py).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

MODES = ("ddtree", "dflash", "ar")
MAX_BUDGET = 1024           # the largest budget the DDTree paper sweeps


# --- 1. per-depth candidates -------------------------------------------------------------------------------------

def top_logprobs(logits, k):
    """Top-k token ids per depth (larger logit first, lower id first among equals) and their log-probabilities
    at temperature 1 (top logits minus logsumexp): logits f32[L, V] -> ids i32[L, k], lp f32[L, k]."""
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]                 # [L, k]
    top = np.take_along_axis(logits, ids, axis=1)                           # [L, k] f32
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))         # [L, 1] f32
    return ids.astype(np.int32), (top - lse).astype(np.float32)


# --- 2. the tree ---------------------------------------------------------------------------------------------------

@dataclass
class Tree:
    """A draft tree. Node 0 is the root (the bonus token); nodes 1..n in pop order, so parents[i] < i."""
    tokens: np.ndarray       # [n+1] i32
    parents: np.ndarray      # [n+1] i32, root -1
    depths: np.ndarray       # [n+1] i32, root 0
    scores: np.ndarray       # [n+1] f64, log q(path) under the drafter surrogate, root 0
    vis: np.ndarray          # [n+1, n+1] bool, vis[i, j]: node j is node i or one of its ancestors

    def __len__(self):
        return len(self.tokens)


def first_nodes(tree, n):
    """The tree of the first n pops: the best-first heap pops in decreasing path probability, so these n nodes are
    the tree build_tree makes for budget n (same nodes, same order); n >= len(tree) - 1 keeps the whole tree."""
    k = n + 1
    return Tree(tree.tokens[:k], tree.parents[:k], tree.depths[:k], tree.scores[:k], tree.vis[:k, :k])


def build_tree(bonus, ids, lp, budget):
    """The `budget` most probable prefixes of the factorized drafter distribution, by a best-first heap.

    ids i32[L, K], lp f32[L, K] (sorted descending per depth). Heap entries (-score, ranks, parent, depth, rank):
    `ranks` is the tuple of candidate ranks along the path, so equal scores pop in lexicographic rank order.
    A node's score is its parent's score plus its own log-prob (one float64 sum per depth, root to leaf).
    """
    L, K = ids.shape
    tokens, parents, depths, scores = [int(bonus)], [-1], [0], [0.0]
    heap = [(-float(lp[0, 0]), (0,), 0, 1, 0)] if budget > 0 and L > 0 and K > 0 else []
    while heap and len(tokens) <= budget:
        neg_score, ranks, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg_score)
        if rank + 1 < K:        # next sibling: same parent, next candidate at this depth
            score = scores[parent] + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-score, ranks[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < L:           # first child: best candidate one depth further
            score = scores[node] + float(lp[depth, 0])
            heapq.heappush(heap, (-score, ranks + (0,), node, depth + 1, 0))
    return Tree(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depths, np.int32),
                np.array(scores, np.float64), visibility(parents))


def visibility(parents):
    """Ancestor-or-self matrix bool[n+1, n+1] for a topologically numbered tree."""
    n = len(parents)
    vis = np.zeros((n, n), bool)
    for i, p in enumerate(parents):
        if p >= 0:
            vis[i] = vis[p]
        vis[i, i] = True
    return vis


def draft_tree(mode, bonus, draft_logits, budget):
    """The tree a mode verifies: ddtree = best `budget` prefixes; dflash = the argmax chain (L nodes, causal);
    ar = the root alone. draft_logits f32[L, V] (None in ar mode)."""
    if mode == "ar" or budget == 0:
        return build_tree(bonus, np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32), 0)
    L, V = draft_logits.shape
    if mode == "dflash":
        ids, lp = top_logprobs(draft_logits, 1)
        return build_tree(bonus, ids[:budget], lp[:budget], budget)     # budget = chain length here
    ids, lp = top_logprobs(draft_logits, min(budget, V))
    return build_tree(bonus, ids, lp, budget)


# --- 3. verify, walk, commit ---------------------------------------------------------------------------------------

def verify_inputs(tree, start):
    """Target inputs for the tree: tokens i32[n+1], positions i32[n+1] = start + depth, mask bool[n+1, n+1]."""
    return tree.tokens, (start + tree.depths).astype(np.int32), tree.vis


def sample(ops, logits, temperature, seed, seq, positions):
    """One token per row of logits f32[n, V] given input positions i32[n]. The noise is keyed by the position
    of the token being chosen (input position + 1), so every node at one depth shares it."""
    n = logits.shape[0]
    seqs = np.full(n, seq, np.int32)
    return ops.sample(logits, temperature, seed, seqs, (positions + 1).astype(np.int32), np.empty(n, np.int32))


def walk(tree, post):
    """Follow the children that match the target's samples. post i32[n+1] = the sample at each node.
    Returns (accepted node ids i32[m] in path order, root first; the new bonus token)."""
    child = {(int(p), int(t)): c for c, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if c > 0}
    path = [0]
    while (path[-1], int(post[path[-1]])) in child:
        path.append(child[path[-1], int(post[path[-1]])])
    return np.array(path, np.int32), int(post[path[-1]])


@dataclass
class Seq:
    """One sequence being decoded: its target cache, drafter context and position."""
    index: int               # sequence index in the batch; keys the sampling noise
    cache: object            # target latent cache; committed rows [0, start)
    ctx: object              # drafter context K/V (None without a drafter)
    start: int               # absolute position of the bonus token = number of committed tokens
    bonus: int               # last token produced, not yet in the cache


def commit(seq, tree, path, bonus, hidden, drafter):
    """Keep the accepted rows: target cache rows start+path move to start..start+m-1; the drafter context gets
    their features hidden f32[F, n+1, H] at those positions. Returns the m new output tokens (the accepted
    drafts, then the new bonus; the old bonus at the root was output by the previous round)."""
    m = len(path)
    seq.cache.commit((seq.start + path).astype(np.int32))
    if drafter is not None:
        drafter.append(seq.ctx, hidden[:, path], np.arange(seq.start, seq.start + m, dtype=np.int32))
    seq.start += m
    seq.bonus = bonus
    return [int(t) for t in tree.tokens[path[1:]]] + [bonus]


# --- 4. prefill, then rounds ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class RoundOut:
    """What one round did for one sequence."""
    tree: Tree
    accepted: np.ndarray     # [m] i32 node ids, root first
    tokens: list             # the m new output tokens: accepted drafts then the new bonus
    tau: int                 # m = tokens committed to the cache this round


@dataclass(frozen=True)
class Params:
    """How to decode: mode (ddtree | dflash | ar), sampling temperature (0 = greedy) and noise seed."""
    mode: str = "ddtree"
    temperature: float = 0.0
    seed: int = 0


def prefill(index, ids, target, drafter, ops, p: Params, max_len) -> Seq:
    """Before the first round: the target over the prompt ids (MLA in ops.prefill_form) into a cache of max_len rows;
    the drafter context gets the prompt features; bonus = sample at the last position."""
    tokens, positions = np.asarray(ids, np.int32), np.arange(len(ids), dtype=np.int32)
    cache = target.new_cache(max_len)
    layers = drafter.layer_ids if drafter is not None else ()
    logits, hidden = target.forward(tokens, positions, cache, None, hidden_layers=layers, form=ops.prefill_form)
    cache.commit(positions)
    ctx = None
    if drafter is not None:
        ctx = drafter.new_context(max_len)
        drafter.append(ctx, hidden, positions)
    bonus = sample(ops, logits[-1:], p.temperature, p.seed, index, positions[-1:])[0]
    return Seq(index, cache, ctx, len(ids), int(bonus))


def decode_round(seqs, budgets, target, drafter, ops, p: Params, timer):
    """One round for every sequence: draft -> build -> verify -> walk -> commit. budgets[i] = tree nodes for
    sequence i (the chain length in dflash mode). Returns one RoundOut per sequence."""
    drafter = drafter if p.mode != "ar" else None
    trees = draft_trees(seqs, budgets, drafter, p, timer)
    return verify_trees(seqs, trees, target, drafter, ops, p, timer)


def draft_trees(seqs, budgets, drafter, p: Params, timer):
    """Draft and build: one tree per sequence of at most budgets[i] nodes (the root alone without a drafter)."""
    with timer("draft"):
        drafts = [drafter.draft(s.ctx, s.bonus, s.start) if drafter is not None and b > 0 else None
                  for s, b in zip(seqs, budgets)]
    with timer("build"):
        return [draft_tree(p.mode, s.bonus, d, b) for s, d, b in zip(seqs, drafts, budgets)]


def verify_trees(seqs, trees, target, drafter, ops, p: Params, timer):
    """Verify, walk and commit the given trees (drafter None: nothing to feed, as in ar mode)."""
    layers = drafter.layer_ids if drafter is not None else ()
    with timer("verify"):
        outs = []
        for s, t in zip(seqs, trees):
            tokens, positions, mask = verify_inputs(t, s.start)
            outs.append(target.forward(tokens, positions, s.cache, mask, hidden_layers=layers))
    with timer("walk"):
        walks = [walk(t, sample(ops, logits, p.temperature, p.seed, s.index, s.start + t.depths))
                 for s, t, (logits, _) in zip(seqs, trees, outs)]
    with timer("commit"):
        return [RoundOut(t, path, commit(s, t, path, bonus, hidden, drafter), len(path))
                for s, t, (path, bonus), (_, hidden) in zip(seqs, trees, walks, outs)]
