"""One DDTree round of the shipped pair, shown with the numbers the code produces: prints docs/DDTREE.md.

  python tools/ddtree_walkthrough.py > docs/DDTREE.md

The round is the engine's own: numbaengine.ddtree.prefill, then numbaengine.ddtree.decode_round on the numpy
backend at temperature 0, with the drafter's and the target's outputs recorded on the way. The tables are derived
from those outputs with the functions the round calls (top_logprobs, sample, walk), and checked
against what the round returned. Numbers are printed with 3 decimals, so the page is the same on every BLAS build
unless a near-tie flips an argmax. tests/test_ddtree_doc.py fails when docs/DDTREE.md differs from this output.
Other prompts and budgets: --prompt TEXT --budget B (the committed page uses the defaults).
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from numbaengine import ddtree
from numbaengine.engine import Engine
from numbaengine.generate import Timer

PROMPT = "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2,"
BUDGET = 8
COMMAND = "python tools/ddtree_walkthrough.py > docs/DDTREE.md"


# --- running the round ------------------------------------------------------------------------------------------------

class Recorder:
    """Stands in for `obj`, keeping what its method `name` returns in `calls` (everything else passes through)."""

    def __init__(self, obj, name):
        self._obj, self._name, self.calls = obj, name, []

    def __getattr__(self, attr):
        value = getattr(self._obj, attr)
        if attr != self._name:
            return value

        def recorded(*args, **kwargs):
            out = value(*args, **kwargs)
            self.calls.append(out)
            return out
        return recorded


@dataclass
class Round:
    """Everything the page shows about one round of one sequence."""
    prompt_ids: list
    start: int               # position of the bonus token = prompt length
    bonus: int               # the root of the tree, sampled by the prefill
    ids: np.ndarray          # i32[L, K] top-K ids per depth of the drafter's logits (as draft_tree computes them)
    lp: np.ndarray           # f32[L, K] their log-probabilities
    tree: ddtree.Tree        # the round's tree, n+1 nodes
    target_logits: np.ndarray  # f32[n+1, V] target output at every tree node
    post: np.ndarray         # i32[n+1] the target's choice at every node
    out: ddtree.RoundOut


def run_round(engine, prompt, budget) -> Round:
    """Prefill the prompt, then one greedy DDTree round (ddtree.decode_round) with the drafter and target recorded."""
    target, ops, p = engine.target, engine.target.ops, ddtree.Params("ddtree", 0.0, 0)
    ids = engine.tokenizer.encode(prompt)
    seq = ddtree.prefill(0, ids, target, engine.drafter, ops, p, len(ids) + 2 * budget + 2)
    start, bonus = seq.start, seq.bonus
    drafter, verifier = Recorder(engine.drafter, "draft"), Recorder(target, "forward")
    out = ddtree.decode_round([seq], [budget], verifier, drafter, ops, p, Timer())[0]
    draft_logits = np.array(ops.to_host(drafter.calls[0]))
    target_logits = np.array(ops.to_host(verifier.calls[0][0]))
    top_ids, lp = ddtree.top_logprobs(draft_logits, min(budget, draft_logits.shape[1]))    # as draft_tree calls it
    post = ddtree.sample(ops, target_logits, p.temperature, p.seed, 0, start + out.tree.depths)
    path, new_bonus = ddtree.walk(out.tree, post)
    assert np.array_equal(path, out.accepted) and out.tokens[-1] == new_bonus, "the walk differs from the round's"
    return Round(ids, start, bonus, top_ids, lp, out.tree, target_logits, np.asarray(post), out)


# --- what the heap did ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """A heap entry: the node it would become (parent, depth, rank of its token at that depth) and its score."""
    parent: int
    depth: int
    rank: int
    score: float             # log q(path), the same float64 sum as build_tree's
    ranks: tuple             # candidate ranks along the path: the tie-break


def node_ranks(r: Round) -> list:
    """Rank of every node's token among its depth's top-K (root: -1)."""
    return [-1] + [int(np.flatnonzero(r.ids[d - 1] == t)[0]) for t, d in zip(r.tree.tokens[1:], r.tree.depths[1:])]


def rank_paths(r: Round, ranks) -> list:
    """The rank tuple of every node's path (root: the empty tuple)."""
    paths = [()]
    for n in range(1, len(r.tree)):
        paths.append(paths[r.tree.parents[n]] + (ranks[n],))
    return paths


def candidate(r: Round, paths, parent, depth, rank) -> Candidate:
    score = float(r.tree.scores[parent]) + float(r.lp[depth - 1, rank])
    return Candidate(parent, depth, rank, score, paths[parent] + (rank,))


def heap_steps(r: Round) -> list:
    """For each node n = 1..B: (the heap just before n was popped, best first; the entries its pop pushed). After
    nodes 1..n-1 the heap holds, for each of them, its next sibling and its first child, the ones not popped yet
    (and the root's first child until it is popped). The best entry must be node n, as build_tree made it."""
    t, (L, K) = r.tree, r.ids.shape
    ranks = node_ranks(r)
    paths = rank_paths(r, ranks)
    heap = {(0, 1, 0)}       # keys (parent, depth, rank); build_tree pushes each key once
    steps = []
    for n in range(1, len(t)):
        entries = sorted((candidate(r, paths, *key) for key in heap), key=lambda c: (-c.score, c.ranks))
        best = entries[0]
        assert (best.parent, best.depth, best.rank) == (t.parents[n], t.depths[n], ranks[n]), f"node {n}"
        heap.discard((best.parent, best.depth, best.rank))
        pushes = [(best.parent, best.depth, best.rank + 1)] if best.rank + 1 < K else []
        pushes += [(n, best.depth + 1, 0)] if best.depth < L else []
        heap.update(pushes)
        steps.append((entries, [candidate(r, paths, *key) for key in pushes]))
    return steps


# --- text helpers -----------------------------------------------------------------------------------------------------

def show(tokenizer, token) -> str:
    """A token as readable text: the decoded single id, repr'd so spaces and newlines show."""
    return repr(tokenizer.decode([int(token)]))


def code(text) -> str:
    """An inline code span that survives a Markdown table cell."""
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def num(x) -> str:
    return f"{x:.3f}"


def softmax_of(logits, index) -> float:
    z = logits.astype(np.float64) - logits.max()
    return float(np.exp(z[index]) / np.exp(z).sum())


# --- the page ---------------------------------------------------------------------------------------------------------

def intro(engine, r: Round, prompt, budget) -> list:
    tok, Lb = engine.tokenizer, engine.drafter.block_size
    return [
        "# One DDTree round, step by step",
        "",
        (f"This page follows one decoding round of the shipped toy pair (a {engine.cfg.num_hidden_layers}-layer "
         f"DeepSeek-V3-style target and its {engine.drafter.cfg.num_hidden_layers}-layer DFlash drafter) with the "
         "numbers the code produced. It is generated by `tools/ddtree_walkthrough.py` (numpy backend, greedy: "
         "temperature 0), so every value below comes from the engine itself; the background is in the DDTree and "
         "DFlash papers and in the module docstring of `numbaengine/ddtree.py`."),
        "",
        "## 1. What a round is",
        "",
        ("The *bonus* token is the last token the target chose; it is already part of the output but not yet in "
         "the target's cache. A round turns it into several committed tokens:"),
        "",
        (f"1. **Draft.** The drafter reads a *block* of Lb = {Lb} tokens, the bonus followed by {Lb - 1} mask "
         f"tokens, and returns a distribution q_d over the vocabulary for each of the next L = {Lb - 1} positions "
         "(depths d = 1..L) in a single forward pass. Each q_d is a marginal: it does not depend on which token "
         "ends up chosen at the other depths."),
        ("2. **Tree.** Under the drafter, a continuation t_1..t_k has *path probability* q(path) = q_1(t_1) × ... × "
         "q_k(t_k). The tree is the *budget* B most probable such prefixes, found with a best-first heap. Every "
         "prefix of a chosen path is itself chosen, so the set is a tree rooted at the bonus."),
        ("3. **Verify.** The target runs once over the B + 1 tree tokens (root included). A token sits at position "
         "start + depth and sees the committed cache plus its own ancestors, nothing else (the ancestor mask)."),
        ("4. **Walk.** The target's choice at each node (its argmax here) is what it would write next after that "
         "node's path. Starting at the root, the walk moves to the child holding that choice, as long as there is "
         "one."),
        ("5. **Commit.** The nodes on the walked path (root included) enter the target cache and the drafter "
         "context; the target's choice at the last of them becomes the next bonus. *tau*, the acceptance length "
         "of the round, is the number of tokens committed: 1 + the drafts accepted."),
        "",
        ("At temperature 0 this produces exactly the tokens greedy decoding of the target would: each committed "
         "token is the target's own choice given everything before it. The drafter only decides how many of them "
         "one target pass can confirm."),
        "",
        f"The round below: prompt {code(repr(prompt))}, budget B = {budget}.",
        "",
        "```",
        f"prompt ids      {r.prompt_ids}",
        f"start           {r.start}    (prompt length: the bonus token's position)",
        f"bonus           {r.bonus} {show(tok, r.bonus)}    (the prefill's argmax at the last prompt position)",
        (f"drafter block   [{r.bonus}] + [{engine.drafter.mask_id}] x {Lb - 1}    "
         f"(bonus, then the mask id) at positions {r.start}..{r.start + Lb - 1}"),
        "```",
        "",
    ]


def marginals(engine, r: Round) -> list:
    tok, t = engine.tokenizer, r.tree
    L, K = r.ids.shape
    shown = min(L, int(t.depths.max()) + 1)
    used = {(int(d), rank) for d, rank in zip(t.depths[1:], node_ranks(r)[1:])}
    head = "| depth | " + " | ".join(f"rank {k}" for k in range(K)) + " |"
    lines = [
        "## 2. The drafter's candidates per depth",
        "",
        (f"The drafter's logits, one row per depth, go through `top_logprobs`: the K = min(B, V) = {K} most likely "
         "tokens per depth with their log-probabilities at temperature 1. The table shows q = exp(log-probability). "
         "Cells in bold are the ones the tree below uses."),
        (f"The drafter scores all L = {L} depths; the table stops at depth {shown}, one past the deepest node of "
         "this tree."),
        "",
        head,
        "|" + "---|" * (K + 1),
    ]
    for d in range(1, shown + 1):
        cells = []
        for k in range(K):
            cell = f"{code(show(tok, r.ids[d - 1, k]))} {num(np.exp(r.lp[d - 1, k]))}"
            cells.append(f"**{cell}**" if (d, k) in used else cell)
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines + [""]


def describe(engine, r: Round, c: Candidate) -> str:
    """A heap entry as text: its token, where it hangs and its path probability."""
    token = show(engine.tokenizer, r.ids[c.depth - 1, c.rank])
    return f"{token} under node {c.parent} (depth {c.depth}, rank {c.rank}) q {num(np.exp(c.score))}"


def heap_trace(engine, r: Round) -> list:
    tok, t = engine.tokenizer, r.tree
    lines = [
        "## 3. The best-first heap",
        "",
        ("`build_tree` starts with one heap entry, the rank-0 token at depth 1 under the root. Each pop takes the "
         "entry with the highest path probability, makes it the next node, and pushes two new entries: its next "
         "sibling (same parent and depth, the next rank) and its first child (one depth further, rank 0). An entry "
         "is never less probable than the ones it pushes, so the pops come out in decreasing path probability and "
         "a parent is always popped before its children. Equal scores would pop in the order of their rank tuples."),
        (f"It stops after B = {len(t) - 1} pops. Below, for each pop: the entry popped (the best in the heap), "
         "the other entries still waiting, best first, and the two entries the pop pushed (where the next sibling "
         "hangs under the same parent and the first child under the new node)."),
        "",
        "```",
    ]
    for n, (entries, pushes) in enumerate(heap_steps(r), start=1):
        best = entries[0]
        q_d = num(np.exp(r.lp[best.depth - 1, best.rank]))
        lines.append(f"pop {n}: node {n} = {describe(engine, r, best)}")
        lines.append(f"       q = q(node {best.parent}) {num(np.exp(t.scores[best.parent]))} × q_{best.depth} "
                     f"{q_d}")
        lines += [f"       waiting: {describe(engine, r, c)}" for c in entries[1:]]
        lines += [f"       pushes:  {describe(engine, r, c)}" for c in pushes]
    lines += ["```", "", "The nodes in pop order:", "",
              "| node | parent | depth | token | q_d(token) | path probability |", "|---|---|---|---|---|---|",
              f"| 0 | - | 0 | {code(show(tok, t.tokens[0]))} (bonus) | - | 1.000 |"]
    ranks = node_ranks(r)
    for n in range(1, len(t)):
        lines.append(f"| {n} | {t.parents[n]} | {t.depths[n]} | {code(show(tok, t.tokens[n]))} | "
                     f"{num(np.exp(r.lp[t.depths[n] - 1, ranks[n]]))} | {num(np.exp(t.scores[n]))} |")
    expected, chain = float(np.exp(t.scores[1:]).sum()), chain_expectation(r, len(t) - 1)
    summary = (f"Under the drafter's own (independent-depth) model, the expected number of accepted drafts is the "
               f"sum of the path probabilities: {num(expected)}. A single chain of rank-0 tokens of the same length "
               f"would score {num(chain)}.")
    return [*lines, "", summary, ""]


def chain_expectation(r: Round, length) -> float:
    """Sum of path probabilities of the rank-0 chain of `length` nodes (what DFlash verifies, cut to the budget)."""
    return float(np.exp(np.cumsum(r.lp[:length, 0].astype(np.float64))).sum())


def tree_drawing(engine, r: Round) -> list:
    tok, t = engine.tokenizer, r.tree
    children = [[c for c in range(1, len(t)) if t.parents[c] == n] for n in range(len(t))]

    def draw(n, prefix, last):
        branch = "" if n == 0 else ("└── " if last else "├── ")
        label = f"[{n}] {show(tok, t.tokens[n])}"
        label += "  (root: the bonus)" if n == 0 else f"  q {num(np.exp(t.scores[n]))}"
        out = [f"{prefix}{branch}{label}  position {r.start + t.depths[n]}"]
        inner = prefix + ("" if n == 0 else ("    " if last else "│   "))
        for i, c in enumerate(children[n]):
            out += draw(c, inner, i == len(children[n]) - 1)
        return out

    n = len(t)
    mask = ["      " + " ".join(f"{j:>2}" for j in range(n))]
    mask += [f"  {i:>2}  " + " ".join(f"{int(v):>2}" for v in row) for i, row in enumerate(t.vis)]
    return [
        "## 4. The tree and its mask",
        "",
        ("Each line: [node] token, path probability, and the position the target sees it at (start + depth). "
         "Siblings share a position: they are alternatives for the same slot."),
        "",
        "```",
        *draw(0, "", True),
        "```",
        "",
        ("The ancestor mask `vis` (row i, column j: node i may attend to node j, its ancestors and itself). "
         "Together with the committed cache, which every node sees, it is the attention mask of the verify pass."),
        "",
        "```",
        *mask,
        "```",
        "",
    ]


def verify_and_walk(engine, r: Round) -> list:
    tok, t, path = engine.tokenizer, r.tree, r.out.accepted
    child = {(int(t.parents[c]), int(t.tokens[c])): c for c in range(1, len(t))}
    lines = [
        "## 5. Verify, walk, commit",
        "",
        ("The target's choice at every node (the argmax of its logits there, with its probability), and whether "
         "some child of the node holds that token:"),
        "",
        "| node | token | target's choice | p | child with it |",
        "|---|---|---|---|---|",
    ]
    for n in range(len(t)):
        c = child.get((n, int(r.post[n])))
        lines.append(f"| {n} | {code(show(tok, t.tokens[n]))} | {code(show(tok, r.post[n]))} | "
                     f"{num(softmax_of(r.target_logits[n], r.post[n]))} | {'-' if c is None else c} |")
    lines += ["", "The walk (`walk`) starts at the root and moves while the target's choice is a child:", "", "```"]
    for a, b in itertools.pairwise(path):
        lines.append(f"node {a}: target chooses {show(tok, r.post[a])} -> child node {b} holds it, move there")
    last = int(path[-1])
    lines.append(f"node {last}: target chooses {show(tok, r.post[last])} -> no child holds it, stop")
    lines += ["```", ""]
    return lines + commit_lines(engine, r) + chain_lines(engine, r)


def commit_lines(engine, r: Round) -> list:
    tok, t, path, out = engine.tokenizer, r.tree, r.out.accepted, r.out
    m = len(path)
    slots = ", ".join(f"{r.start + int(n)} -> {r.start + i}" for i, n in enumerate(path))
    return [
        (f"Accepted path: nodes {path.tolist()}, so tau = {out.tau} (the bonus plus {m - 1} accepted "
         f"draft{'s' if m != 2 else ''})."),
        "",
        "```",
        f"committed to the cache  {t.tokens[path].tolist()} at positions {r.start}..{r.start + m - 1}",
        f"cache rows moved        {slots}   (tree row start+node -> slot in path order)",
        f"drafter context         gets the target features of rows {path.tolist()} at those positions",
        (f"new bonus               {out.tokens[-1]} {show(tok, out.tokens[-1])}   (the target's choice at node "
         f"{int(path[-1])}; position {r.start + m}, cached next round)"),
        f"output of the round     {out.tokens} = {tok.decode(out.tokens)!r}",
        "```",
        "",
        ("The old bonus was output when it was chosen (by the prefill, here); the round outputs the accepted "
         "drafts and the new bonus. The text so far:"),
        "",
        "```",
        tok.decode(r.prompt_ids + [r.bonus] + out.tokens),
        "```",
        "",
    ]


def chain_lines(engine, r: Round) -> list:
    """How far the rank-0 chain (DFlash's draft) gets inside this tree, against the walk."""
    t, path = r.tree, r.out.accepted
    ranks = node_ranks(r)
    node, accepted = 0, 0
    while True:
        nxt = [c for c in range(1, len(t)) if t.parents[c] == node and ranks[c] == 0]
        if not nxt or int(t.tokens[nxt[0]]) != int(r.post[node]):
            break
        node, accepted = nxt[0], accepted + 1
    cut = not nxt                    # the chain runs past the tree: more could match beyond it
    bound = f"at least {accepted}" if cut else f"{accepted}"
    return [
        (f"For comparison, the drafter's rank-0 chain (DFlash's single draft) matches the target for {bound} "
         f"draft{'s' if accepted != 1 else ''} here; the tree's walk accepted {len(path) - 1}. A tree pays off when "
         "the target picks a token the drafter ranked below first."),
        "",
    ]


def pointers() -> list:
    return [
        "## 6. Where this is in the code",
        "",
        "`numbaengine/ddtree.py`, read top to bottom, is the round:",
        "",
        "- `top_logprobs`: the per-depth top-K ids and log-probabilities (section 2);",
        ("- `build_tree` (through `draft_tree`): the best-first heap and the `Tree` (tokens, parents, depths, scores), "
         "with `visibility` for the ancestor mask (sections 3 and 4);"),
        "- `verify_inputs`: tree tokens, positions start + depth and the mask for the target forward;",
        "- `sample` and `walk`: the target's choice per node and the matching-children walk (section 5);",
        "- `commit`: cache rows and drafter context of the accepted path, and the new bonus;",
        "- `decode_round`: the five phases in order, for a batch of sequences, after one `prefill` of the prompt.",
        "",
        ("`numbaengine/generate.py` (`decode`) runs prefills and rounds until the output is complete, through "
         "`numbaengine/rounds.py`: this round on the host, or the same round batched on the device "
         "(`numbaengine/device_round.py`) on the kernel backends."),
        "",
        (f"Regenerate this page from the repository root with `{COMMAND}`; `tests/test_ddtree_doc.py` fails when "
         "it is out of date."),
    ]


def render(prompt=PROMPT, budget=BUDGET) -> str:
    """The page for one round of `prompt` with `budget` drafted nodes."""
    with threadpool_limits(1, "blas"):           # one BLAS thread: the same sums on every run
        engine = Engine.load(backend="numpy")
        r = run_round(engine, prompt, budget)
    sections = [intro(engine, r, prompt, budget), marginals(engine, r), heap_trace(engine, r),
                tree_drawing(engine, r), verify_and_walk(engine, r), pointers()]
    return "\n".join(line for s in sections for line in s) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=PROMPT, help="prompt text (default: the page's)")
    ap.add_argument("--budget", type=int, default=BUDGET, help="drafted tree nodes (default: %(default)s)")
    args = ap.parse_args(argv)
    if not 1 <= args.budget <= ddtree.MAX_BUDGET:
        ap.error(f"--budget: must be in 1..{ddtree.MAX_BUDGET}")
    print(render(args.prompt, args.budget), end="")


if __name__ == "__main__":
    main()
