"""Command line: `python -m numbaengine.run --prompt TEXT` writes the continuation to stdout (streamed on a
terminal, so `> out.py` captures just the text) and the model line, progress and acceptance stats to stderr.

Without --model it uses the shipped pair in numbaengine/weights/default/. Bad input ends with one line on stderr and
exit code 2; Ctrl-C prints what was generated and exits with 130.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from time import perf_counter

import numpy as np

from numbaengine.backends import BACKENDS, gpu_ready
from numbaengine.budget import AUTO, CostTable
from numbaengine.ddtree import MAX_BUDGET, MODES
from numbaengine.engine import Engine
from numbaengine.kernels import cache as kernel_cache
from numbaengine.phases import delta, totals
from numbaengine.treeviz import draw_tree, require_matplotlib, tree_json, tree_lines
from numbaengine.weights import SHIPPED_PAIR

DEFAULT_PAIR = SHIPPED_PAIR

DESCRIPTION = """\
Generate a continuation of --prompt with speculative decoding (DFlash drafts
verified as a DDTree).

Without --model this runs the shipped pair: a small toy model trained on
Python source that writes plausible-looking Python, not a useful model. It is
there to exercise the engine; pass --model for a real checkpoint.

stdout carries only the generated text (streamed when it is a terminal); the
model line, progress, --show-tree and the stats line go to stderr."""

EPILOG = """\
examples:
  python -m numbaengine.run --prompt "def fibonacci(n):" > out.py
  python -m numbaengine.run --prompt "import os" --temperature 0.7 --seed 1 --json
  python -m numbaengine.run --prompt "def add(a, b):" --show-tree --tree-svg trees/ --max-new-tokens 16"""


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def budget_arg(text):
    if text == AUTO:
        return AUTO
    try:
        b = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'auto'") from None
    if not 0 <= b <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"{b} is out of range 0..{MAX_BUDGET}")
    return b


def devices_arg(text):
    try:
        return [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU ids") from None


def parse_args(argv):
    return parser().parse_args(argv)


def parser():
    ap = Parser(prog="python -m numbaengine.run", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", required=True, help="text, or token ids ('1 2 3') for a model without tokenizer")
    ap.add_argument("--model", help="target checkpoint folder (default: the shipped toy target, "
                                    "numbaengine/weights/default/target)")
    ap.add_argument("--draft", help="DFlash drafter folder (default: the shipped drafter when --model is not given, "
                                    "else none)")
    ap.add_argument("--mode", choices=MODES, default="ddtree", help="ddtree: a drafted tree of --budget nodes; "
                    "dflash: the drafter's chain of one block; ar: the target alone (default: %(default)s)")
    ap.add_argument("--budget", type=budget_arg, default=16,
                    help=f"drafted tree nodes per round, 0..{MAX_BUDGET}, ddtree only; auto: chosen each round from "
                    "the drafter's probabilities and the cost table (default: %(default)s)")
    ap.add_argument("--cost-table", metavar="FILE", help="with --budget auto: seconds of a round per batch and tree "
                    "size, JSON (numbaengine/budget.py CostTable) (default: measured, on numpy the reference round "
                    "on this CPU, on cuda the rounds' graphs)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling noise seed (default: %(default)s)")
    ap.add_argument("--stop", help="comma-separated stop token ids, '' for none (default: the model's eos)")
    ap.add_argument("--max-context", type=int, default=4096, help="cache rows per sequence (default: %(default)s)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="numpy: CPU; sim: the CUDA simulator; "
                    "auto: cuda when a GPU is ready, else numpy (default: %(default)s)")
    ap.add_argument("--devices", type=devices_arg, help="comma-separated GPU ids to shard the model over, one rank "
                    "per GPU over NCCL; cuda only (default: the current GPU alone)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the text "
                    "(with the trees under --show-tree)")
    ap.add_argument("--show-tree", action="store_true", help="print every round's tree on stderr, token text and "
                    "drafter probability q, accepted path marked * (runs on numpy)")
    ap.add_argument("--tree-svg", metavar="DIR", help="draw every round's tree to DIR/round_0001.svg, ...: nodes by "
                    "depth, token text and q, the accepted path and bonus token in colour (needs matplotlib; "
                    "runs on numpy; default: no pictures)")
    ap.add_argument("--kernel-cache", metavar="DIR", help="where compiled kernels are kept (default: "
                    "NUMBAENGINE_CACHE_DIR, else ~/.cache/numbaengine/kernels)")
    ap.add_argument("--no-kernel-cache", action="store_true", help="compile every kernel in this process and keep "
                    "nothing (default: use the cache)")
    return ap


def pick_models(model, draft):
    """(target dir, draft dir or None, how they were chosen)."""
    if model and not Path(model).is_dir():
        raise UsageError(f"model directory not found: {model}")
    if draft and not Path(draft).is_dir():
        raise UsageError(f"draft directory not found: {draft}")
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


class Stream:
    """The generated text on `out`: written as rounds commit (live) or once at the end. Live, only the decoded text
    that later tokens cannot change is written: a trailing U+FFFD (a character cut between tokens) waits."""

    def __init__(self, tok, out, live):
        self.tok, self.out, self.live, self.shown = tok, out, live, ""

    def update(self, tokens):
        if self.live:
            self.write(self.tok.decode(tokens).rstrip("\ufffd"))

    def finish(self, text):
        if not text.startswith(self.shown):          # a decoder that rewrote its prefix: the whole text again
            self.out.write("\n")
            self.shown = ""
        self.write(text)
        self.out.write("\n")
        self.out.flush()

    def write(self, text):
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


class Watcher:
    """on_round callback: keeps the tokens and taus so far (for Ctrl-C), feeds the text stream, shows the trees
    (--show-tree, --tree-svg) and a progress line on a terminal."""

    def __init__(self, args, tok, stream):
        self.args, self.tok, self.stream, self.tokens, self.taus, self.trees = args, tok, stream, [], [], []
        self.t0 = self.last = time.perf_counter()
        self.progressed = False      # a progress line is on stderr, not yet ended

    def __call__(self, index, out, tokens):
        self.tokens = tokens
        self.stream.update(tokens)
        if out is None:
            return
        self.taus.append(out.tau)
        self.show(len(self.taus), out)
        self.progress()

    def show(self, r, out):
        if self.args.show_tree and self.args.json:
            self.trees.append(tree_json(r, out))
        elif self.args.show_tree:
            print("\n".join(tree_lines(self.tok, r, out)), file=sys.stderr, flush=True)
        if self.args.tree_svg:
            draw_tree(out.tree, out.accepted, out.tokens[-1], self.tok.token_text,
                      Path(self.args.tree_svg) / f"round_{r:04d}.svg", f"round {r}  tau {out.tau}")

    def progress(self):
        now = time.perf_counter()
        if self.shows_progress() and now - self.t0 > 2 and now - self.last > 0.5:
            self.last, self.progressed = now, True
            print(f"\r{len(self.tokens)}/{self.args.max_new_tokens} tokens, {len(self.taus)} rounds, "
                  f"{len(self.tokens) / (now - self.t0):.1f} tokens/s", end="", file=sys.stderr, flush=True)

    def shows_progress(self):
        """A progress line on a terminal's stderr, unless the text itself streams there."""
        return sys.stderr.isatty() and not self.stream.live and not self.args.show_tree

    def end_progress(self):
        if self.progressed:
            print(file=sys.stderr)
            self.progressed = False

    def stats(self):
        """What is known mid-run (after Ctrl-C): tokens, rounds and the acceptance so far."""
        hist = [0] * (max(self.taus, default=0) + 1)
        for t in self.taus:
            hist[t] += 1
        return dict(mode=self.args.mode, new_tokens=len(self.tokens), rounds=len(self.taus),
                    tau_mean=float(np.mean(self.taus)) if self.taus else 0.0, tau_hist=hist,
                    elapsed_s=time.perf_counter() - self.t0)


def prepare(engine, args, table):
    """cuda: compile the kernels this run needs and the cache lacks in parallel worker processes, from a dry run of
    the same request (nothing launched, at most 3 rounds), instead of one by one as the real run meets them; then
    run the request cut short twice (warmup.warm_request: first launches and graph captures) so that the real run's
    prefill and decode are steady, as in a warm server or benchmark."""
    if engine.backend != "cuda":
        return
    from numbaengine.warmup import RoundLimit, warm_request
    from numbaengine.warmup import precompile as compile_in_pool

    def dry_run():
        engine.generate(args.prompt, args.max_new_tokens, args.mode, args.budget, args.temperature, args.seed, (),
                        on_round=RoundLimit(3))
    if kernel_cache.enabled():
        compile_in_pool(dry_run, progress=sys.stderr.isatty())
        engine.rounds_cache.clear()           # the dry run's buffers and graphs hold garbage
    warm_request(engine, args.prompt, args.max_new_tokens, args.mode, args.budget, args.temperature, args.seed, table)


def time_line(stats):
    """Where the command's time went (exclusive seconds per phase) and what the kernel cache did."""
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in stats["time_s"].items())
    k = stats.get("kernels")
    cached = f"; kernels: {k['hits']} loaded, {k['misses']} compiled" if k else ""
    return f"time: {parts}{cached}"


def summary(stats, block_size=None):
    """The stats line: the mode with its own knob (ddtree: budget, dflash: block size), then tokens, acceptance
    (not for ar: it commits one token a round) and timings."""
    hist = " ".join(f"{t}:{n}" for t, n in enumerate(stats["tau_hist"]) if n)
    phases = " ".join(f"{k} {v:.3f}s" for k, v in stats["phase_s"].items())
    mode = {"ddtree": f"ddtree (budget {stats['budget']}{auto_part(stats)})",
            "dflash": f"dflash (block {block_size})"}
    tau = "" if stats["mode"] == "ar" else f"tau {stats['tau_mean']:.2f} [{hist}], "
    return (f"{mode.get(stats['mode'], stats['mode'])}: {stats['new_tokens']} tokens in {stats['rounds']} rounds, "
            f"{tau}{stats['tokens_per_s']:.1f} tokens/s, prefill {stats['prefill_s']:.3f}s, {phases}, "
            f"stop: {stats['stop_reason']}")


def auto_part(stats):
    """Budget auto in the stats line: rounds per chosen size and the expected tau beside the observed one."""
    if "budget_hist" not in stats:
        return ""
    sizes = " ".join(f"{k}:{n}" for k, n in stats["budget_hist"].items())
    return f": sizes [{sizes}], expected tau {stats['expected_tau']:.2f}"


def pick_backend(args, draft):
    """The backend to load, after the checks that need the whole command line."""
    if args.mode != "ar" and draft is None:
        raise UsageError(f"--mode {args.mode} needs a drafter: pass --draft DIR, or use --mode ar")
    if args.cost_table and args.budget != AUTO:
        raise UsageError("--cost-table is read by --budget auto only")
    host_trees = args.show_tree or args.tree_svg
    if host_trees and args.backend in ("cuda", "sim"):
        raise UsageError("--show-tree and --tree-svg read the trees on the host: use --backend numpy (the kernel "
                         "backends keep them on the device)")
    if args.tree_svg:
        require_matplotlib()
        Path(args.tree_svg).mkdir(parents=True, exist_ok=True)
    backend = "numpy" if host_trees else args.backend
    check_devices(args.devices, backend, host_trees)
    return backend


def check_devices(devices, backend, host_trees):
    """--devices shards over GPUs: refused on numpy (the API simulates a layout there; the CLI would run it
    silently on one CPU)."""
    if devices is None or backend not in ("numpy", "auto"):
        return
    if backend == "numpy":
        why = "--show-tree and --tree-svg run on numpy" if host_trees else "--backend numpy"
    elif not gpu_ready():
        why = "no GPU is ready, so --backend auto picks numpy"
    else:
        return
    raise UsageError(f"--devices needs the cuda backend; this run is on numpy ({why})")


def record(args, model, draft, tokens, text, stats, trees, interrupted=False):
    """The --json object."""
    out = dict(model=str(model) if model else None, draft=str(draft) if draft else None, prompt=args.prompt, tokens=tokens, text=text,
               stats=stats, interrupted=interrupted)
    if args.show_tree:
        out["rounds"] = trees
    return out


def interrupted(args, model, draft, watch):
    """Ctrl-C: the text so far (or the --json object with "interrupted": true) on stdout, a note on stderr."""
    tokens = watch.tokens if watch else []
    text = watch.tok.decode(tokens) if watch else ""
    if watch:
        watch.end_progress()
    if args is not None and args.json:
        stats, trees = (watch.stats(), watch.trees) if watch else (None, [])
        print(json.dumps(record(args, model, draft, tokens, text, stats, trees, interrupted=True)))
    elif watch:
        watch.stream.finish(text)
    print(f"interrupted after {len(tokens)} tokens", file=sys.stderr)
    return 130


def main(argv=None):
    args = model = draft = watch = None
    before, t0 = totals(), perf_counter()
    try:
        args = parse_args(argv)
        kernel_cache.configure(args.kernel_cache, enabled=not args.no_kernel_cache)
        model, draft, how = pick_models(args.model, args.draft)
        print(f"model: {model}  draft: {draft}  ({how})", file=sys.stderr)
        backend = pick_backend(args, draft)
        table = CostTable.load(args.cost_table) if args.cost_table else None
        engine = Engine.load(model, draft if args.mode != "ar" else None, backend=backend,
                             max_context=args.max_context, devices=args.devices)
        prepare(engine, args, table)
        live = sys.stdout.isatty() and not args.json and not args.show_tree
        watch = Watcher(args, engine.tokenizer, Stream(engine.tokenizer, sys.stdout, live))
        result = engine.generate(args.prompt, args.max_new_tokens, args.mode, args.budget, args.temperature,
                                 args.seed, stop_ids(args.stop), on_round=watch, cost_table=table)
    except KeyboardInterrupt:
        return interrupted(args, model, draft, watch)
    except (UsageError, ValueError, OSError, ImportError, NotImplementedError, MemoryError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    watch.end_progress()
    result.stats["time_s"] = {**delta(before), "wall": round(perf_counter() - t0, 3)}
    if engine.backend == "cuda":
        result.stats["kernels"] = kernel_cache.stats()
    if args.json:
        print(json.dumps(record(args, model, draft, result.tokens, result.text, result.stats, watch.trees)))
    else:
        watch.stream.finish(result.text)
        print(summary(result.stats, getattr(engine.drafter, "block_size", None)), file=sys.stderr)
        print(time_line(result.stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
