"""Where a round's GPU time goes, kernel by kernel: one round launched eagerly with a CUDA event pair around every
numba kernel launch, grouped by phase and kernel. On the lent GPU:

    python -m tools.profile_round --mode ddtree --budget 16 --out profile.json
    python -m tools.profile_round --synth-k2 2 --mode ddtree --budget 16
    python -m tools.profile_round --synth-k2 61 --rank-of 8 --mode ar     (one GPU's share of the 8-GPU layout)

Each timed launch waits behind a 2 ms sleeping kernel, so the host's launch cost lands inside the sleep and the
event pair times the kernel alone (without the sleep each pair timed numba's eager launch cost: 100-500 us).
Kernels so timed run one at a time from an idle GPU: about 1.5-2x what the same kernel costs as a node of the
captured round (H200, pair: 1.48 ms summed vs a 0.80 ms DDTree-16 round), so compare rows with each other (ar
against ddtree), not with round times. CuPy's own kernels (copies, fills) are not in the table. --each lists every
launch in order with its grid.
The round runs on the engine's device buffers; lengths and bonus tokens are restored afterwards.
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

from numbaengine.rank_shard import set_drafter
from numbaengine.weights import SHIPPED_PAIR
from tools.bench import LAYOUTS, PROMPTS, add_rank_args, check_rank_args, rank_setup, synth_k2
from tools.gpu import require_gpu

HOLD_NS = 2_000_000     # the sleep ahead of each timed launch: longer than one eager launch takes on the host
                        # (200 us was not: numba's launch of a kernel with 15 array arguments took longer)


def _hold_kernel():
    from numba import cuda

    @cuda.jit
    def hold(ns):
        for _ in range(ns // 20_000):
            cuda.nanosleep(20_000)
    return hold


def profile(cp, dev) -> tuple:
    """One eager round of DeviceRounds `dev`: ([(phase, kernel, launches, total ms)] slowest first,
    [(phase, kernel, grid, block, ms)] in launch order)."""
    from numba.cuda.dispatcher import _LaunchConfiguration

    from numbaengine.kernels.launch import current_stream
    records, phase, hold, host = [], ["-"], _hold_kernel(), [0.0]
    launch = _LaunchConfiguration.__call__

    def timed(cfg, *args):
        s = cp.cuda.get_current_stream()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        launch(hold[1, 1, current_stream()], HOLD_NS)   # the GPU sleeps while the host enqueues pair + kernel
        t0 = time.perf_counter()
        a.record(s)
        out = launch(cfg, *args)
        b.record(s)
        host[0] = max(host[0], time.perf_counter() - t0)
        records.append((phase[0], getattr(cfg.dispatcher.py_func, "__name__", "?"), tuple(cfg.griddim),
                        tuple(cfg.blockdim), a, b))
        return out

    saved = [a.copy() for a in (dev.lengths, dev.bonus)]
    _LaunchConfiguration.__call__ = timed
    branches, dev.ops.branches = dev.ops.branches, False       # one launch at a time: no parallel branches
    try:
        with dev.stream:
            dev.round(lambda p: phase.__setitem__(0, p))
    finally:
        _LaunchConfiguration.__call__ = launch
        dev.ops.branches = branches
    dev.stream.synchronize()
    dev.lengths[...], dev.bonus[...] = saved
    dev.stream.synchronize()
    if host[0] > 0.8 * HOLD_NS / 1e9:
        raise RuntimeError(f"profile: an eager launch took {host[0] * 1e6:.0f} us on the host, near the "
                           f"{HOLD_NS / 1e3:.0f} us sleep ahead of it: its events would time the host; raise HOLD_NS")
    each = [(ph, name, grid, block, cp.cuda.get_elapsed_time(a, b)) for ph, name, grid, block, a, b in records]
    table = collections.defaultdict(lambda: [0, 0.0])
    for ph, name, _, _, ms in each:
        table[ph, name][0] += 1
        table[ph, name][1] += ms
    return sorted(((ph, name, n, ms) for (ph, name), (n, ms) in table.items()), key=lambda r: -r[3]), each


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_PAIR / "target"))
    ap.add_argument("--draft", default=str(SHIPPED_PAIR / "draft"))
    ap.add_argument("--synth-k2", type=int, metavar="LAYERS")
    ap.add_argument("--mode", default="ddtree")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--each", action="store_true", help="also list every launch in order")
    add_rank_args(ap, "split")
    ap.add_argument("--out", default="profile.json")
    args = ap.parse_args(argv)
    args.devices = args.synth_dir = None                               # (read by tools.bench's rank checks)
    try:
        layouts = check_rank_args(args)
        if len(layouts) > 1:
            raise ValueError(f"--drafter-layout: one of {', '.join(LAYOUTS)} here, got {args.drafter_layout!r}")
    except ValueError as e:
        ap.exit(2, f"profile_round: {e}\n")
    require_gpu("python -m tools.profile_round")
    import cupy as cp

    from numbaengine import Engine
    model, draft, tmp = Path(args.model), Path(args.draft), None
    if args.rank_of:
        shard, draft_cfg, _ = rank_setup(args, [(args.mode, args.batch, args.budget)], layouts, args.max_context, cp)
        engine = shard.engine
        if args.mode != "ar":
            set_drafter(shard, draft_cfg, layouts[0] == "split")
    else:
        if args.synth_k2:
            tmp = tempfile.TemporaryDirectory(prefix="k2_")
            model, draft = synth_k2(args.synth_k2, Path(tmp.name))
        engine = Engine.load(model, draft, backend="cuda", max_context=args.max_context)
    prompts = (PROMPTS * args.batch)[:args.batch]
    if args.synth_k2:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * args.batch
    engine.generate_batch(prompts, 8, mode=args.mode, budget=args.budget, stop=[])   # compile, size, capture
    dev = next(iter(engine.rounds_cache.values()))
    profile(cp, dev)                                                   # warm the event path once
    rows, each = profile(cp, dev)
    total = sum(r[3] for r in rows)
    by_phase = collections.Counter()
    for ph, _, _, ms in rows:
        by_phase[ph] += ms
    print(f"{args.mode} budget {args.budget} batch {args.batch}: {sum(r[2] for r in rows)} launches, "
          f"{total:.3f} ms of kernel time; by phase: " + ", ".join(f"{k} {v:.3f}" for k, v in by_phase.items()))
    for ph, name, n, ms in rows:
        print(f"{ph:7s} {name:32s} x{n:<4d} {ms * 1e3:9.1f} us  {100 * ms / total:5.1f}%")
    for ph, name, grid, block, ms in each if args.each else ():
        print(f"  {ph:7s} {name:32s} grid {grid!s:14s} block {block!s:12s} {ms * 1e3:7.1f} us")
    name = f"synthetic K2.6 x{args.synth_k2}" if args.synth_k2 else str(model)
    if args.rank_of:
        name += f", rank {args.rank} of {args.rank_of} (collectives: {args.all_reduce}), drafter {layouts[0]}"
    out = dict(mode=args.mode, budget=args.budget, batch=args.batch, model=name, total_ms=total,
               by_phase=dict(by_phase), rows=[dict(phase=p, kernel=k, launches=n, ms=ms) for p, k, n, ms in rows],
               each=[dict(phase=p, kernel=k, grid=g, block=b, ms=ms) for p, k, g, b, ms in each])
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
