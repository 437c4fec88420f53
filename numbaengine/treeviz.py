"""One DDTree round shown three ways: indented text (--show-tree), a JSON record (--show-tree --json) and a picture
(--tree-svg) drawn with matplotlib, no graphviz: depth left to right, siblings top to bottom, each node labelled with
its token text and drafter probability q, the accepted path in colour and the round's bonus token after it."""
from __future__ import annotations

import numpy as np

ACCEPTED, DRAFTED, BONUS = "#2b8a3e", "#868e96", "#e8590c"


def tree_lines(tok, r, out):
    """The round's tree as indented text: token text (repr), drafter marginal q and path probability, accepted
    nodes marked *."""
    t, accepted = out.tree, set(out.accepted.tolist())
    children = {}
    for node in range(1, len(t)):
        children.setdefault(int(t.parents[node]), []).append(node)
    lines = [f"round {r}  tau {out.tau}  nodes {len(t) - 1}"]

    def show(node):
        q = np.exp(t.scores[node] - t.scores[t.parents[node]]) if node else 1.0
        mark = " *" if node in accepted else ""
        label = "root" if node == 0 else f"q={q:.3f} p={np.exp(t.scores[node]):.3f}"
        lines.append(f"{'  ' * (t.depths[node] + 1)}{tok.token_text(t.tokens[node])!r}  {label}{mark}")
        for c in children.get(node, []):
            show(c)

    show(0)
    lines.append(f"  -> bonus {tok.token_text(out.tokens[-1])!r}")
    return lines


def tree_json(r, out):
    """The round's tree as a JSON-ready dict (token ids, parents, depths, log q, accepted node ids)."""
    t = out.tree
    return dict(round=r, tau=out.tau, tokens=t.tokens.tolist(), parents=t.parents.tolist(),
                depths=t.depths.tolist(), log_q=t.scores.tolist(), accepted=out.accepted.tolist(),
                new_tokens=out.tokens)


def require_matplotlib():
    """matplotlib's Figure class, or a one-line ImportError that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("drawing trees needs matplotlib: pip install matplotlib") from None
    return Figure


def layout(parents) -> np.ndarray:
    """y f64[n] per node: leaves 0, 1, 2, ... in depth-first order, a parent at the mean of its children."""
    children = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[int(parents[node])].append(node)
    y, leaves = np.zeros(len(parents)), [0]

    def place(node):
        for c in children[node]:
            place(c)
        if children[node]:
            y[node] = np.mean([y[c] for c in children[node]])
        else:
            y[node], leaves[0] = leaves[0], leaves[0] + 1

    place(0)
    return y


def node_label(tree, node, label_of) -> str:
    """repr of the token text (newlines and spaces visible) and q, the drafter probability of this step."""
    q = np.exp(tree.scores[node] - tree.scores[tree.parents[node]]) if node else 1.0
    text = shown(label_of(int(tree.tokens[node])))
    return f"{text}\nroot" if node == 0 else f"{text}\nq={q:.2f}"


def shown(text) -> str:
    """repr (newlines and spaces visible), with `$` escaped: matplotlib would start mathtext at it."""
    return repr(text).replace("$", r"\$")


def draw_tree(tree, accepted, bonus, label_of, path, title=""):
    """Write `tree` (a ddtree.Tree) to `path`: accepted i32[m] node ids root first, bonus the token the target
    sampled after them, label_of(token id) -> readable text."""
    Figure = require_matplotlib()
    from matplotlib import rc_context
    xy = np.stack([tree.depths.astype(float), layout(tree.parents)], axis=1)
    on_path, last = set(int(a) for a in accepted), int(accepted[-1])
    bonus_xy = xy[last] + (1, 0)
    fig = Figure(figsize=(2.0 + 1.6 * bonus_xy[0], 1.0 + 0.7 * (xy[:, 1].max() + 1)))
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.9 if title else 0.96))
    for node in range(1, len(tree)):
        edge(ax, xy[tree.parents[node]], xy[node], ACCEPTED if node in on_path else DRAFTED, node in on_path)
    edge(ax, xy[last], bonus_xy, BONUS, True, ls="--")
    for node in range(len(tree)):
        accepted_node = node in on_path
        box(ax, xy[node], node_label(tree, node, label_of), ACCEPTED if accepted_node else DRAFTED,
            f"node{node}{'-accepted' if accepted_node else ''}")
    box(ax, bonus_xy, f"{shown(label_of(int(bonus)))}\nbonus", BONUS, "bonus", fill="#fff4e6")
    ax.set_xlim(-0.6, bonus_xy[0] + 0.6)
    ax.set_ylim(xy[:, 1].max() + 0.6, -0.6)
    ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    with rc_context({"svg.fonttype": "none"}):           # SVG text stays text: searchable, selectable
        fig.savefig(path)


def edge(ax, a, b, color, bold, ls="-"):
    ax.plot([a[0], b[0]], [a[1], b[1]], color=color, lw=2.5 if bold else 1, ls=ls, zorder=1)


def box(ax, at, label, color, gid, fill="white"):
    """A boxed label; gid names its SVG group (node3-accepted, node4, bonus)."""
    ax.text(at[0], at[1], label, ha="center", va="center", fontsize=8, family="monospace", zorder=2, gid=gid,
            bbox=dict(boxstyle="round", fc=fill, ec=color, lw=1.5))
