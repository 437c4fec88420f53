"""Budget auto's choice replayed offline at batch 1: how much a per-round tree size could gain over a fixed budget.

Decodes held-out prompts with the full ladder tree (64 nodes) on the numpy reference and keeps, per round, each
ladder size's surrogate expectation E(s) (the sum of its first s pops' path probabilities) and what that size's
tree would have accepted (greedy: the accepted path's nodes among the first s pops, since pop order is best-first
and a node's ancestors pop before it). With a cost table (seconds per round and size, e.g. the `cost_table` of a
`tools.bench` auto row), it prints tokens per ms of: every fixed size, the per-round rule on this round's drafts
(`fresh`, the host rounds) and on the round before's (`lagged`, the device's scored rounds), and the best any
per-round choice could do knowing each round's acceptance (`oracle`), and the device rounds' whole rule (`engine`:
probes, sizes chosen from the round before's drafts, both calibrations, coasting; see engine_rule). Every policy is
scored on the rounds of the fixed-64 trajectory.

    python -m tools.auto_replay --prompts 32 --cost-table table.json [--fixed-round-s 0.000610]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from numbaengine.budget import LADDER, Calibration, Choice, Coast, CostTable, pick
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
    out["engine"] = engine_rule(E, A, prompt, ms)
    return out


def engine_rule(E, A, prompt, ms) -> float:
    """Tokens per ms of the device rounds' rule at batch 1 (rounds.DeviceSlots): a round with no size chosen yet
    probes and chooses from its own drafts with the probes' calibration, which then learns every prefix size in
    hindsight (at once here; the device waits until the tokens after the tree are committed). It costs the chosen
    size's round; a probe that chose the root alone is priced as size 2's round (a draft and a one-row verify: the
    table has no such round). After a tree, the next round's size comes from this round's drafts and the lagged
    calibration, which learns the size that ran (a scored round). A size 0, probed or lagged, starts a coast
    (budget.Coast: rounds at size 0's cost without drafts). A prompt starts with a probe; the calibrations and the
    coast's span carry over, as on the device."""
    cal, lagged, coast, nxt, tokens, spent = Calibration(), Calibration(), Coast(), None, 0.0, 0.0
    for t in range(len(E)):
        if t and prompt[t] != prompt[t - 1]:
            coast, nxt = Coast(0, coast.span), None
        if coast.left:
            k, cost, probed = 0, ms[0], False
        elif nxt is not None:
            (k, before), nxt = nxt, None
            cost, probed = ms[k], True
            if k:
                lagged = lagged.observe(before[k], A[t, k])
        else:
            k = pick(cal.apply_all(E[t])[:, None], ms)
            cost, probed = ms[k] if k else ms[1], True
            cal = cal.observe_many(E[t, 1:], A[t, 1:])
        tokens, spent = tokens + 1 + A[t, k], spent + cost
        coast = coast.after(Choice(LADDER[k], (LADDER[k],), (0.0,), (0.0,), 0.0, probed=probed))
        if probed and k and not coast.left:
            nxt = pick(lagged.apply_all(E[t])[:, None], ms), E[t]
    return float(tokens / spent)


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
