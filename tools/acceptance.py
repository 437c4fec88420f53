"""Acceptance of a target + drafter pair on held-out prompts: tau (tokens committed per round) mean and histogram
per (temperature, mode, budget), through the public Engine API on any backend (CPU: numpy).

Prompts: function signatures plus first body lines from the held-out files of the default pair's corpus
(tools/train/heldout.json). Greedy runs also check that dflash/ddtree reproduce ar's tokens.
  python -m tools.acceptance --prompts 8 --max-new-tokens 128 --json runs/acceptance.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from numbaengine.weights import SHIPPED_PAIR

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "tools" / "train" / "heldout.json"
DEFAULT_BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128)


def load_prompts(path, n: int) -> list[str]:
    """The first n prompt texts of a heldout.json-style file ({"prompts": [{"text": ...}]}) or a JSON list."""
    raw = json.loads(Path(path).read_text())
    items = raw["prompts"] if isinstance(raw, dict) else raw
    texts = [p["text"] if isinstance(p, dict) else p for p in items]
    if not texts:
        raise ValueError(f"{path}: no prompts")
    return texts[:n]


def settings(modes, budgets, temperatures) -> list[tuple[float, str, int]]:
    """(temperature, mode, budget) to run; ar and dflash have no budget (0)."""
    out = []
    for t in temperatures:
        for m in modes:
            out += [(t, m, b) for b in budgets] if m == "ddtree" else [(t, m, 0)]
    return out


def merge_hist(hists) -> list[int]:
    total = np.zeros(max(len(h) for h in hists), np.int64)
    for h in hists:
        total[:len(h)] += h
    return total.tolist()


def measure(engine, prompts, temperature, mode, budget, max_new, seed) -> tuple[dict, list]:
    """Run every prompt once; pooled tau over all rounds, histogram, tokens/s; and the outputs."""
    results = [engine.generate(p, max_new, mode=mode, budget=budget, temperature=temperature, seed=seed, stop=[])
               for p in prompts]
    stats = [r.stats for r in results]
    rounds = sum(s["rounds"] for s in stats)
    hist = merge_hist([s["tau_hist"] for s in stats])
    tau = float(np.dot(np.arange(len(hist)), hist) / rounds) if rounds else 0.0
    row = dict(temperature=temperature, mode=mode, budget=budget, tau_mean=round(tau, 4), rounds=rounds,
               tau_hist=hist, tokens_per_s=round(float(np.mean([s["tokens_per_s"] for s in stats])), 2),
               decode_s=round(sum(s["decode_s"] for s in stats), 2))
    return row, [r.tokens for r in results]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_PAIR / "target"))
    ap.add_argument("--draft", default=str(SHIPPED_PAIR / "draft"))
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--prompts", type=int, default=8, help="how many held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["ar", "dflash", "ddtree"])
    ap.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)
    from numbaengine import Engine
    engine = Engine.load(args.model, args.draft, backend=args.backend)
    prompts = load_prompts(args.prompts_file, args.prompts)
    rows, greedy_ref = [], None
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, backend {args.backend}")
    print(f"{'T':>4} {'mode':7} {'budget':>6} {'tau':>6} {'rounds':>6} {'tok/s':>7}  "
          "histogram (rounds committing 1, 2, ...)")
    for t, mode, budget in settings(args.modes, args.budgets, args.temperatures):
        t0 = time.time()
        row, outputs = measure(engine, prompts, t, mode, budget, args.max_new_tokens, args.seed)
        if t == 0 and mode == "ar":
            greedy_ref = outputs
        if t == 0 and mode != "ar" and greedy_ref is not None:
            row["matches_ar"] = sum(a == b for a, b in zip(outputs, greedy_ref))
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        extra = f"  (= ar on {row['matches_ar']}/{len(prompts)})" if "matches_ar" in row else ""
        print(f"{t:4.1f} {mode:7} {budget or '-':>6} {row['tau_mean']:6.2f} {row['rounds']:6d} "
              f"{row['tokens_per_s']:7.1f}  {row['tau_hist'][1:]}{extra}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), results=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
