"""Command line: `python -m numbaengine.run --prompt TEXT` generates a continuation and prints acceptance stats.

Without --model it uses the shipped pair in numbaengine/weights/default/. Bad input ends with one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from numbaengine.backends import BACKENDS
from numbaengine.ddtree import MAX_BUDGET, MODES
from numbaengine.engine import Engine
from numbaengine.weights import SHIPPED_PAIR

DEFAULT_PAIR = SHIPPED_PAIR


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def budget_arg(text):
    b = int(text)
    if not 0 <= b <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"{b} is out of range 0..{MAX_BUDGET}")
    return b


def devices_arg(text):
    try:
        return [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU ids") from None


def parse_args(argv):
    ap = Parser(prog="python -m numbaengine.run", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", required=True, help="text, or token ids ('1 2 3') for a model without tokenizer")
    ap.add_argument("--model", help="target checkpoint folder (default: the shipped numbaengine/weights/default/target)")
    ap.add_argument("--draft", help="DFlash drafter folder (default: the one beside the default target)")
    ap.add_argument("--mode", choices=MODES, default="ddtree")
    ap.add_argument("--budget", type=budget_arg, default=16, help=f"drafted tree nodes, 0..{MAX_BUDGET}")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", help="comma-separated stop token ids ('' for none; default: the model's eos)")
    ap.add_argument("--max-context", type=int, default=4096, help="cache rows per sequence")
    ap.add_argument("--backend", choices=BACKENDS, default="auto")
    ap.add_argument("--devices", type=devices_arg, help="comma-separated GPU ids to shard the model over, one rank "
                                                        "per GPU over NCCL (cuda; default: the current GPU alone)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (with the trees under --show-tree)")
    ap.add_argument("--show-tree", action="store_true", help="print every round's tree, accepted path marked *")
    return ap.parse_args(argv)


def pick_models(model, draft):
    """(target dir, draft dir or None, how they were chosen)."""
    if model:
        return Path(model), Path(draft) if draft else None, "--model"
    if not (DEFAULT_PAIR / "target" / "config.json").exists():
        raise UsageError(f"no --model given and no shipped pair at {DEFAULT_PAIR} (reinstall, or pass --model DIR)")
    d = DEFAULT_PAIR / "draft"
    return DEFAULT_PAIR / "target", Path(draft) if draft else (d if d.exists() else None), "shipped default"


def stop_ids(text):
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--stop: {text!r} is not a comma-separated list of token ids") from None


def tree_lines(tok, r, out):
    """The round's tree as indented text: token, drafter marginal q and path probability; accepted nodes *."""
    t, accepted = out.tree, set(out.accepted.tolist())
    children = {}
    for node in range(1, len(t)):
        children.setdefault(int(t.parents[node]), []).append(node)
    lines = [f"round {r}  tau {out.tau}  nodes {len(t) - 1}"]

    def show(node):
        q = np.exp(t.scores[node] - t.scores[t.parents[node]]) if node else 1.0
        mark = " *" if node in accepted else ""
        label = "root" if node == 0 else f"q={q:.3f} p={np.exp(t.scores[node]):.3f}"
        lines.append(f"{'  ' * (t.depths[node] + 1)}{tok.token_str(t.tokens[node])!r}  {label}{mark}")
        for c in children.get(node, []):
            show(c)

    show(0)
    lines.append(f"  -> bonus {tok.token_str(out.tokens[-1])!r}")
    return lines


def tree_json(r, out):
    t = out.tree
    return dict(round=r, tau=out.tau, tokens=t.tokens.tolist(), parents=t.parents.tolist(),
                depths=t.depths.tolist(), log_q=t.scores.tolist(), accepted=out.accepted.tolist(),
                new_tokens=out.tokens)


class Watcher:
    """on_round callback: keeps the tokens so far (for Ctrl-C), the trees, and a progress line on a terminal."""

    def __init__(self, args, tok):
        self.args, self.tok, self.tokens, self.trees, self.rounds = args, tok, [], [], 0
        self.t0 = self.last = time.perf_counter()

    def __call__(self, index, out, tokens):
        self.tokens = tokens
        if out is None:
            return
        self.rounds += 1
        if self.args.show_tree:
            if self.args.json:
                self.trees.append(tree_json(self.rounds, out))
            else:
                print("\n".join(tree_lines(self.tok, self.rounds, out)), flush=True)
        now = time.perf_counter()
        if sys.stderr.isatty() and now - self.t0 > 2 and now - self.last > 0.5:
            self.last = now
            print(f"\r{len(tokens)}/{self.args.max_new_tokens} tokens, {self.rounds} rounds, "
                  f"{len(tokens) / (now - self.t0):.1f} tokens/s", end="", file=sys.stderr, flush=True)


def summary(stats):
    hist = " ".join(f"{t}:{n}" for t, n in enumerate(stats["tau_hist"]) if n)
    phases = " ".join(f"{k} {v:.3f}s" for k, v in stats["phase_s"].items())
    return (f"{stats['mode']} (budget {stats['budget']}): {stats['new_tokens']} tokens in {stats['rounds']} rounds, "
            f"tau {stats['tau_mean']:.2f} [{hist}], {stats['tokens_per_s']:.1f} tokens/s, "
            f"prefill {stats['prefill_s']:.3f}s, {phases}, stop: {stats['stop_reason']}")


def main(argv=None):
    watch = None
    try:
        args = parse_args(argv)
        model, draft, how = pick_models(args.model, args.draft)
        print(f"model: {model}  draft: {draft}  ({how})", file=sys.stderr)
        if args.mode != "ar" and draft is None:
            raise UsageError(f"--mode {args.mode} needs a drafter: pass --draft DIR, or use --mode ar")
        if args.show_tree and args.backend in ("cuda", "sim"):
            raise UsageError("--show-tree reads the trees on the host: use --backend numpy (the kernel backends "
                             "keep them on the device)")
        if args.show_tree:
            args.backend = "numpy"
        engine = Engine.load(model, draft if args.mode != "ar" else None, backend=args.backend,
                             max_context=args.max_context, devices=args.devices)
        watch = Watcher(args, engine.tokenizer)
        result = engine.generate(args.prompt, args.max_new_tokens, args.mode, args.budget, args.temperature,
                                 args.seed, stop_ids(args.stop), on_round=watch)
    except KeyboardInterrupt:
        tokens = watch.tokens if watch else []
        print(f"\ninterrupted after {len(tokens)} tokens", file=sys.stderr)
        if watch:
            print(watch.tok.decode(tokens))
        return 130
    except (UsageError, ValueError, OSError, ImportError, NotImplementedError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if sys.stderr.isatty() and watch.rounds:
        print(file=sys.stderr)
    if args.json:
        out = dict(model=str(model), draft=str(draft) if draft else None, prompt=args.prompt, tokens=result.tokens,
                   text=result.text, stats=result.stats)
        if args.show_tree:
            out["rounds"] = watch.trees
        print(json.dumps(out))
    else:
        print(result.text)
        print(summary(result.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
