"""Budget auto's choice replayed offline at batch 1: how much a per-round tree size could gain over a fixed budget.

Decodes held-out prompts with the full ladder tree (64 nodes) on the numpy reference and keeps, per round, each
ladder size's surrogate expectation E(s) (the sum of its first s pops' path probabilities) and what that size's
tree would have accepted (greedy: the accepted path's nodes among the first s pops, since pop order is best-first
and a node's ancestors pop before it). With a cost table (seconds per round and size, e.g. the `cost_table` of a
`tools.bench` auto row), it prints tokens per ms of: every fixed size, the per-round rule on this round's drafts
(`fresh`, the host rounds) and on the round before's (`lagged`, the device's scored rounds), and the best any
per-round choice could do knowing each round's acceptance (`oracle`). Every policy is scored on the rounds of the
fixed-64 trajectory.

    python -m tools.auto_replay --prompts 32 --cost-table table.json [--fixed-round-s 0.000610]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from numbaengine.budget import LADDER, CostTable
from numbaengine.engine import Engine
from numbaengine.weights import SHIPPED_PAIR
from tools.acceptance import DEFAULT_PROMPTS, load_prompts


def record(engine, prompts, new_tokens):
    """Per round: (prompt index, E f64[sizes], accepted i64[sizes]) of the ladder's sizes, from 64-node trees."""
    rows = []
    for i, prompt in enumerate(prompts):
        def on_round(index, out, tokens):
            if out is None:
                return
            probs = np.exp(out.tree.scores[1:])
            acc = np.asarray(out.accepted)[1:]
            rows.append((i, np.array([probs[:s].sum() for s in LADDER]),
                         np.array([int((acc <= s).sum()) for s in LADDER])))
        engine.generate(prompt, new_tokens, "ddtree", max(LADDER), stop=[], on_round=on_round)
    return rows


def rates(rows, seconds):
    """tokens per ms of each policy over the recorded rounds; seconds f64[sizes]."""
    E = np.array([e for _, e, _ in rows])
    A = np.array([a for _, _, a in rows])
    prompt = np.array([p for p, _, _ in rows])
    ms = np.asarray(seconds) * 1e3

    def rate(choice):                                  # choice i64[rounds] of size indices
        return float((1 + A[np.arange(len(A)), choice]).sum() / ms[choice].sum())
    out = {f"fixed {s}": rate(np.full(len(A), k)) for k, s in enumerate(LADDER)}
    out["fresh"] = rate(np.argmax((1 + E) / ms, axis=1))
    before = np.vstack([E[:1], E[:-1]])
    before[np.r_[True, prompt[1:] != prompt[:-1]]] = E.mean(axis=0)    # a prompt's first round: the mean
    out["lagged"] = rate(np.argmax((1 + before) / ms, axis=1))
    out["oracle"] = oracle(A, ms, rate)
    return out


def oracle(A, ms, rate) -> float:
    """The best tokens per ms of any per-round choice knowing every round's acceptance A i64[rounds, sizes]
    (Dinkelbach: choose each round's argmax of tokens - lam x ms, lam the rate so far, until it stops rising)."""
    lam = max(rate(np.full(len(A), k)) for k in range(A.shape[1]))
    while True:
        new = rate(np.argmax(1 + A - lam * ms, axis=1))
        if new <= lam + 1e-12:
            return lam
        lam = new


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.auto_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cost-table", required=True, help="budget.CostTable JSON; its batch-1 row is used")
    ap.add_argument("--fixed-round-s", type=float, help="a fixed budget-16 round's seconds, printed beside "
                    "(a scored round of the table costs more: it builds the largest tree for the scores)")
    args = ap.parse_args(argv)
    table = CostTable.load(args.cost_table)
    if tuple(table.sizes) != LADDER:
        raise SystemExit(f"error: the cost table's sizes {table.sizes} are not the ladder {LADDER}")
    engine = Engine.load(SHIPPED_PAIR / "target", SHIPPED_PAIR / "draft", backend="numpy", max_context=4096)
    rows = record(engine, load_prompts(DEFAULT_PROMPTS, args.prompts), args.new_tokens)
    result = rates(rows, table.row(1))
    if args.fixed_round_s:
        A16 = np.mean([a[LADDER.index(16)] for _, _, a in rows])
        result["fixed 16 at --fixed-round-s"] = float((1 + A16) / (args.fixed_round_s * 1e3))
    print(json.dumps(dict(rounds=len(rows), tokens_per_ms={k: round(v, 3) for k, v in result.items()}), indent=1))


if __name__ == "__main__":
    main()
