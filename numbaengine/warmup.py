"""Fill the kernel cache ahead of use: `python -m numbaengine.warmup` compiles every kernel of the requested
shapes in parallel, so that later runs load them (kernels/cache.py) instead of compiling ~100 kernels one by one.

precompile(run_once) is the mechanism: run_once() runs as a dry run in which launch() runs nothing and hands each
kernel whose cache entry is missing to a pool of worker processes, which compile them and write the entries.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from numbaengine import phases
from numbaengine.kernels import cache

PROMPT = "def fibonacci(n):"


@dataclass(frozen=True)
class Precompiled:
    found: int             # kernels the dry run found neither compiled nor cached
    compiled: int          # of them compiled by the workers, their entries written
    failed: tuple          # "kernel: why" of those left to compile on first use
    seconds: float


def precompile(run_once, workers=None, progress=True) -> Precompiled:
    """Compile, in `workers` processes (default: one per core), the kernels that run_once() launches and the cache
    lacks. run_once runs as a dry run: nothing is launched, so what it computes is garbage. Its errors are ignored,
    it must end on its own (bound its loops), and state it leaves behind (buffers, captured graphs) must be dropped.
    Each missing kernel goes to the pool as the dry run meets it; one the host compiles itself (to query it) waits
    for its worker. A kernel a worker cannot compile is left to the lazy path (one warning line). Every kernel the
    dry run met, cached or just compiled, is loaded before this returns (phase "load"), so the real run after it
    loads nothing at first launch."""
    t0 = time.perf_counter()
    if not cache.enabled():
        return Precompiled(0, 0, (), 0.0)
    jobs = {}                                      # future -> kernel name
    pool = ProcessPoolExecutor(workers or os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=cache.configure, initargs=(str(cache.cache_dir()),))
    with pool:
        with cache.recording(lambda key, kc, argtypes: _submit(pool, jobs, key, kc, argtypes)) as found, \
                phases.warming():                   # the dry run's prefill and decode are not the real run's
            try:
                run_once()
            except Exception:  # host code reading results that were never computed
                pass
        with phases.span("compile"):
            failed = _collect(jobs, progress)
    cache.load_compiled(found)
    if failed:
        cache.warn(f"{len(failed)} of {len(jobs)} kernels left to compile on first use (first: {failed[0]})")
    return Precompiled(len(jobs), len(jobs) - len(failed), tuple(failed), round(time.perf_counter() - t0, 3))


def _submit(pool, jobs, key, kernel_cache, argtypes) -> Future:
    """Hand one kernel to the pool: its function pickled by value, options, argument types and key."""
    try:
        import cloudpickle
    except ImportError:  # numba-cuda carries a copy
        from numba.cuda import cloudpickle
    try:
        trace = {}
        parts = cache.key_parts(kernel_cache.py_func, argtypes, kernel_cache.targetoptions,
                                cache.toolchain(cache.current_cc()), trace)
        blob = cloudpickle.dumps((kernel_cache.py_func, kernel_cache.targetoptions, argtypes, key, parts, trace))
        future = pool.submit(compile_job, blob)
    except Exception as e:  # cannot be pickled: a future that says so
        future = Future()
        future.set_exception(e)
    jobs[future] = kernel_cache.py_func.__qualname__
    return future


def _collect(jobs, progress) -> list[str]:
    """Wait for the jobs, a progress line on stderr -> "kernel: why" of each failure."""
    failed = []
    for done, future in enumerate(as_completed(jobs), 1):
        try:
            future.result()
        except Exception as e:  # the worker's compile error, a worker that died, a pickling error
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            if "bootstrapping phase" in str(e):      # spawn re-imported a script that has no main guard
                why = "the workers could not start: call it under `if __name__ == \"__main__\":` in a script"
            failed.append(f"{jobs[future]}: {why}")
        if progress:
            print(f"\rcompiling kernels {done}/{len(jobs)}", end="", file=sys.stderr, flush=True)
    if progress and jobs:
        print(file=sys.stderr)
    return failed


def compile_job(blob: bytes):
    """Worker: rebuild the recorded kernel from its pickled function and options, check that its key here is the
    parent's (a module global changed at run time would differ), compile it; the cache writes the entry."""
    import pickle

    from numba.cuda.dispatcher import CUDADispatcher
    py_func, options, argtypes, key, parts, trace = pickle.loads(blob)
    disp = cache.install(CUDADispatcher(py_func, targetoptions=options))
    if disp._cache.key(argtypes) != key:
        raise RuntimeError(f"its key differs in a fresh process: {_differs(parts, trace, py_func, argtypes, options)}")
    disp.compile(argtypes)


def _differs(parts, trace, py_func, argtypes, options) -> str:
    """Which parts of a kernel's key differ here from the parent's (for the function: the deepest value it reads
    that differs, by path), or why it is uncacheable here."""
    here_trace = {}
    try:
        here = cache.key_parts(py_func, argtypes, options, cache.toolchain(cache.current_cc()), here_trace)
    except cache.Uncacheable as e:
        return f"uncacheable here ({e})"
    names = ("function and what it reads", "argument types", "options", "toolchain")
    where = cache.first_difference(trace, here_trace)
    return ", ".join(n + (f" (at {where})" if i == 0 and where else "")
                     for i, (n, a, b) in enumerate(zip(names, parts, here)) if a != b) or "?"


# ------------------------------------------------------------------------------------------------ command line
class UsageError(Exception):
    """Bad command-line input: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
    return values


def budget_list(text):
    """Comma-separated tree budgets: positive integers, or auto (the size chosen each round)."""
    from numbaengine.budget import AUTO
    try:
        values = [v if v == AUTO else int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want positive integers or {AUTO}, separated by commas") from None
    if any(v != AUTO and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: budgets must be positive")
    return values


def parser():
    from numbaengine.ddtree import MODES
    ap = Parser(prog="python -m numbaengine.warmup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target checkpoint folder (default: the shipped toy target)")
    ap.add_argument("--draft", help="DFlash drafter folder (default: the shipped drafter with the shipped target)")
    ap.add_argument("--batches", type=int_list, default=[1], help="batch sizes (default: 1)")
    ap.add_argument("--budgets", type=budget_list, default=[16], help="tree budgets of ddtree / dflash, or auto "
                    "(ddtree; its round cost table is measured and kept too) (default: 16)")
    ap.add_argument("--modes", default="ddtree", help=f"comma-separated, of {', '.join(MODES)} (default: ddtree)")
    ap.add_argument("--max-context", type=int, default=4096, help="cache rows per sequence (default: 4096)")
    ap.add_argument("--workers", type=int, help="compiling processes (default: one per core)")
    ap.add_argument("--kernel-cache", metavar="DIR", help="cache folder (default: NUMBAENGINE_CACHE_DIR or "
                    "~/.cache/numbaengine/kernels)")
    ap.add_argument("--size", action="store_true", help="print the cache's entries and size, then exit")
    ap.add_argument("--clear", action="store_true", help="remove the cache's entries, then exit")
    return ap


def shapes(args) -> list[tuple[str, int, int]]:
    """(mode, batch, budget) to warm: every mode x batch, times the budgets for the modes that draft (auto: ddtree
    only)."""
    from numbaengine.budget import AUTO
    from numbaengine.ddtree import MODES
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"--modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    return [(m, b, k if m != "ar" else 0) for m in modes for b in args.batches
            for k in (args.budgets if m != "ar" else [0]) if m == "ddtree" or k != AUTO]


@dataclass
class RoundLimit:
    """on_round callback that ends a generate (RuntimeError) after `rounds` decode rounds."""
    rounds: int
    seen: int = 0

    def __call__(self, index, out, tokens):
        if out is not None:
            self.seen += 1
            if self.seen > self.rounds:
                raise RuntimeError("round limit")


def precompile_shapes(engine, todo, workers=None, progress=True) -> Precompiled:
    """precompile() the kernels of every (mode, batch, budget) in `todo` on `engine`: a dry run of each shape (no
    stop token, out after 3 rounds: eager, captured, replayed, whatever garbage tau the never-run rounds return),
    then the dry run's buffers and graphs are dropped."""
    def dry_run_all():
        for mode, batch, budget in todo:
            try:
                engine.generate_batch([PROMPT] * batch, 16, mode, budget, stop=(), on_round=RoundLimit(3))
            except Exception:  # garbage results (or the round limit); the next shape still records its kernels
                pass
    done = precompile(dry_run_all, workers, progress)
    engine.rounds_cache.clear()
    return done


def warm_rounds(engine, rounds_of, batch, mode, budget, progress=True):
    """A server's rounds made ready before its first request (cuda): the kernels of every bucket of up to `batch`
    sequences precompiled (a dry run on throwaway rounds), then each bucket run once for real on the rounds that
    rounds_of() returns, so that every bucket's graph is captured and, for budget auto, the cost table measured, and
    every prefill graph size run (warm_prefill). -> those rounds (other backends: rounds_of() as is)."""
    from numbaengine.budget import AUTO, LADDER
    from numbaengine.device_round import buckets
    from numbaengine.generate import generate_on
    from numbaengine.rounds import tree_width
    if engine.backend != "cuda":
        return rounds_of()
    width = tree_width(mode, max(LADDER) if budget == AUTO else budget, engine.drafter)
    new = 3 * (width + 1)                # three rounds at least: eager, captured, replayed

    def run(rounds, n, on_round=None):
        generate_on(rounds, engine.tokenizer, [PROMPT] * n, new, mode, budget, stop=(), on_round=on_round)

    def dry_run():
        for n in buckets(batch):
            dry = rounds_of()                            # new slots: a run cut short keeps its slot
            try:
                run(dry, n, RoundLimit(3))
            except Exception:  # garbage results (or the round limit): the next bucket still records its kernels
                pass
        with contextlib.suppress(Exception):
            warm_prefill(dry.dev)
    t0 = time.perf_counter()
    precompile(dry_run, progress=progress)
    engine.rounds_cache.clear()          # the dry run's buffers and graphs hold garbage
    rounds = rounds_of()
    with phases.warming():
        for n in buckets(batch):
            run(rounds, n)
        warm_prefill(rounds.dev)
    if progress:
        print(f"rounds ready for batches {', '.join(map(str, buckets(batch)))} ({mode}, budget {budget}) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rounds


def warm_request(engine, prompt, max_new, mode, budget, temperature=0.0, seed=0, cost_table=None):
    """cuda: run a request twice, cut to about three rounds (eager, captured, replayed) and without stop tokens,
    under phases.warming(), so that the real run after it replays graphs from its first token (a prefill plan is
    captured on its second use). The first launches and captures land in "warmup" and "capture", not in the real
    run's prefill and decode. Other backends: nothing."""
    from numbaengine.budget import AUTO, LADDER
    from numbaengine.rounds import tree_width
    if engine.backend != "cuda":
        return
    width = tree_width(mode, max(LADDER) if budget == AUTO else budget, engine.drafter)
    with phases.warming():
        for _ in range(2):
            engine.generate(prompt, min(max_new, 3 * (width + 1)), mode, budget, temperature, seed, stop=(),
                            cost_table=cost_table)


def warm_prefill(dev):
    """Every prefill graph size of DeviceRounds `dev` (prefill_rows) run three times (eager, captured, replayed) on
    slot 0, a piece of zeros, so that no prompt length captures a graph later; the slot is retired after."""
    import numpy as np
    for size in dev.prefill_rows:
        if size < dev.cap:
            for _ in range(3):
                dev.prefill_part(0, np.zeros(size + 1, np.int32), 0, size)
    dev.retire([0])


def report() -> str:
    entries, size = cache.usage(cache.cache_dir())
    return f"kernel cache {cache.cache_dir()}: {entries} entries, {size / 1e6:.1f} MB"


def warm(args):
    """Load the engine on the GPU, precompile every shape's kernels, then run each shape once for real (a budget
    auto shape measures its round cost table there and keeps it beside the kernels: numbaengine/cost_store.py)."""
    from numbaengine.engine import Engine
    from numbaengine.weights import SHIPPED_PAIR
    todo = shapes(args)
    model = args.model or SHIPPED_PAIR / "target"
    draft = args.draft or (SHIPPED_PAIR / "draft" if args.model is None else None)
    engine = Engine.load(model, draft, backend="cuda", max_context=args.max_context)
    done = precompile_shapes(engine, todo, args.workers)
    for mode, batch, budget in todo:
        engine.generate_batch([PROMPT] * batch, 8, mode, budget)
    s = cache.stats()
    print(f"precompiled {done.compiled} of {done.found} kernels in {done.seconds:.1f} s; then {s['hits']} loaded, "
          f"{s['misses']} compiled ({s['compile_s']:.1f} s)", file=sys.stderr)
    for why in s["uncacheable_why"]:         # compiled again by every process
        print(f"not cacheable: {why}", file=sys.stderr)


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.kernel_cache:
            cache.configure(args.kernel_cache)
        if args.clear:
            print(f"removed {cache.clear(cache.cache_dir())} files from {cache.cache_dir()}")
        if args.size or args.clear:
            print(report())
            return 0
        shapes(args)
        for flag, folder in (("--model", args.model), ("--draft", args.draft)):
            if folder and not os.path.isdir(folder):
                raise UsageError(f"{flag}: {folder} is not a folder")
        if args.workers is not None and args.workers < 1:
            raise UsageError("--workers: must be at least 1")
        from numbaengine.backends import gpu_ready
        if not gpu_ready():
            raise UsageError("no CUDA GPU here: kernels are compiled for the GPU that will run them")
        if not cache.enabled():
            raise UsageError("the kernel cache is off (NUMBAENGINE_KERNEL_CACHE=0)")
        warm(args)
    except (UsageError, ValueError, OSError, MemoryError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
